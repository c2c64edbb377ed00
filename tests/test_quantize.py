"""--quantize int8: weight-only int8 with per-channel scales, quantized at load from the fp checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.model.quantize import Int8Linear


def test_int8_linear_is_the_dequantized_matmul():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (48,)
    dequantized = q.weight.float() * q.scales.float()[:, None]
    # per-channel rounding: each weight within half a step of its scale
    assert ((dequantized - linear.weight).abs() <= q.scales.float()[:, None] * 0.5 + 1e-6).all()
    x = torch.randn(3, 5, 64)
    expected = x @ dequantized.T + linear.bias
    got = q(x)
    assert got.shape == (3, 5, 48) and got.dtype == x.dtype
    assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_quantized_engine_runs_and_stays_close_to_fp32(model_dirs, pagedchat_cli):
    path, _ = model_dirs["qwen2"]  # tied embeddings: the LM head is quantized apart from the embedding
    engines = {q: Engine(EngineConfig(model=str(path), device="cpu", num_blocks=64, quantize=q), show_progress=False)
               for q in (None, "int8")}
    linears = [m for m in engines["int8"].runner.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 4 + 1 and not any(isinstance(m, nn.Linear) for m in engines["int8"].runner.model.modules())
    assert engines["int8"].runner.model.embed_tokens.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {q: e.generate([[5, 6, 7, 8, 9, 10]], params)[0].outputs[0].token_ids for q, e in engines.items()}
    assert len(outs["int8"]) == len(outs[None]) == 6  # agreement is measured on real sizes: scripts/int8_accuracy.py
    code, _, err = pagedchat_cli("run", "-m", str(path), "--raw", "--quantize", "int4", "hi")
    assert code == 2 and "--quantize must be int8" in err
