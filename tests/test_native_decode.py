"""The native CPU decode step (pagedchat/native): one C call per decode step of a Llama-family model.

It must compute what the torch path computes (logits and the K/V it writes, up to float summation order) on
every architecture it binds to, fp32 and int8, one thread or two, over scattered block tables and a pool whose
unused slots hold NaN; the engine must use it for plain decode steps and nothing else; and every way it can be
unavailable (another family, another dtype, no compiler, PAGEDCHAT_NATIVE=0) must leave the torch path working.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_models import ARCHS
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.attention import AttentionMetadata
from pagedchat.model.quantize import Int8Linear
from pagedchat.native import build

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.skipif(build.load(wait=True) is None, reason="no native build here (no C compiler?)")


def engine_for(path, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, block_size=8, **kwargs),
                  show_progress=False)


def scattered_step(runner, lens: list[int], seed: int):
    """A decode step over sequences of these lengths: blocks in a shuffled order, the context K/V random, every
    other slot of the pool NaN (the step must read only a sequence's visible slots)."""
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
        for t, n in zip(tables, lens):
            slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n - 1)], dtype=torch.long)
            cache.view(-1, *cache.shape[2:])[slots] = torch.randn(len(slots), *cache.shape[2:], generator=g)
    ids = torch.randint(3, runner.loaded.spec.vocab_size, (len(lens),), generator=g)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(slots, table, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32), True,
                             max(lens))
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


def both_steps(runner, lens: list[int], seed: int, threads: int = 1):
    """One decode step (scattered_step) through the torch path, then from the same pool through the native
    step on `threads` threads: (torch logits, native logits, the K/V torch wrote at the new slots, the K/V the
    native step wrote there), one entry per cache in each list."""
    ids, positions, meta = scattered_step(runner, lens, seed)
    caches = runner.k_caches + runner.v_caches
    saved = [c.clone() for c in caches]

    def new_slots():
        return [c.view(-1, *c.shape[2:])[meta.slot_mapping].clone() for c in caches]

    expected = torch_step(runner, ids, positions, meta)
    torch_wrote = new_slots()
    for cache, old in zip(caches, saved):
        cache.copy_(old)
    with torch_threads(threads):
        got = runner.native.step(ids, positions, meta.block_tables, meta.seq_lens)
    return expected, got, torch_wrote, new_slots()


def fp32_reference_int8(model) -> None:
    """int8 layers through the dequantized fp32 matmul: the native step's arithmetic (int8 weight times fp32
    activation, scaled after), where the packed torch kernel rounds activations to bf16."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.packed = False


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_computes_the_torch_step(model_dirs, arch, quantize, threads):
    engine = engine_for(model_dirs[arch][0], quantize=quantize)
    runner = engine.runner
    assert runner.native is not None, f"{arch} should bind the native step"
    fp32_reference_int8(runner.model)
    for seed, lens in enumerate([[1], [37], [5, 17, 2, 30, 9], [8] * 6]):
        expected, got, torch_wrote, native_wrote = both_steps(runner, lens, seed, threads)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for wrote, want in zip(native_wrote, torch_wrote):
            torch.testing.assert_close(wrote, want, rtol=1e-5, atol=1e-5)


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
       which=st.sampled_from([("llama", None), ("qwen3", "int8")]), threads=st.sampled_from([1, 2]))
def test_any_batch_of_decode_steps_equals_the_torch_step(property_engines, lens, seed, which, threads):
    """Random batch sizes, context lengths (within a block, across blocks, ending mid-block) and block orders."""
    runner = property_engines[which].runner
    fp32_reference_int8(runner.model)
    expected, got, _, _ = both_steps(runner, lens, seed, threads)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


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


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "mixtral"])
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
    fp32_reference_int8(runner.model)
    for seed, lens in enumerate([[1], [5, 17, 2, 30, 9, 3, 11], [8] * 4]):
        expected, got, _, _ = both_steps(runner, lens, seed)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("march", ["skylake-avx512", "haswell", "x86-64"])
def test_the_source_compiles_for_every_x86_level(march, tmp_path):
    """The AVX-512 and SSE paths cannot run on every test machine: they must at least compile."""
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    compiler = build._compiler()
    done = subprocess.run([compiler, "-O1", "-fopenmp", "-fPIC", "-Wall", "-Werror", "-Wno-psabi", f"-march={march}",
                           "-c", "-o", str(tmp_path / "decode.o"), str(build.SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
