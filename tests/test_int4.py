"""--quantize int4: the layer against the dequantized weight's float64 product, the Triton kernel against its
torch twin (under the interpreter, and on CUDA when there is one), the engine and the CLI.

int4 is not exact against fp32 by design: the engine tests check that it runs and report agreement; how
close it stays is measured by `pagedchat bench accuracy` (docs/benchmarks.md)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagedchat import kernels as K
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model import quantize as Q
from pagedchat.model.int4 import dequantize_int4, quantize_int4

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")


def _weights(out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(out_features, in_features, generator=g) * 0.1)


def _exact(x: torch.Tensor, packed, scales) -> torch.Tensor:
    return x.double() @ dequantize_int4(packed, scales, torch.float64).T


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_twin_reads_the_layout_as_model_int4_does(dtype):
    packed, scales = _weights(70, 4 * 32)
    assert torch.equal(K.int4_dequantize(packed, scales, dtype), dequantize_int4(packed, scales, dtype))


def test_twin_matmul_in_chunks_is_the_whole_matmul(monkeypatch):
    packed, scales = _weights(100, 64)
    x = torch.randn(5, 64, dtype=torch.float64)
    whole = K.int4_matmul_ref(x, packed, scales)
    monkeypatch.setattr(K.int4_reference, "CHUNK_WEIGHTS", 64 * 16)  # 16 rows at a time, a short last one
    assert torch.allclose(K.int4_matmul_ref(x, packed, scales), whole, rtol=1e-12, atol=0)
    assert torch.allclose(whole, _exact(x, packed, scales), rtol=1e-12, atol=0)


@pytest.mark.parametrize("out_features, rows, bias", [(48, 1, True), (48, Q.CPU_PACKED_MAX_ROWS, False),
                                                      (48, Q.CPU_PACKED_MAX_ROWS + 1, True), (40, 3, False)])
def test_int4_linear_is_the_dequantized_matmul(out_features, rows, bias):
    """A few rows take torch's int4 kernel (bf16 activations and scales), more rows or widths it cannot tile
    (40 output features) the twin's fp32 matmul: both are the dequantized weight's product."""
    torch.manual_seed(0)
    linear = nn.Linear(96, out_features, bias=bias)
    q = Q.Int4Linear(linear)
    assert q.packed.shape == (out_features, 48) and q.scales.shape == (out_features, 3)
    assert q.scales.dtype == torch.float16 and q.packed.dtype == torch.uint8
    x = torch.randn(rows, 1, 96)
    want = _exact(x.reshape(rows, 96), q.packed, q.scales).view(rows, 1, out_features)
    if bias:
        want = want + linear.bias.double()
    got = q(x)
    assert got.shape == (rows, 1, out_features) and got.dtype == torch.float32
    packed_path = rows <= Q.CPU_PACKED_MAX_ROWS and out_features % Q.CPU_PACKED_OUT_MULTIPLE == 0
    assert (q.cpu_weight is not None) == packed_path  # torch's layout is made at the first few-row call only
    assert _rel_err(got, want) < (1e-2 if packed_path else 1e-6)


def test_int4_linear_in_half_precision():
    torch.manual_seed(0)
    q = Q.Int4Linear(nn.Linear(64, 40, bias=False))
    x = torch.randn(20, 64)
    for dtype in (torch.bfloat16, torch.float16):
        got = q(x.to(dtype))
        assert got.dtype == dtype and _rel_err(got, _exact(x.to(dtype), q.packed, q.scales)) < 1e-2


def test_quantize_model_keeps_int8_where_int4_cannot_group(caplog):
    """A layer whose input width is not a multiple of 32 stays int8, and one line says how many."""
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64), nn.Linear(64, 32))
    with caplog.at_level(logging.WARNING, logger="pagedchat.model"):
        Q.quantize_model(model, "int4")
    assert [type(m).__name__ for m in model] == ["Int4Linear", "Int8Linear", "Int4Linear"]
    assert [r.getMessage() for r in caplog.records] == [
        "pagedchat: --quantize int4: 1 of 3 linear layers stay int8 (their input width is not a multiple of 32)"]


# -- the Triton kernel against its twin -------------------------------------------------------------------

# The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest), so bf16 gets a wider bound.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


@needs_triton
@pytest.mark.parametrize("out_features, in_features, rows", [(48, 96, 1), (7, 32, 3), (130, 256, 17),
                                                             (33, 160, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_int4_matches_its_twin(monkeypatch, out_features, in_features, rows, dtype):
    """One row takes the one-row kernel, more rows the tensor-core one; odd row and feature counts, groups
    that do not fill the last run (160 = 5 groups), features that do not fill the last tile."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    packed, scales = _weights(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features).to(dtype)
    got = K.int4_matmul(x, packed, scales, backend="triton")
    assert got.shape == (rows, out_features) and got.dtype == dtype
    assert _rel_err(got, K.int4_matmul_ref(x.double(), packed, scales)) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("kernel, rows", [("gemv", 3), ("gemm", 1)])
def test_triton_int4_either_kernel_takes_any_rows(monkeypatch, kernel, rows):
    from pagedchat.kernels.triton_int4 import Int4Config

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    packed, scales = _weights(24, 96)
    x = torch.randn(rows, 96)
    config = Int4Config(kernel, block_n=16, block_g=2, block_m=16)
    got = K.int4_matmul(x, packed, scales, backend="triton", config=config)
    assert _rel_err(got, _exact(x, packed, scales)) < 1e-5


@needs_triton
def test_triton_int4_reads_strided_rows_and_no_rows(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    packed, scales = _weights(16, 64)
    wide = torch.randn(3, 128)
    x = wide[:, :64]  # rows 128 apart
    assert _rel_err(K.int4_matmul(x, packed, scales, backend="triton"), _exact(x, packed, scales)) < 1e-5
    assert K.int4_matmul(wide[:0, :64], packed, scales, backend="triton").shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 300])
@pytest.mark.parametrize("out_features, in_features", [(2048, 2048), (3072, 2048), (16384, 2048), (2048, 8192)])
def test_triton_int4_on_cuda(rows, out_features, in_features):
    """The 1B shape's layers (q/k/v, gate+up, down) in bf16 on the GPU against the float64 twin."""
    packed, scales = (t.cuda() for t in _weights(out_features, in_features))
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    got = K.int4_matmul(x, packed, scales)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert _rel_err(got, K.int4_matmul_ref(x.double(), packed, scales)) < 1e-2


# -- the engine and the CLI --------------------------------------------------------------------------------

def _greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def test_int4_engine_against_the_unquantized_engine(model_dirs):
    """Every linear layer is int4 (the tied LM head a copy of its own), and the engine generates. Agreement is
    reported, not asserted: the tests' models are random with a large init std (chaotic on purpose), where
    int4's rounding (~7% of a weight's spread per weight, 12x int8's) flips most greedy choices; trained
    models are measured by `pagedchat bench accuracy`."""
    path, _ = model_dirs["qwen2"]
    engines = {q: Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, quantize=q), show_progress=False)
               for q in (None, "int4")}
    model = engines["int4"].runner.model
    assert sum(isinstance(m, Q.Int4Linear) for m in model.modules()) == 2 * 4 + 1
    assert not any(isinstance(m, (nn.Linear, Q.Int8Linear)) for m in model.modules())
    assert model.embed_tokens.weight.dtype == torch.float32
    prompts = [list(range(5, 40)), list(range(100, 110))]
    fp, q4 = (_greedy(e, prompts, 8) for e in engines.values())
    agree = sum(a == b for x, y in zip(fp, q4) for a, b in zip(x, y))
    print(f"int4 vs fp32 greedy tokens agreeing: {agree}/16")
    assert [len(t) for t in q4] == [8, 8]


@needs_triton
def test_engine_on_the_triton_int4_kernel(model_dirs, monkeypatch):
    """End to end through the Triton kernel (interpreted): every int4 layer on Triton gives the tokens of the
    twin's fp32 matmul (the CPU's bf16 int4 kernel turned off, so both compute the same products)."""
    path, _ = model_dirs["llama"]
    monkeypatch.setattr(Q, "CPU_PACKED_MAX_ROWS", 0)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, quantize="int4"),
                    show_progress=False)
    prompt = [list(range(5, 17))]
    want = _greedy(engine, prompt, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for m in engine.runner.model.modules():
        if isinstance(m, Q.Int4Linear):
            m.backend = "triton"
    assert _greedy(engine, prompt, 3) == want


@pytest.mark.gpu
def test_int4_engine_on_cuda(model_dirs):
    """On the GPU every int4 layer runs the Triton kernel, decode steps inside captured CUDA graphs; greedy
    tokens match the same engine's eager steps (graphs off) at least until a near-tie."""
    path, _ = model_dirs["llama"]
    outs = []
    for graphs in (True, False):
        engine = Engine(EngineConfig(model=str(path), device="cuda", num_blocks=64, quantize="int4",
                                     cuda_graphs=graphs), show_progress=False)
        assert sum(isinstance(m, Q.Int4Linear) for m in engine.runner.model.modules()) == 2 * 4 + 1
        outs.append(_greedy(engine, [list(range(5, 30)), list(range(50, 58))], 12))
    assert all(len(t) == 12 for t in outs[0]) and all(a[:4] == b[:4] for a, b in zip(*outs)), outs


def test_int4_through_run(model, pagedchat_cli, xdg_home):
    from pagedchat.settings import ModelOptions, load_engine

    code, out, err = pagedchat_cli("run", "-m", str(model), "--raw", "--quantize", "int4", "--max-tokens", "4",
                                   "--json", "hi")
    assert code == 0 and '"completion_tokens": 4' in out, err
    config = xdg_home / "config" / "pagedchat"
    config.mkdir(parents=True)
    (config / "models.toml").write_text(f'[models.q]\npath = "{model}"\nquantize = "int4"\n')
    engine, _ = load_engine(ModelOptions(model="q"), show_progress=False)
    assert any(isinstance(m, Q.Int4Linear) for m in engine.runner.model.modules())


def test_unknown_quantize_is_one_line(model, pagedchat_cli):
    code, _, err = pagedchat_cli("run", "-m", str(model), "--raw", "--quantize", "int3", "hi")
    assert code != 0 and err.strip().splitlines() == [
        "pagedchat: error: --quantize must be int8, int4 or none, got 'int3'"]
