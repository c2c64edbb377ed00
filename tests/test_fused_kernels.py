"""The fused layer kernels (kernels/triton_fused.py) and their twins (kernels/fused_reference.py).

* the twins equal the unfused model ops bit for bit in fp32 and bf16 (the fused path changes no number);
* the Triton kernels under the interpreter: bit for bit against the twins in bf16 and fp16 (with the
  interpreter rounding bf16 as the GPU does, tests/triton_rounding.py), within 2 ulp in fp32 (rsqrt, exp), and
  within one rounding of the float64 twin; odd sizes, partial rotary, q/k norms, padding slots, a NaN pool;
* the engine on the fused path (twins, and Triton under the interpreter) gives transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_models import ARCHS
from oracle import assert_greedy_equal, reference
from pagedchat import kernels as K
from test_engine_equality import prompts
from triton_rounding import gpu_rounding

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with gpu_rounding():
        yield


def assert_kernel_equal(got: torch.Tensor, twin: torch.Tensor, ref64: torch.Tensor, exact: bool = False) -> None:
    """Against the twin: the same bits where only products and sums are rounded (`exact`); else within a
    few ulp of the output dtype (fp32 rsqrt / exp / reduction order may move a value across a rounding boundary).
    Against the float64 twin: a few roundings of the value."""
    assert got.dtype == twin.dtype and got.shape == twin.shape
    assert not got.isnan().any()
    if not got.numel():
        return
    ulp = ULP[got.dtype]
    if exact and got.dtype != torch.float32:
        assert torch.equal(got, twin), f"{(got != twin).sum()} elements differ from the twin"
    else:
        torch.testing.assert_close(got, twin, rtol=4 * ulp, atol=4 * ulp * float(twin.abs().max()))
    torch.testing.assert_close(got.double(), ref64, rtol=4 * ulp, atol=4 * ulp * float(ref64.abs().max()))


def randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype)


# -- the twins are the model's unfused ops -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_equal_the_unfused_layer_ops(dtype):
    from pagedchat.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul
    from hf_models import make_config

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-6).to(dtype)
    norm.weight.data = randn(48, dtype=dtype, gen=g)
    x, res = randn(5, 48, dtype=dtype, gen=g), randn(5, 48, dtype=dtype, gen=g)
    out, summed = K.add_rms_norm_ref(x, res, norm.weight, 1e-6)
    assert torch.equal(summed, x + res) and torch.equal(out, norm(x + res))
    gate_up = randn(3, 40, dtype=dtype, gen=g)
    assert torch.equal(K.silu_and_mul_ref(gate_up), SiluAndMul()(gate_up))
    rotary = RotaryEmbedding(make_config("llama"), 16, 64)
    rotary.positions.ensure(64)   # (a kernel reads the tables as they are: the runner computes the step's rows)
    q, k, v = randn(4, 3, 16, dtype=dtype, gen=g), randn(4, 1, 16, dtype=dtype, gen=g), randn(4, 1, 16, dtype=dtype, gen=g)
    positions = torch.tensor([0, 9, 33, 63])
    k_cache, v_cache = torch.zeros(2, 8, 1, 16, dtype=dtype), torch.zeros(2, 8, 1, 16, dtype=dtype)
    q_rot = K.rope_write_kv_ref(q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, torch.arange(4))
    rotary._step = (None, None)
    assert torch.equal(q_rot, rotary.rotate(positions, q))
    assert torch.equal(k_cache.view(-1, 1, 16)[:4], rotary.rotate(positions, k))
    assert torch.equal(v_cache.view(-1, 1, 16)[:4], v)


# -- the Triton kernels under the interpreter --------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,residual", [(1, 64, False), (5, 67, True), (3, 1000, True)])
def test_add_rms_norm(interpret, dtype, rows, cols, residual):
    g = torch.Generator().manual_seed(rows * cols)
    x, w = randn(rows, cols, dtype=dtype, gen=g), randn(cols, dtype=dtype, gen=g)
    res = randn(rows, cols, dtype=dtype, gen=g) if residual else None
    out, summed = K.add_rms_norm(x, res, w, 1e-5, backend="triton")
    twin, twin_sum = K.add_rms_norm_ref(x, res, w, 1e-5)
    ref64, _ = K.add_rms_norm_ref(twin_sum.double(), None, w.double(), 1e-5)
    assert torch.equal(summed, twin_sum) and (residual or summed is x)
    assert_kernel_equal(out, twin, ref64)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (4, 1500)])  # 1500 > one 1024-column program
def test_silu_and_mul(interpret, dtype, rows, width):
    g = torch.Generator().manual_seed(width)
    gate_up = randn(rows, 2 * width, dtype=dtype, gen=g) * 4
    got = K.silu_and_mul(gate_up, backend="triton")
    gate, up = gate_up.double().chunk(2, dim=-1)
    silu = (gate * torch.sigmoid(gate)).to(dtype).double()  # rounded to the model dtype, as the twin does
    assert_kernel_equal(got, K.silu_and_mul_ref(gate_up), silu * up)


def check_rope_write(dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, rot_dim, qk_norm, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=g)
    q = qkv[:, :num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)   # strided views, as the model
    k = qkv[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    max_pos, block_size = 70, 8
    angles = torch.rand(max_pos, rot_dim // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    num_blocks = num_tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1   # padding rows write nothing
    norms = (randn(head_dim, dtype=dtype, gen=g), randn(head_dim, dtype=dtype, gen=g)) if qk_norm else (None, None)
    pool = lambda: torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)  # noqa: E731
    caches, twin_caches, caches64 = (pool(), pool()), (pool(), pool()), (pool().double(), pool().double())
    args = (positions, cos, sin)
    got = K.rope_write_kv(q, k, v, *args, *caches, slots, q_norm=norms[0], k_norm=norms[1], eps=1e-6,
                          backend="triton")
    twin = K.rope_write_kv_ref(q, k, v, *args, *twin_caches, slots, *norms, 1e-6)
    ref64 = K.rope_write_kv_ref(q.double(), k.double(), v.double(), *args, *caches64, slots,
                                *(None if n is None else n.double() for n in norms), 1e-6)
    assert_kernel_equal(got, twin, ref64, exact=not qk_norm)
    written = slots[slots >= 0]
    for cache, twin_cache, cache64 in zip(caches, twin_caches, caches64):
        flat, flat_twin = cache.view(-1, num_kv_heads, head_dim), twin_cache.view(-1, num_kv_heads, head_dim)
        assert_kernel_equal(flat[written], flat_twin[written], cache64.view(-1, num_kv_heads, head_dim)[written],
                            exact=not qk_norm)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert flat[untouched].isnan().all(), "a padding row or an unlisted slot was written"


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv(interpret, dtype, qk_norm):
    check_rope_write(dtype, 7, 6, 2, 24, 24, qk_norm, seed=3)


@needs_triton
def test_rope_write_kv_partial_rotary_and_many_heads(interpret):
    """Phi-4's partial rotary (channels past R pass through); more heads than one program's tile holds."""
    check_rope_write(torch.bfloat16, 3, 40, 8, 128, 96, False, seed=4)


@needs_triton
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(DTYPES), st.integers(1, 9), st.integers(1, 4), st.sampled_from([1, 2, 4]),
       st.sampled_from([16, 32, 80]), st.booleans())
def test_rope_write_kv_random_shapes(interpret, dtype, tokens, kv_heads, group, head_dim, qk_norm):
    check_rope_write(dtype, tokens, kv_heads * group, kv_heads, head_dim, head_dim, qk_norm, seed=tokens)


@needs_triton
def test_empty_batches(interpret):
    x = torch.zeros(0, 32)
    out, summed = K.add_rms_norm(x, x, torch.ones(32), 1e-6, backend="triton")
    assert out.shape == summed.shape == (0, 32)
    assert K.silu_and_mul(torch.zeros(0, 16), backend="triton").shape == (0, 8)


# -- the engine on the fused path ----------------------------------------------------------------------------

def fused_engine(model_dirs, arch, backend, monkeypatch, **kw):
    from pagedchat.engine import Engine, EngineConfig

    monkeypatch.setenv("PAGEDCHAT_NATIVE", "0")   # the native step would take every CPU decode
    engine = Engine(EngineConfig(model=str(model_dirs[arch][0]), num_blocks=48, fused_kernels=True, **kw),
                    show_progress=False)
    model = engine.runner.model
    assert model.fused_backend == "auto"
    for layer in model.attention_layers():
        layer.backend = backend
    model.use_fused_kernels(backend)
    return engine


@pytest.mark.parametrize("arch", ARCHS + ("phi3", "qwen3_moe", "mixtral"))
def test_engine_on_the_fused_twins_matches_transformers(model_dirs, monkeypatch, arch):
    from pagedchat.engine import SamplingParams

    engine, hf = fused_engine(model_dirs, arch, "torch", monkeypatch), model_dirs[arch][1]
    batch = prompts(3, seed=31, lo=4, hi=40)
    for prompt, out in zip(batch, engine.generate(batch, SamplingParams(temperature=0, max_tokens=12))):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, 12))


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # rope scaling + GQA; q/k norms + explicit head_dim
def test_engine_on_the_fused_triton_kernels_matches_transformers(model_dirs, monkeypatch, interpret, arch):
    from pagedchat.engine import SamplingParams

    engine, hf = fused_engine(model_dirs, arch, "triton", monkeypatch), model_dirs[arch][1]
    prompt = prompts(1, seed=32, lo=20, hi=20)[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, 6))


def test_fused_switch(monkeypatch):
    from pagedchat.engine import EngineConfig

    monkeypatch.delenv("PAGEDCHAT_FUSED", raising=False)
    config = EngineConfig(model="m")
    assert config.fused_backend("cuda") == "auto" and config.fused_backend("cpu") is None
    monkeypatch.setenv("PAGEDCHAT_FUSED", "0")
    assert config.fused_backend("cuda") is None
    monkeypatch.setenv("PAGEDCHAT_FUSED", "1")
    assert config.fused_backend("cpu") == "auto"
    assert EngineConfig(model="m", fused_kernels=False).fused_backend("cuda") is None


# -- on a GPU (skipped without one) --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_kernels_against_their_twins(monkeypatch, dtype):
    """Compiled for the device: sums and rotations bit for bit; rsqrt / exp within a few ulp."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(7)
    x, res, w = (randn(*s, dtype=dtype, gen=g).cuda() for s in ((9, 2048), (9, 2048), (2048,)))
    out, summed = K.add_rms_norm(x, res, w, 1e-5, backend="triton")
    twin, twin_sum = K.add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(summed, twin_sum)
    assert_kernel_equal(out.cpu(), twin.cpu(), K.add_rms_norm_ref(twin_sum.double(), None, w.double(), 1e-5)[0].cpu())
    gate_up = randn(9, 2 * 8192, dtype=dtype, gen=g).cuda()
    got, twin = K.silu_and_mul(gate_up, backend="triton"), K.silu_and_mul_ref(gate_up)
    torch.testing.assert_close(got, twin, rtol=4 * ULP[dtype], atol=4 * ULP[dtype] * float(twin.abs().max()))
    q, k, v = randn(9, 32, 64, dtype=dtype, gen=g).cuda(), randn(9, 8, 64, dtype=dtype, gen=g).cuda(), \
        randn(9, 8, 64, dtype=dtype, gen=g).cuda()
    cos, sin = torch.rand(100, 64, generator=g).cuda(), torch.rand(100, 64, generator=g).cuda()
    positions, slots = torch.randint(0, 100, (9,)).cuda(), torch.tensor([3, -1, 7, 0, 9, 12, 15, 1, 2]).cuda()
    caches = [torch.zeros(4, 8, 8, 64, dtype=dtype, device="cuda") for _ in range(4)]
    got = K.rope_write_kv(q, k, v, positions, cos, sin, caches[0], caches[1], slots, backend="triton")
    twin = K.rope_write_kv_ref(q, k, v, positions, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, twin) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_fused_graphed_verify_steps_match_transformers(model_dirs, arch):
    """On CUDA in fp32: the fused kernels, CUDA graphs, and n-gram verify steps replayed as graph rows."""
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=256, max_num_seqs=8,
                                 speculate="ngram"), show_progress=False)
    assert engine.runner.model.fused_backend == "auto" and engine.runner.graphs is not None
    prompt = prompts(1, seed=40, lo=24, hi=24)[0]
    ref_tokens, ref_logits = reference(hf, prompt, 24)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                             context=[prompt + ref_tokens])
    for _ in engine.steps([rid]):
        pass
    assert_greedy_equal(engine.pop_output(rid).outputs[0].token_ids, ref_tokens, ref_logits)
    assert engine.speculator.stats.accepted_tokens > 0
