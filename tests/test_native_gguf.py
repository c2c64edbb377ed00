"""The native decode step on GGUF formats: decode.c reads a GGUFLinear's parts in the file's own layout
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16; a layer's parts may each be another
type).

The oracle is the native int8/int4 layers' (tests/test_native_decode.py): a torch twin that quantizes the input
the same way (blocks of 32, scale max|x| / 127, round half to even), takes each block's dot product with the
weights exactly, scales by the block's scale and sums; for F16 and BF16 parts, which meet the fp32 input as it is
(decode.c tile_f16), the exact product with it. The weights are gguf-py's own dequantization, so the twin
checks the layout, not decode.c against itself. Each build the CI machines can take runs: this machine's
(AVX-512 here), AVX2 without VNNI (-march=haswell: the AMD EPYC CI machines' path) and the portable fallback.
"""

from __future__ import annotations

import platform
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as T

from gguf_models import build_hf, random_blocks, write_gguf
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.gguf.linear import GGUFLinear
from pagedchat.native import build

pytestmark = pytest.mark.skipif(build.load(wait=True) is None, reason="no native build here (no C compiler?)")

NATIVE_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16]
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)   # gguf-py cannot quantize these: random blocks, small scales
FLOAT_TYPES = (T.F16, T.BF16)   # no input quantization: the twin multiplies the fp32 input


def _has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


# The builds each test runs on: this machine's, AVX2 without VNNI (what an AMD EPYC CI machine compiles with
# -march=native takes), the portable fallback (the flags test_native_decode.py builds it with: one cached build).
BUILDS = {
    "native": None,
    "avx2": pytest.param("-march=haswell", marks=pytest.mark.skipif(
        platform.machine() not in ("x86_64", "AMD64") or not _has_avx2(), reason="needs an x86 CPU with AVX2")),
    "portable": "-march=native -DPC_ISA_GENERIC",
}


@pytest.fixture
def lib(request, monkeypatch):
    """The native library built with the parametrized target flags (None: this machine's), cached for the
    session like every build, and made the one engines bind."""
    cflags = request.param
    if cflags is not None:
        monkeypatch.setenv(build.FLAGS_ENV, cflags)
        monkeypatch.setattr(build, "_loaded", None)
    loaded = build.load(wait=True)
    assert loaded is not None, build.status()
    if cflags is not None:
        expected = "generic" if "GENERIC" in cflags else "avx2"
        assert build.build_info(loaded).startswith(expected)
    return loaded


def with_builds(test):
    return pytest.mark.parametrize("lib", list(BUILDS.values()), ids=list(BUILDS), indirect=True)(test)


# -- the twin -----------------------------------------------------------------------------------------------------
def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, in] as decode.c quantizes a linear layer's input: (integers [n, in / 32, 32], scales [n, in / 32]).
    127 / amax is a true division, as C's: torch's `127 / t` is t.reciprocal() * 127, an ulp away in a quarter
    of cases, which moves values that sit on a half step (a GGUF model's inputs often do: each block of a
    dequantized embedding is a multiple of a few small integers)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (blocks * inv).round(), (amax / 127).squeeze(-1)


def reference_weight(layer: GGUFLinear) -> torch.Tensor:
    """The layer's weight [out, in] in float64, as gguf-py dequantizes each part."""
    parts = [torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).reshape(raw.shape[0], -1)
             for raw, qtype in layer.parts]
    return torch.cat(parts).double()


def twin(layer: GGUFLinear, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """layer(x) as the native step computes it: x quantized per block, each block's product with the weights
    exact (float64), scaled by the block's scale, summed over blocks; a layer of float parts takes x as it is
    (its exact product with the weights); then the bias."""
    rows = x.reshape(-1, layer.in_features)
    weight = reference_weight(layer) if weight is None else weight
    if all(qtype in FLOAT_TYPES for qtype in layer.qtypes):
        out = (rows.double() @ weight.T).float()
    else:
        q, d = quantize_input(rows)
        dots = torch.einsum("nkj,okj->nok", q.double(), weight.view(layer.out_features, -1, 32))
        out = (dots * d.double()[:, None, :]).sum(-1).float()
    out = out.view(*x.shape[:-1], layer.out_features)
    return out if layer.bias is None else out + layer.bias


def twin_forward(self: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
    """A GGUFLinear's forward computing the native arithmetic (its own dequantization: bit-identical to
    gguf-py's, tests/test_gguf_quants.py)."""
    return twin(self, x, self.dequantized(torch.float32).double())


def native_arithmetic(model) -> None:
    """Every GGUF layer of the torch path computes what the native step's do."""
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.forward = types.MethodType(twin_forward, module)


# -- one layer: each format's tiles against the twin --------------------------------------------------------------
def raw_rows(qtype: T, rows: int, width: int, rng) -> torch.Tensor:
    """uint8 [rows, row_bytes]: gguf-py quantizing random weights, or random K-quant blocks."""
    if qtype in K_QUANTS:
        return as_raw(random_blocks((rows, width), qtype, rng))
    return encoded(rng.standard_normal((rows, width)).astype(np.float32), qtype)


def encoded(values: np.ndarray, qtype: T) -> torch.Tensor:
    """float32 [rows, width] as gguf-py writes it in `qtype`: uint8 [rows, row_bytes]."""
    return as_raw(gguf.quants.quantize(values, qtype))


def as_raw(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1))


def awkward_inputs(batch: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Rows of random magnitudes (1e-3 to 1e3), one 32-value block of zeros (scale 0) and one of a single
    value (every other 0)."""
    x = torch.randn(batch, width, generator=g) * torch.logspace(-3, 3, batch)[:, None]
    x[:, 32:64] = 0
    x[:, 64:96] = 0
    x[:, 70] = 5.0
    return x


def assert_twin_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 summation order: within 1e-5 of each row's largest output."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert ((got - want).abs() / scale).max() < 1e-5, ((got - want).abs() / scale).max()


def check_layer(layer: GGUFLinear, lib, g: torch.Generator) -> None:
    from pagedchat.native.step import run_linear

    weight = reference_weight(layer)
    for batch in (1, 2, 3, 16):   # a ROWS_1 tile; partial tiles of inputs (row-per-lane from 2 or 3); full ones
        x = awkward_inputs(batch, layer.in_features, g)
        assert_twin_close(run_linear(layer, x, lib), twin(layer, x, weight))


@with_builds
@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda t: t.name)
def test_each_gguf_format_computes_its_twin(lib, qtype):
    """37 rows (tiles of 4 and 8 leave a tail), a bias, widths of 1 and 3 super-blocks (K-quants) or of 3 and
    9 blocks of 32."""
    rng, g = np.random.default_rng(int(qtype)), torch.Generator().manual_seed(int(qtype))
    for width in ((256, 768) if qtype in K_QUANTS else (96, 288)):
        layer = GGUFLinear([(raw_rows(qtype, 37, width, rng), int(qtype))], width, torch.randn(37, generator=g))
        check_layer(layer, lib, g)


@with_builds
def test_q8_0_weights_of_minus_128(lib):
    """Q8_0 may store -128 (gguf-py's quantizer never does, other writers can): the sign trick keeps the
    weight on the unsigned side, where 128 fits."""
    rng, g = np.random.default_rng(1), torch.Generator().manual_seed(1)
    raw = raw_rows(T.Q8_0, 16, 128, rng).view(-1, 34)
    raw[:, 2::3] = 0x80   # every third value of every block
    check_layer(GGUFLinear([(raw.reshape(16, -1), int(T.Q8_0))], 128), lib, g)


@with_builds
@pytest.mark.parametrize("types_", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q4_0, T.Q5_0), (T.Q5_1, T.Q4_1, T.Q5_K),
                                    (T.Q3_K, T.Q2_K, T.Q6_K), (T.F16, T.BF16, T.F16)],
                         ids=lambda ts: "+".join(t.name for t in ts))
def test_a_layer_of_several_formats(lib, types_):
    """q, k and v (or gate and up) each in its own type, of 37, 13 and 22 rows: tiles across the parts'
    boundaries are split at them."""
    rng, g = np.random.default_rng(7), torch.Generator().manual_seed(7)
    width = 512
    parts = [(raw_rows(qtype, rows, width, rng), int(qtype)) for qtype, rows in zip(types_, (37, 13, 22))]
    check_layer(GGUFLinear(parts, width, torch.randn(72, generator=g)), lib, g)


def test_unsupported_parts_keep_the_torch_path():
    """A part in a type decode.c does not read (F32), F16 parts beside block-format ones (the two kinds take the
    input in different forms), a width that is not whole blocks of 32 (a float part's), or a half-precision
    bias: no native layer, so the model stays on the torch path."""
    from pagedchat.native.step import _linear

    rng = np.random.default_rng(0)
    q8 = (raw_rows(T.Q8_0, 8, 64, rng), int(T.Q8_0))
    f16 = (raw_rows(T.F16, 8, 64, rng), int(T.F16))
    assert _linear(GGUFLinear([q8], 64)) is not None
    assert _linear(GGUFLinear([f16], 64)) is not None
    assert _linear(GGUFLinear([q8, f16], 64)) is None
    assert _linear(GGUFLinear([(torch.randn(8, 64).view(torch.uint8), int(T.F32))], 64)) is None
    assert _linear(GGUFLinear([(torch.randn(8, 48).view(torch.uint8), int(T.F32))], 48)) is None
    assert _linear(GGUFLinear([q8], 64, torch.randn(8).half())) is None


# -- the whole step -----------------------------------------------------------------------------------------------
def hf_with_random_norms(arch: str, root: Path, low: float):
    """The tests' HF model of `arch` with rows of whole K-quant super-blocks and norm weights uniform in
    [low, low + 1) (see gguf_llama)."""
    hf = build_hf(arch, root / "hf", hidden_size=256, intermediate_size=512)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=g) + low)
    return hf


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    """A small llama (rows of whole K-quant super-blocks) as a GGUF file per block format: path by type name
    (runner_in makes the float types' models). Its norm weights are random: with the default ones, each block of
    the first layer's input is a multiple of a few small integers (a dequantized embedding row), values sit
    exactly on half steps of the input quantization, and the last bit of the RMS norm (the two paths sum in
    another order) decides their rounding."""
    root = tmp_path_factory.mktemp("gguf-llama")
    hf = hf_with_random_norms("llama", root, 0.5)
    files = {}
    for qtype in (t for t in NATIVE_TYPES if t not in FLOAT_TYPES):
        files[qtype.name] = root / f"llama-{qtype.name}.gguf"
        write_gguf(hf, root / "hf", files[qtype.name], "llama", qtype.name)
    return files


@pytest.fixture(autouse=True)
def native_always(monkeypatch):
    """The engine takes the native step for every step it covers, without measuring the torch path against it
    (pagedchat/native/paths.py): the tests count the native steps."""
    monkeypatch.setenv("PAGEDCHAT_NATIVE", "always")


def engine_for(path, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **{"num_blocks": 128, **kwargs}),
                  show_progress=False)


def runner_in(files, qtype: T, **kwargs):
    """An engine's runner whose GGUF layers are in `qtype`. A file whose matrices are all F16 or BF16 loads them
    dense (nothing quantized to keep: pagedchat/model/gguf/load.py), so a float type's layers are the Q8_0
    model's rounded to it (its embedding stays in Q8_0 blocks), and the native step is bound again."""
    from pagedchat.native.step import NativeDecode

    runner = engine_for(files[qtype.name if qtype not in FLOAT_TYPES else "Q8_0"], **kwargs).runner
    if qtype in FLOAT_TYPES:
        for name, old in list(runner.model.named_modules()):
            if isinstance(old, GGUFLinear):
                weight = old.dequantized(torch.float32).numpy()
                owner, _, attr = name.rpartition(".")
                setattr(runner.model.get_submodule(owner), attr,
                        GGUFLinear([(encoded(weight, qtype), int(qtype))], old.in_features, old.bias))
        runner.native = NativeDecode.bind(runner.model, runner.k_caches, runner.v_caches, runner.block_size)
    return runner


def test_gguf_parts_move_into_the_weight_arena(gguf_llama):
    """Binding moves each part's bytes into the step's weight arena (views there, the same bytes): the layer
    keeps no second copy, and its torch path reads what the native step reads."""
    engine = engine_for(gguf_llama["Q4_0"])
    native = engine.runner.native
    assert native is not None
    arena = next(k for k in native.keep if k is not None and hasattr(k, "madvise"))
    start = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    layers = [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(start <= raw.data_ptr() < start + len(arena) for m in layers for raw, _ in m.parts)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda t: t.name)
def test_native_gguf_step_computes_the_twin_step(gguf_llama, qtype, threads):
    """Decode and verify steps over scattered block tables: the native step's logits and K/V against the torch
    path's with the twin's arithmetic in every GGUF layer (assert_logits_close(int8=True): a rare input value
    on a half step may round the other way, as for the native int8 layers)."""
    from test_native_decode import both_steps

    runner = runner_in(gguf_llama, qtype, block_size=8)
    assert runner.native is not None, f"{qtype.name} should bind the native step"
    assert {t for m in runner.model.modules() if isinstance(m, GGUFLinear) for t in m.qtypes} == {int(qtype)}
    native_arithmetic(runner.model)
    steps = [([1], None), ([37], None), ([5, 17, 2, 30, 9], None), ([20, 7, 33], [3, 1, 8])]  # (the last: verify)
    for seed, (lens, new) in enumerate(steps):
        expected, got, torch_wrote, native_wrote = both_steps(runner, lens, seed, threads, new)
        assert torch.isfinite(got).all()
        assert_step_close(got, expected, tokens=new)
        for wrote, want in zip(native_wrote, torch_wrote):
            assert_step_close(wrote, want, tol=1e-5, tokens=new)


def test_native_step_with_layers_of_several_formats(gguf_llama):
    """A model whose q/k/v and gate/up mix types, as llama.cpp's Q4_K_M files do (v and some layers' tensors
    in Q6_K): the native step binds it, and its steps equal the twin's."""
    from test_native_decode import both_steps
    from pagedchat.native.step import NativeDecode

    runner = engine_for(gguf_llama["Q4_K"], block_size=8).runner
    rng = np.random.default_rng(3)
    for layer in runner.model.layers:
        for owner, attr, replace in ((layer.self_attn, "qkv_proj", -1), (layer.mlp, "gate_up_proj", 0)):
            old = getattr(owner, attr)
            parts = list(old.parts)
            raw, _ = parts[replace]
            parts[replace] = (raw_rows(T.Q6_K, raw.shape[0], old.in_features, rng), int(T.Q6_K))
            setattr(owner, attr, GGUFLinear(parts, old.in_features, old.bias))
    runner.native = NativeDecode.bind(runner.model, runner.k_caches, runner.v_caches, runner.block_size)
    assert runner.native is not None
    native_arithmetic(runner.model)
    for seed, lens in enumerate([[1], [5, 17, 2, 30, 9]]):
        expected, got, _, _ = both_steps(runner, lens, seed)
        assert_step_close(got, expected)


def assert_step_close(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4, tokens=None) -> None:
    """test_native_decode.py's assert_logits_close(int8=True) on rows scaled to the Q8_0 model's logits (about
    20 at most): the K-quant models' random blocks (gguf_models.random_blocks) make logits of a thousand, where
    1e-4 is below float32's rounding."""
    from test_native_decode import assert_logits_close

    scale = max(1.0, float(expected.abs().max()) / 20)
    assert_logits_close(got / scale, expected / scale, int8=True, tol=tol, tokens=tokens)


def count_native_steps(engine) -> list[int]:
    calls, inner = [], engine.runner.native.step
    engine.runner.native.step = lambda *a: calls.append(a[0].shape[0]) or inner(*a)
    return calls


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_engine_decodes_gguf_natively_with_the_torch_paths_tokens(gguf_llama, qtype, monkeypatch):
    """Whole generations: the engine decoding through the native step gives the greedy tokens of the engine
    with PAGEDCHAT_NATIVE=0 whose GGUF layers compute the native arithmetic. (Against the plain torch path,
    whose activations stay fp32, these random models' chaotic logits part within a few tokens, as for the
    native int8 and int4 layers.)"""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i for i in range(n)] for n in (3, 11, 26)]
    native = engine_for(gguf_llama[qtype])
    assert native.runner.native is not None
    calls = count_native_steps(native)
    with monkeypatch.context() as switched_off:   # (the library loaded again: load() reads the switch)
        switched_off.setenv("PAGEDCHAT_NATIVE", "0")
        switched_off.setattr(build, "_loaded", None)
        torch_only = engine_for(gguf_llama[qtype])
    assert torch_only.runner.native is None
    native_arithmetic(native.runner.model)   # (the prefill and anything else on torch in both engines)
    native_arithmetic(torch_only.runner.model)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in torch_only.generate(prompts, params)]
    assert sum(calls) >= 3 * (params.max_tokens - 1) - 3
    assert got == want


@pytest.fixture(scope="module")
def gguf_gemma3(tmp_path_factory):
    """The tests' Gemma 3 (window layers, per-layer rope, tied embeddings) with rows of whole super-blocks, as
    GGUF files: path by type name. Norms random, as for gguf_llama."""
    root = tmp_path_factory.mktemp("gguf-gemma3")
    hf = hf_with_random_norms("gemma3", root, -0.5)   # Gemma scales by 1 + weight
    files = {}
    for name in ("Q8_0", "Q4_K"):
        files[name] = root / f"gemma3-{name}.gguf"
        write_gguf(hf, root / "hf", files[name], "gemma3", name)
    return files


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gemma3_decodes_gguf_natively_with_the_torch_paths_tokens(gguf_gemma3, qtype, monkeypatch):
    """Gemma 3 from a GGUF file through the native step (its window layers' blocks released past the window)
    gives the greedy tokens of the torch path computing the native arithmetic, alone and batched."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[5 + i for i in range(n)] for n in (3, 11, 30)]
    native = engine_for(gguf_gemma3[qtype], block_size=8)
    assert native.runner.native is not None and native.runner._window_groups() > 0
    calls = count_native_steps(native)
    with monkeypatch.context() as switched_off:
        switched_off.setenv("PAGEDCHAT_NATIVE", "0")
        switched_off.setattr(build, "_loaded", None)
        torch_only = engine_for(gguf_gemma3[qtype], block_size=8)
    assert torch_only.runner.native is None
    native_arithmetic(native.runner.model)
    native_arithmetic(torch_only.runner.model)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    want = [o.outputs[0] for o in torch_only.generate(prompts, params.with_(logprobs=2))]
    assert sum(calls) >= 3 * (params.max_tokens - 1) - 3
    for ours, theirs in zip(got, want):
        assert_equal_up_to_a_near_tie(ours, theirs)
    native.check_invariants()


ACTIVATION_TIE = 0.01  # see assert_equal_up_to_a_near_tie


def assert_equal_up_to_a_near_tie(ours: list[int], reference) -> None:
    """Greedy tokens equal to the reference output's (run with logprobs=2), or parting at a near-tie: the
    reference's top-2 gap there below ACTIVATION_TIE, our token its runner-up. The tie is wider than the fp32
    oracle's: both sides quantize activations to 8 bits per block, and a rounding difference in the sum before
    (the torch twin's batched matmul sums in another order than the tiles, and in another order again for
    another batch) moves a value to the next 8-bit step, the logits by ~1e-3 (a random Gemma 3 Q8_0 model
    at a prompt of 30 tokens: native 11 in any batch; the torch path 11 alone, 274 beside an 11-token prompt;
    their logit gap 0.0018)."""
    theirs = reference.token_ids
    part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if part is None:
        assert ours == theirs
        return
    top = reference.logprobs[part].top
    gap = top[0][1] - top[1][1]
    assert ours[part] == top[1][0] and gap < ACTIVATION_TIE, (
        f"new token {part}: ours {ours[part]} != {theirs[part]}; the reference's top 2 {top}, gap {gap:.3g}")


def record_twin_steps(runner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every native step the runner takes runs first on the torch path from the same pool (its K/V put back
    after): (native logits, torch logits) per step, appended as generation goes (teacher forcing: both see
    the context the native steps wrote)."""
    from pagedchat.model.attention import AttentionMetadata
    from test_native_decode import torch_step

    pairs, inner = [], runner.native.step

    def step(ids, positions, tables, cu, windows=(), rows=None):
        caches, bs = runner.k_caches + runner.v_caches, runner.block_size
        saved = [c.clone() for c in caches]
        seq = torch.repeat_interleave(torch.arange(cu.shape[0] - 1), cu.diff())
        slots = tables[seq, positions // bs].long() * bs + positions % bs
        lens = positions[cu[1:].long() - 1] + 1
        meta = AttentionMetadata(slots, tables, lens.int(), cu, bool((cu.diff() == 1).all()), int(lens.max()))
        want = torch_step(runner, ids, positions, meta)
        for cache, old in zip(caches, saved):
            cache.copy_(old)
        got = inner(ids, positions, tables, cu, windows, rows)
        pairs.append((got, want if rows is None else want[rows]))
        return got

    runner.native.step = step
    return pairs


def test_the_real_q4_1_file_binds_natively():
    """SmolLM2-135M-Instruct Q4_1 (its layers Q4_1; its tied embedding Q8_0, the lookup table dequantized to
    fp32 and the LM head reading the Q8_0 blocks): every layer binds, and decoding real prompts, each native step picks the twin step's greedy tokens. Its logits are held
    loosely (a tenth of their range): over 30 layers the rare input values on a half step that round the other
    way (test_native_decode.py assert_logits_close) add up to about a logit, as they do for the torch path
    running the native kernels layer by layer; a misread layout moves them by their whole range."""
    from real_files import real_file

    engine = engine_for(real_file("smollm2"), block_size=16, num_blocks=16)
    runner = engine.runner
    assert runner.native is not None
    layers = [m for m in runner.model.layers.modules() if isinstance(m, GGUFLinear)]
    assert {qtype for m in layers for qtype in m.qtypes} == {int(T.Q4_1)}
    assert runner.model.lm_head.qtypes == [int(T.Q8_0)]
    native_arithmetic(runner.model)
    pairs = record_twin_steps(runner)
    tokenizer = runner.loaded.tokenizer
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):")]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(pairs) >= 3
    for got, want in pairs:
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.0   # (a closer call may go either way)
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
        assert (got - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("march", ["znver3", "x86-64-v2"])
def test_the_source_compiles_for_cpus_without_avx512(march, tmp_path):
    """The AMD EPYC CI machines (Zen 3: AVX2, no VNNI) and a CPU without AVX (the portable tiles), with every
    warning an error (the AVX2 and portable builds above run; these compile the targets this machine cannot
    stand in for exactly)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    done = subprocess.run([build._compiler(), "-O1", "-fopenmp", "-fPIC", "-Wall", "-Werror", "-Wno-psabi",
                           f"-march={march}", "-c", "-o", str(tmp_path / "decode.o"), str(build.SOURCE)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _mapping_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/smaps")
def test_gathering_weights_drops_the_file_pages_they_came_from(tmp_path):
    """The arena holds the weights' bytes after gather_weights; the file pages they were copied from leave the
    process (else both stay resident), while anonymous memory is never dropped and every value stays."""
    from torch import nn

    from pagedchat.native.step import gather_weights

    values = np.arange(1 << 20, dtype=np.float32)   # 4 MiB
    path = tmp_path / "weights.bin"
    values.tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="c")   # as the GGUF reader maps a file
    from_file, anon = nn.Linear(1024, 1024, bias=False), nn.Linear(512, 512, bias=False)
    from_file.weight.data = torch.from_numpy(mapped).view(1024, 1024)
    anon_values = anon.weight.detach().clone()
    assert float(from_file.weight.detach().sum()) == float(values.sum())  # every page of the file touched
    assert _mapping_rss_kib(path) >= 4000
    arena = gather_weights([from_file, anon])
    assert arena is not None and _mapping_rss_kib(path) < 64
    assert torch.equal(from_file.weight, torch.from_numpy(values).view(1024, 1024))
    assert torch.equal(anon.weight, anon_values)
    assert np.array_equal(mapped, values)   # the file's view reads the file again


def test_short_prefill_steps_run_natively_and_long_ones_on_the_torch_path(gguf_llama):
    """A prompt of up to NATIVE_PREFILL_MAX tokens is prefilled by the native step (the torch path would
    dequantize every layer for it); a longer one by the torch path, whose matmuls win there."""
    from pagedchat.engine.core.runner import NATIVE_PREFILL_MAX

    engine = engine_for(gguf_llama["Q8_0"])
    calls = count_native_steps(engine)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate([[5 + i % 200 for i in range(NATIVE_PREFILL_MAX)]], params)
    assert calls == [NATIVE_PREFILL_MAX, 1]
    calls.clear()
    engine.generate([[7 + i % 200 for i in range(NATIVE_PREFILL_MAX + 1)]], params)
    assert calls == [1]
