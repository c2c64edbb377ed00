"""The native CPU decode step (pagedchat/native): one C call per decode step of a Llama-family or Gemma 3 model.

It must compute what the torch path computes (logits and the K/V it writes, up to float summation order) on
every architecture it binds to, fp32 and int8, one thread or two, over scattered block tables and a pool whose
unused slots hold NaN; the engine must use it for plain decode steps and nothing else; and every way it can be
unavailable (another family, another dtype, no compiler, PAGEDCHAT_NATIVE=0) must leave the torch path working.
"""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_models import ARCHS
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.attention import AttentionMetadata
from pagedchat.model.quantize import Int4Linear, Int8Linear
from pagedchat.native import build

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.skipif(build.load(wait=True) is None, reason="no native build here (no C compiler?)")


@pytest.fixture(autouse=True)
def native_always(monkeypatch):
    """The engine takes the native step for every step it covers, without measuring the torch path against
    it (pagedchat/native/paths.py): these tests count the native steps."""
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "always")


def engine_for(path, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, block_size=8, **kwargs),
                  show_progress=False)


def scattered_step(runner, lens: list[int], seed: int, new: list[int] | None = None):
    """A step over sequences of these lengths, each with new[i] tokens in the step (1: a decode step; more: a
    verify step, causal among its tokens): blocks in a shuffled order, the context K/V random, every other
    slot of the pool NaN (the step must read only what each token may see)."""
    new = new or [1] * len(lens)
    g = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    needed = [-(-n // bs) for n in lens]
    order = torch.randperm(runner.num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    width = max(needed)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    for cache in runner.k_caches + runner.v_caches:
        cache.fill_(float("nan"))
        for t, n, k in zip(tables, lens, new):
            slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n - k)], dtype=torch.long)
            cache.view(-1, *cache.shape[2:])[slots] = torch.randn(len(slots), *cache.shape[2:], generator=g)
    ids = torch.randint(3, runner.loaded.spec.vocab_size, (sum(new),), generator=g)
    positions = torch.tensor([p for n, k in zip(lens, new) for p in range(n - k, n)])
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, n, k in zip(tables, lens, new) for p in range(n - k, n)])
    cu = torch.tensor([0] + new, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(slots, table, torch.tensor(lens, dtype=torch.int32), cu, max(new) == 1, max(lens))
    return ids, positions, meta


@torch.inference_mode()
def torch_step(runner, ids, positions, meta) -> torch.Tensor:
    return runner.model.compute_logits(runner.model(ids, positions, meta))


@contextlib.contextmanager
def torch_threads(count: int):
    old = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def both_steps(runner, lens: list[int], seed: int, threads: int = 1, new: list[int] | None = None):
    """One step (scattered_step) through the torch path, then from the same pool through the native step on
    `threads` threads: (torch logits, native logits, the K/V torch wrote at the new slots, the K/V the native
    step wrote there), one entry per cache in each list."""
    ids, positions, meta = scattered_step(runner, lens, seed, new)
    caches = runner.k_caches + runner.v_caches
    saved = [c.clone() for c in caches]

    def new_slots():
        return [c.view(-1, *c.shape[2:])[meta.slot_mapping].clone() for c in caches]

    expected = torch_step(runner, ids, positions, meta)
    torch_wrote = new_slots()
    for cache, old in zip(caches, saved):
        cache.copy_(old)
    with torch_threads(threads):
        got = runner.native.step(ids, positions, meta.block_tables, meta.cu_seqlens_q)
    return expected, got, torch_wrote, new_slots()


def int8_blocks_forward(self, x: torch.Tensor) -> torch.Tensor:
    """An int8 layer as the native step computes it: the input quantized per block of 32 (scale max|x| / 127,
    round half to even), each block's dot product with the int8 weight exact, scaled by the block's scale,
    summed over blocks, then the row's scale and the bias."""
    rows = x.reshape(-1, self.in_features).float()
    blocks = rows.view(rows.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    q = (blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).round()
    weight = self.weight.view(self.out_features, -1, 32).double()
    dots = torch.einsum("nkj,okj->nok", q.double(), weight)  # exact: integers
    out = (dots * (amax / 127).double().squeeze(-1)[:, None, :]).sum(-1).float() * self.scales
    out = out.view(*x.shape[:-1], self.out_features)
    return out if self.bias is None else out + self.bias


class Int4Module(Int4Linear):
    """model/quantize.py's int4 layer (packed, scales, bias: what the native step binds to by those tensors)
    computing the plain dequantized product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagedchat.model.int4 import dequantize_int4

        out = x @ dequantize_int4(self.packed, self.scales).T
        return out if self.bias is None else out + self.bias


def int4_blocks_forward(self, x: torch.Tensor) -> torch.Tensor:
    """An int4 layer as the native step computes it: the input quantized per block of 32 as for int8, each
    group's dot product with the int4 values exact, scaled by (group scale x block scale) in fp32, summed."""
    from pagedchat.model.int4 import unpack_int4

    rows = x.reshape(-1, self.in_features).float()
    blocks = rows.view(rows.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    q = (blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).round()
    weight = unpack_int4(self.packed).view(self.out_features, -1, 32).double()
    dots = torch.einsum("nkj,okj->nok", q.double(), weight)
    scale = self.scales.float()[None] * (amax / 127).squeeze(-1)[:, None, :]
    out = (dots * scale.double()).sum(-1).float().view(*x.shape[:-1], self.out_features)
    return out if self.bias is None else out + self.bias


def int4_model(runner) -> None:
    """Every linear layer of the runner's model as an Int4Module computing the native arithmetic; the native
    step bound again to it."""
    import types

    from pagedchat.model.layers import linear_children
    from pagedchat.native.step import NativeDecode

    for module, name, child in linear_children(runner.model):
        int4 = Int4Module(child)
        int4.forward = types.MethodType(int4_blocks_forward, int4)
        setattr(module, name, int4)
    runner.native = NativeDecode.bind(runner.model, runner.k_caches, runner.v_caches, runner.block_size)


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor, int8: bool = False, tol: float = 1e-4,
                        tokens: list[int] | None = None) -> None:
    """Logits (or any per-token rows: the K/V a step wrote) equal up to summation order. With int8 layers, the
    two sides quantize activations computed in another summation order: a value within float rounding of a
    half step rounds one way here and the other there (about 1 in 10^4 values), which moves that row's logits
    by up to a few tenths on these tiny models (their weights are large). So a step may hold a few such tokens,
    with the later tokens of their sequences in a verify step, which attend to their K/V (tokens: each
    sequence's tokens in the step, row order; None: one row each): at most a third of the sequences (two
    where there are fewer), none off by half a logit or more. A wrong kernel moves every row, by more; the kernels themselves are held to 1e-5
    on the same input (test_each_weight_format_computes_torchs_product)."""
    if not int8:
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        return
    got, expected = got.reshape(got.shape[0], -1), expected.reshape(expected.shape[0], -1)
    off = ~torch.isclose(got, expected, rtol=tol, atol=tol).all(dim=-1)
    seq = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(tokens)) if tokens else \
        torch.arange(got.shape[0])
    allowed = max(2, (int(seq.max()) + 1) // 3)
    assert seq[off].unique().numel() <= allowed and (got - expected).abs().max() < 0.5, \
        (off, (got - expected).abs().max())


def native_int8_arithmetic(model) -> None:
    """The torch path's int8 layers compute what the native step's do (int8_blocks_forward)."""
    import types

    for module in model.modules():
        if isinstance(module, Int8Linear) and module.in_features % 32 == 0:
            module.forward = types.MethodType(int8_blocks_forward, module)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_computes_the_torch_step(model_dirs, arch, quantize, threads):
    engine = engine_for(model_dirs[arch][0], quantize=quantize)
    runner = engine.runner
    assert runner.native is not None, f"{arch} should bind the native step"
    native_int8_arithmetic(runner.model)
    for seed, lens in enumerate([[1], [37], [5, 17, 2, 30, 9], [8] * 6]):
        expected, got, torch_wrote, native_wrote = both_steps(runner, lens, seed, threads)
        assert torch.isfinite(got).all()
        assert_logits_close(got, expected, int8=quantize == "int8")
        for wrote, want in zip(native_wrote, torch_wrote):
            assert_logits_close(wrote, want, int8=quantize == "int8", tol=1e-5)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """Head sizes the native step keeps in registers (64, 128, 256; the tiny test models have 16 and 32)."""
    from hf_models import build_model

    root = tmp_path_factory.mktemp("wide-heads")
    made = {}
    for head_dim, heads, kv in ((64, 4, 2), (128, 2, 1), (256, 2, 2)):
        path = root / f"d{head_dim}"
        made[head_dim] = (path, build_model("qwen2", path, hidden_size=head_dim * heads, num_attention_heads=heads,
                                            num_key_value_heads=kv, intermediate_size=96, num_hidden_layers=1))
    return made


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_native_step_on_head_sizes_kept_in_registers(wide_heads, head_dim):
    engine = engine_for(wide_heads[head_dim][0])
    runner = engine.runner
    assert runner.native is not None and runner.loaded.spec.head_dim == head_dim
    for seed, lens in enumerate([[1], [45], [5, 17, 2, 30]]):
        expected, got, _, _ = both_steps(runner, lens, seed)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    path, hf = wide_heads[head_dim]
    prompt = [5 + i for i in range(20)]
    assert_greedy_equal(engine.generate([prompt], GREEDY.with_(ignore_eos=False))[0].outputs[0].token_ids,
                        *reference(hf, prompt, GREEDY.max_tokens))


@pytest.fixture(scope="module")
def property_engines(model_dirs):
    return {(arch, q): engine_for(model_dirs[arch][0], quantize=q) for arch, q in (("llama", None), ("qwen3", "int8"))}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 56), min_size=1, max_size=9), seed=st.integers(0, 2**16),
       which=st.sampled_from([("llama", None), ("qwen3", "int8")]), threads=st.sampled_from([1, 2]),
       data=st.data())
def test_any_batch_of_decode_steps_equals_the_torch_step(property_engines, lens, seed, which, threads, data):
    """Random batch sizes, context lengths (within a block, across blocks, ending mid-block), block orders, and
    tokens per sequence (1: decode; more: a verify step)."""
    runner = property_engines[which].runner
    native_int8_arithmetic(runner.model)
    new = [data.draw(st.integers(1, min(n, 9))) for n in lens] if data.draw(st.booleans()) else None
    expected, got, _, _ = both_steps(runner, lens, seed, threads, new)
    assert_logits_close(got, expected, int8=which[1] == "int8", tokens=new)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_native_verify_step_computes_the_torch_step(model_dirs, arch, threads):
    """Speculative decoding's verify steps: k + 1 tokens per sequence, each seeing the context up to itself
    (a whole sequence in one step included: more queries than one pass over the context takes)."""
    runner = engine_for(model_dirs[arch][0]).runner
    for seed, (lens, new) in enumerate([([9], [5]), ([20, 7, 33], [3, 1, 8]), ([16, 17], [16, 2])]):
        expected, got, torch_wrote, native_wrote = both_steps(runner, lens, seed, threads, new)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for wrote, want in zip(native_wrote, torch_wrote):
            torch.testing.assert_close(wrote, want, rtol=1e-5, atol=1e-5)


def check_linear_formats(lib=None) -> None:
    """Every weight format's tiles against torch on the same input: row counts that leave a tail, batch sizes
    that fill tiles and leave partial ones, an input size that is not a multiple of the int8 block (its layer
    keeps fp32 activations)."""
    from torch import nn

    from pagedchat.native.step import run_linear

    g = torch.Generator().manual_seed(0)
    for rows, in_features in ((37, 64), (8, 96), (70, 100)):
        linear = nn.Linear(in_features, rows)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(rows, in_features, generator=g))
            linear.bias.copy_(torch.randn(rows, generator=g))
        int8 = Int8Linear(linear)
        for batch in (1, 2, 3, 5, 9):
            x = torch.randn(batch, in_features, generator=g)
            torch.testing.assert_close(run_linear(linear, x, lib), linear(x), rtol=1e-5, atol=1e-5)
            want = int8_blocks_forward(int8, x) if in_features % 32 == 0 else int8.dequantized_matmul(x) + int8.bias
            torch.testing.assert_close(run_linear(int8, x, lib), want, rtol=1e-5, atol=1e-5)
            if in_features % 32 == 0:
                int4 = Int4Module(linear)
                torch.testing.assert_close(run_linear(int4, x, lib), int4_blocks_forward(int4, x), rtol=1e-5, atol=1e-5)


def test_each_weight_format_computes_torchs_product():
    check_linear_formats()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_step_with_int4_layers(model_dirs, arch, threads):
    """int4 weights (pagedchat/model/int4.py), bound by their packed and scales tensors: decode and verify
    steps against the torch path computing the same arithmetic."""
    runner = engine_for(model_dirs[arch][0]).runner
    int4_model(runner)
    assert runner.native is not None
    for seed, (lens, new) in enumerate([([1], None), ([5, 17, 2, 30, 9], None), ([20, 7, 33], [3, 1, 8])]):
        expected, got, _, _ = both_steps(runner, lens, seed, threads, new)
        assert_logits_close(got, expected, int8=True)


# -- an int8 pool (kernels/kv_quant.py): K/V int8 with one float16 scale per (slot, kv head) -------------------
def quantize_heads(lib, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """decode.c's quantizer on rows of x [n, D]: (int8 values, float16 scales)."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], dtype=torch.float16)
    lib.pc_quantize_heads(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
                          ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(scales.data_ptr()))
    return q, scales


def awkward_heads(D: int = 64) -> torch.Tensor:
    """Rows that test a quantizer's rounding: random magnitudes, zeros, scales that underflow float16, and
    values that fall exactly halfway between two steps."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(200, D, generator=g) * torch.logspace(-6, 4, 200)[:, None], torch.zeros(2, D),
            torch.full((2, D), 1e-9), torch.randn(2, D, generator=g) * 1e-6]
    step = torch.tensor(0.0078125)  # a float16 scale; 127 steps make the row's maximum
    ties = (torch.randint(-126, 126, (8, D), generator=g) + 0.5) * step
    ties[:, 0] = 127 * step
    return torch.cat(rows + [ties])


def test_the_native_quantizer_writes_what_quantize_kv_writes():
    from pagedchat.kernels.kv_quant import quantize_kv

    x = awkward_heads()
    q, scales = quantize_heads(build.load(), x)
    want_q, want_scales = quantize_kv(x, torch.int8)
    assert torch.equal(q, want_q) and torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))


@contextlib.contextmanager
def int8_pool(runner):
    """The runner's pool as int8 with float16 scales (quantize_kv), its layers pointing at it while the native
    step binds; the fp32 caches keep the dequantized values, so the torch step sees what the native step reads.
    Yields (the native step on the int8 pool, [(values, scales) per K cache then per V cache])."""
    from pagedchat.kernels.kv_quant import dequantize_kv, quantize_kv
    from pagedchat.native.step import NativeDecode

    from unittest import mock

    from pagedchat.model import attention

    caches = runner.k_caches + runner.v_caches
    pools = [quantize_kv(c, torch.int8) for c in caches]
    for cache, (q, s) in zip(caches, pools):
        cache.copy_(dequantize_kv(q, s, torch.float32))
    write_kv = attention.kernels.write_kv

    def write_as_int8(k, v, *args, **kwargs):  # the torch step's new K/V too: stored quantized, read back
        round_trip = [dequantize_kv(*quantize_kv(x, torch.int8), x.dtype) for x in (k, v)]
        return write_kv(*round_trip, *args, **kwargs)
    layers = runner.attention_layers
    n = len(layers)
    for layer, (k, _), (v, _) in zip(layers, pools[:n], pools[n:]):
        layer.k_cache, layer.v_cache = k, v
    try:
        native = NativeDecode.bind(runner.model, [k for k, _ in pools[:n]], [v for v, _ in pools[n:]],
                                   runner.block_size, [s for _, s in pools[:n]], [s for _, s in pools[n:]])
    finally:
        for layer, k, v in zip(layers, runner.k_caches, runner.v_caches):
            layer.k_cache, layer.v_cache = k, v
    with mock.patch.object(attention.kernels, "write_kv", write_as_int8):
        yield native, pools


def check_int8_pool_step(runner, lens, new, seed=0, threads=1):
    """The native step on an int8 pool against the torch step on its dequantized values (its new K/V
    quantized and dequantized before attention reads them): logits, and the new K/V as quantize_kv quantizes
    what the torch step computed (one step apart at most: the two compute K/V in another summation order)."""
    from pagedchat.kernels.kv_quant import quantize_kv

    ids, positions, meta = scattered_step(runner, lens, seed, new)
    with int8_pool(runner) as (native, pools):
        assert native is not None
        expected = torch_step(runner, ids, positions, meta)
        with torch_threads(threads):
            got = native.step(ids, positions, meta.block_tables, meta.cu_seqlens_q)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for cache, (q, s) in zip(runner.k_caches + runner.v_caches, pools):  # (quantized once more: no change)
        want_q, want_s = quantize_kv(cache.view(-1, *cache.shape[2:])[meta.slot_mapping], torch.int8)
        got_q, got_s = q.view(-1, *q.shape[2:])[meta.slot_mapping], s.view(-1, s.shape[-1])[meta.slot_mapping]
        assert (got_q.int() - want_q.int()).abs().max() <= 1
        torch.testing.assert_close(got_s.float(), want_s.float(), rtol=2e-3, atol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_native_step_on_an_int8_pool(model_dirs, arch, threads):
    runner = engine_for(model_dirs[arch][0]).runner
    check_int8_pool_step(runner, [13, 30, 9], None, threads=threads)
    check_int8_pool_step(runner, [13, 30, 9], [4, 1, 6], seed=1, threads=threads)  # a verify step


def count_native_steps(runner) -> list[int]:
    calls, inner = [], runner.native.step
    runner.native.step = lambda *a: calls.append(a[0].shape[0]) or inner(*a)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_decodes_through_the_native_step_and_matches_transformers(model_dirs, arch):
    path, hf = model_dirs[arch]
    engine = engine_for(path)
    calls = count_native_steps(engine.runner)
    prompts = [[5 + i for i in range(n)] for n in (3, 11, 26)]
    outs = engine.generate(prompts, GREEDY.with_(ignore_eos=False))  # transformers stops at EOS too
    # every token after a sequence's first comes from a decode step, but in the step or two that also finish
    # another sequence's prefill
    assert sum(calls) >= sum(len(out.outputs[0].token_ids) - 1 for out in outs) - 3 > 0
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, GREEDY.max_tokens))


def test_steps_that_need_hidden_states_stay_on_torch(model_dirs):
    """Prompt log-probabilities read the hidden states of the step: such a batch never goes native, and its
    results are the torch path's."""
    engine = engine_for(model_dirs["llama"][0])
    calls = count_native_steps(engine.runner)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    native_out = engine.generate([[7, 8, 9, 10]], params)[0]
    assert calls == []
    engine.runner.native = None
    torch_out = engine.generate([[7, 8, 9, 10]], params)[0]
    assert native_out.prompt_logprobs == torch_out.prompt_logprobs


def test_native_and_torch_engines_agree_on_forks_and_shared_blocks(model_dirs):
    """n variants share their prompt's blocks and copy the partial one on write: the native step writes into
    the copies the scheduler made, so sampled variants equal the torch path's token for token."""
    engine = engine_for(model_dirs["qwen2"][0])
    params = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=10, ignore_eos=True)
    prompt = list(range(5, 15))
    native = [c.token_ids for c in engine.generate([prompt], params)[0].outputs]
    engine.runner.native = None
    assert [c.token_ids for c in engine.generate([prompt], params)[0].outputs] == native


def test_gemma3_decodes_natively_across_its_windows_and_matches_transformers(model_dirs):
    """Gemma 3: norms of 1 + weight around attention and MLP, GELU, embeddings times sqrt(hidden), per-layer
    rope tables, and window layers (window 24 here, blocks of 8) reading their own block tables, whose blocks
    behind every window are released (-1): the replies run well past the window."""
    path, hf = model_dirs["gemma3"]
    engine = engine_for(path)
    assert engine.runner._window_groups() > 0
    calls = count_native_steps(engine.runner)
    prompts = [[5 + i % 200 for i in range(n)] for n in (3, 20, 41)]
    params = GREEDY.with_(max_tokens=40)
    outs = engine.generate(prompts, params)
    assert sum(calls) >= sum(len(out.outputs[0].token_ids) - 1 for out in outs) - 3 > 0
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, params.max_tokens))
    engine.check_invariants()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_gemma3_native_and_torch_engines_agree_on_forks_and_verify_steps(model_dirs, kv_dtype):
    """Sampled variants (forks sharing the prompt's blocks in every layer group) and n-gram verify steps (a
    window layer's queries of one step each see their own window): the native step gives the torch path's
    tokens, on a float and an int8 pool."""
    path, _ = model_dirs["gemma3"]
    prompt = [5, 6, 7, 8, 9] * 8
    runs = []
    for native in (True, False):
        engine = engine_for(path, kv_dtype=kv_dtype, speculate="ngram")
        calls = count_native_steps(engine.runner)
        if not native:
            engine.runner.native = None
        variants = engine.generate([prompt], SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=30,
                                                             ignore_eos=True))[0]
        greedy = engine.generate([prompt], GREEDY.with_(max_tokens=30))[0]
        runs.append(([c.token_ids for c in variants.outputs], greedy.outputs[0].token_ids))
        assert (max(calls, default=0) > 1) == native    # verify steps ran natively
        engine.check_invariants()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "mixtral"])
def test_other_families_keep_the_torch_path(model_dirs, arch):
    assert engine_for(model_dirs[arch][0]).runner.native is None


def test_half_precision_keeps_the_torch_path(model_dirs):
    assert engine_for(model_dirs["llama"][0], dtype="bfloat16").runner.native is None


@pytest.fixture
def built_with(monkeypatch):
    """build_with(cflags): the native library built with these target flags (cached for the session, as every
    build) made the one engines bind."""
    def build_with(cflags: str):
        monkeypatch.setenv(build.FLAGS_ENV, cflags)
        monkeypatch.setattr(build, "_loaded", None)
        lib = build.load(wait=True)
        assert lib is not None, build.status()
        return build.build_info(lib)

    return build_with


@pytest.mark.parametrize("cflags, info", [("-march=native -DPC_ISA_GENERIC", "generic vw=4 tile=4x3"),
                                          ("-march=native -DPC_TILE_R=3 -DPC_TILE_NB=5 -DPC_PIN=0", "tile=3x5")])
def test_every_tile_shape_computes_the_torch_step(model_dirs, built_with, cflags, info):
    """The portable fallback (what a CPU without AVX runs) and a shape no ISA picks, on odd batch sizes: full
    tiles, partial ones and a tail of rows."""
    assert info in built_with(cflags)
    engine = engine_for(model_dirs["qwen3"][0], quantize="int8")
    runner = engine.runner
    native_int8_arithmetic(runner.model)
    for seed, lens in enumerate([[1], [5, 17, 2, 30, 9, 3, 11], [8] * 4]):
        expected, got, _, _ = both_steps(runner, lens, seed)
        assert_logits_close(got, expected, int8=True)
    expected, got, _, _ = both_steps(runner, [20, 7, 33], 5, new=[3, 1, 8])
    assert_logits_close(got, expected, int8=True)
    check_linear_formats(build.load())
    check_int8_pool_step(engine_for(model_dirs["qwen2"][0]).runner, [13, 30, 9], [4, 1, 6])
    from pagedchat.kernels.kv_quant import quantize_kv

    q, scales = quantize_heads(build.load(), awkward_heads())  # (float16 rounding without F16C, in the fallback)
    want_q, want_scales = quantize_kv(awkward_heads(), torch.int8)
    assert torch.equal(q, want_q) and torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))


@pytest.mark.parametrize("march", ["skylake-avx512", "icelake-server", "alderlake", "haswell", "x86-64"])
def test_the_source_compiles_for_every_x86_level(march, tmp_path):
    """The AVX-512 and SSE paths, and the integer tiles' VNNI forms (AVX512-VNNI: icelake-server; AVX-VNNI
    without AVX-512: alderlake), cannot run on every test machine: they must at least compile."""
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    compiler = build._compiler()
    done = subprocess.run([compiler, "-O1", "-fopenmp", "-fPIC", "-Wall", "-Werror", "-Wno-psabi", f"-march={march}",
                           "-c", "-o", str(tmp_path / "decode.o"), str(build.SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
