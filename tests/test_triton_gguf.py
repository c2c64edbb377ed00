"""The Triton GGUF matmuls (kernels/triton_gguf.py) against their torch twin, the weight dequantized by
pagedchat/model/gguf/quants.py (bit-identical to gguf-py) and multiplied by F.linear, here in float64: every type,
both kernels, under the interpreter on CPU, on CUDA when there is one, and compiled for sm_90 without spills.

Tolerances (max |error| / max |exact|): the kernels accumulate in fp32 in another order than float64, so fp32
inputs differ by rounding alone (1e-5; measured ~1e-7). fp16/bf16 outputs are rounded to 11/8 bits, and the gemm
rounds each weight to x's dtype as the twin's F.linear does; the interpreter rounds fp32 -> bf16 toward zero
where the GPU rounds to nearest, which biases the bf16 weights (3e-2 as test_int4.py allows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedchat import kernels as K
from pagedchat.bench.gguf_writer import random_blocks
from pagedchat.model.gguf.linear import GGUFLinear
from pagedchat.model.gguf.quants import dequantize
from pagedchat.model.gguf.reader import GGMLType

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
if K.HAS_TRITON:
    # Imported now, before any test sets TRITON_INTERPRET: Triton freezes its reduction combiners in the mode of its
    # import; compiled ones serve the interpreter too (kernels/_launch.py), interpreted ones cannot be compiled.
    import triton  # noqa: F401
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def _blocks(qtype: str, rows: int, width: int, seed: int = 0, quantized: bool = True) -> torch.Tensor:
    """uint8 [rows, row bytes]: gguf-py's quantization of random weights, or (the K-quants, which it cannot
    quantize, and without `quantized`: the GPU machine has no gguf-py) random blocks with small finite float16
    scales."""
    rng = np.random.default_rng(seed)
    if qtype.endswith("_K") or not quantized:
        raw = random_blocks((rows, width), GGMLType[qtype], rng)
    else:
        import gguf

        kind = getattr(gguf.GGMLQuantizationType, qtype)
        raw = gguf.quants.quantize(rng.standard_normal((rows, width)).astype(np.float32) * 0.1, kind)
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1))


def _twin(x: torch.Tensor, raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """The twin's product in float64: F.linear with the dequantized weight."""
    return F.linear(x.double(), dequantize(raw, int(GGMLType[qtype])).double())


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _width(qtype: str) -> int:
    """Three blocks."""
    return 768 if qtype.endswith("_K") else 96


def _forced(kernel: str, qtype: str):
    """Small tiles, so a 13-row weight takes several programs, and iterations that leave the last one partial on
    three blocks (3 units, 12 of Q4_K/Q5_K, 6 of Q6_K)."""
    from pagedchat.kernels.triton_gguf import FORMATS, GGUFConfig

    block_u = {16: 2, 32: 8, 64: 4}[FORMATS[qtype][2]]
    return GGUFConfig(kernel, block_n=4 if kernel == "gemv" else 16, block_u=block_u,
                      block_m=4 if kernel == "gemv" else 16)


@needs_triton
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
@pytest.mark.parametrize("qtype", TYPES)
def test_each_kernel_matches_the_twin(monkeypatch, qtype, kernel, rows):
    """Either kernel takes any number of rows (odd ones, past its row tile); 13 output features (odd, not a
    tile's multiple); inputs of three blocks, so the last iteration is partial."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    width = _width(qtype)
    raw = _blocks(qtype, 13, width, seed=rows)
    x = torch.randn(rows, width)
    got = K.gguf_matmul_triton(x, raw, qtype, config=_forced(kernel, qtype))
    assert got.shape == (rows, 13) and got.dtype == torch.float32
    assert _rel_err(got, _twin(x, raw, qtype)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_1", "Q4_K", "Q6_K"])
def test_the_default_choice_matches_the_twin(monkeypatch, qtype, rows):
    """What a real call picks: the gemv up to GEMV_MAX_ROWS rows (a row tile of 1 or 4), the gemm beyond."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raw = _blocks(qtype, 37, 512, seed=rows)
    x = torch.randn(rows, 512)
    assert _rel_err(K.gguf_matmul_triton(x, raw, qtype), _twin(x, raw, qtype)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel, rows", [("gemv", 2), ("gemm", 20)])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_half_precision_inputs(monkeypatch, qtype, kernel, rows, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raw = _blocks(qtype, 24, 256)
    x = torch.randn(rows, 256).to(dtype)
    got = K.gguf_matmul_triton(x, raw, qtype, config=_forced(kernel, qtype))
    assert got.dtype == dtype and _rel_err(got, _twin(x, raw, qtype)) < TOL[dtype]


@needs_triton
def test_writes_a_column_slice_from_strided_rows_and_takes_no_rows(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raw = _blocks("Q4_K", 10, 256)
    wide = torch.randn(3, 512)
    x = wide[:, :256]                                    # rows 512 apart
    out = torch.full((3, 30), 7.0)
    K.gguf_matmul_triton(x, raw, "Q4_K", out=out[:, 5:15])
    assert _rel_err(out[:, 5:15], _twin(x, raw, "Q4_K")) < 1e-5
    assert (out[:, :5] == 7).all() and (out[:, 15:] == 7).all()
    assert K.gguf_matmul_triton(wide[:0, :256], raw, "Q4_K").shape == (0, 10)


@needs_triton
@pytest.mark.parametrize("batch", [1, 6])
def test_gguf_linear_on_triton_is_its_dequantizing_path(monkeypatch, batch):
    """A fused q/k/v layer whose parts have different types, with a bias: each part's launch writes its own
    columns. The Triton path is what forward() takes on CUDA; here it runs interpreted on CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    parts = [(_blocks(qtype, rows, 256, seed=i), int(GGMLType[qtype]))
             for i, (qtype, rows) in enumerate([("Q4_K", 16), ("Q5_0", 8), ("Q6_K", 8)])]
    layer = GGUFLinear(parts, 256, bias=torch.randn(32))
    x = torch.randn(batch, 2, 256)
    got = layer.triton_forward(x)
    assert got.shape == (batch, 2, 32)
    assert _rel_err(got, F.linear(x.double(), layer.dequantized(torch.float64), layer.bias.double())) < 1e-5
    assert torch.allclose(got, layer(x), rtol=1e-5, atol=1e-5 * layer(x).abs().max().item())   # forward: CPU path


@needs_triton
def test_parts_of_one_type_join_into_one_launch_and_the_same_product(monkeypatch):
    """What the loader does on CUDA: q and k (Q4_K), v (Q6_K), then gate and up (Q4_K) become one part per run of
    a type, so a step launches a kernel per run; the layer's weight and its Triton product are unchanged."""
    from pagedchat.model.gguf.linear import runs_of_one_type

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    typed = [("Q4_K", 16), ("Q4_K", 8), ("Q6_K", 8), ("Q4_K", 4), ("Q4_K", 4)]
    parts = [(_blocks(qtype, rows, 256, seed=i), int(GGMLType[qtype])) for i, (qtype, rows) in enumerate(typed)]
    joined = runs_of_one_type(parts)
    assert [(raw.shape[0], type_) for raw, type_ in joined] == \
        [(24, int(GGMLType.Q4_K)), (8, int(GGMLType.Q6_K)), (8, int(GGMLType.Q4_K))]
    assert joined[1][0] is parts[2][0]                   # a part alone is kept as it is, not copied
    apart, together = GGUFLinear(parts, 256), GGUFLinear(joined, 256)
    assert torch.equal(apart.dequantized(), together.dequantized())
    x = torch.randn(3, 256)
    assert torch.equal(apart.triton_forward(x), together.triton_forward(x))


@needs_triton
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 4, 16, 512])
def test_compiles_for_sm90_without_spills(qtype, rows):
    """What the interpreter cannot see: a construct only the compiler rejects, registers spilled. The table:
    python scripts/kernel_resources.py --gguf"""
    from pagedchat.bench import kernel_resources as R

    try:
        rows_out = list(R.gguf_resource_rows([R.GGUFCase(qtype, rows)]))
    except R.Unavailable as exc:
        pytest.skip(str(exc))
    for row in rows_out:
        assert row["resources"].spill_stores == row["resources"].spill_loads == 0, R.gguf_markdown_row(row)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES)
def test_on_cuda(qtype):
    """Llama-3.2-1B's q/k/v width in bf16 on the GPU against the float64 twin, at 1, 3, 16 and 300 rows (both
    kernels, each row tile); a Q4_K_M-typed fused layer through GGUFLinear against its CPU forward."""
    raw = _blocks(qtype, 3072, 2048, quantized=False).cuda()
    for rows in (1, 3, 16, 300):
        x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
        got = K.gguf_matmul_triton(x, raw, qtype)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 3072)
        assert _rel_err(got, _twin(x.cpu(), raw.cpu(), qtype).cuda()) < 1e-2, rows
    if qtype == "Q6_K":
        parts = [(_blocks(t, rows, 2048), int(GGMLType[t])) for t, rows in (("Q4_K", 2048), ("Q6_K", 512))]
        layer = GGUFLinear(parts, 2048)
        want = layer(x.float().cpu())
        assert _rel_err(layer.cuda()(x), want.double()) < 1e-2
