"""The shared layouts of quantized KV blocks (kernels/kv_quant.py) and int4 weights (model/int4.py)."""

import pytest
import torch

from pagedchat.kernels.kv_quant import dequantize_kv, quantize_kv
from pagedchat.model.int4 import GROUP, dequantize_int4, quantize_int4, unpack_int4


@pytest.mark.parametrize("dtype,bound", [(torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 1 / 16)])
def test_kv_round_trip_is_within_half_a_step_of_each_heads_range(dtype, bound):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-3, 3, 7)[:, None, None]
    x[2, 1] = 0.0  # an all-zero head: stored as zeros with scale 0
    values, scale = quantize_kv(x, dtype)
    assert values.dtype == dtype and scale.dtype == torch.float16 and scale.shape == (7, 3)
    y = dequantize_kv(values, scale, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert torch.all((y - x).abs() <= bound * amax * 1.002 + 1e-30)
    assert torch.equal(y[2, 1], torch.zeros(64)) and scale[2, 1] == 0


def test_int4_packing_order_and_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 4 * GROUP, generator=g)
    packed, scales = quantize_int4(w)
    assert packed.shape == (70, 2 * GROUP) and packed.dtype == torch.uint8
    assert scales.shape == (70, 4) and scales.dtype == torch.float16
    q = unpack_int4(packed)
    assert q.min() >= -8 and q.max() <= 7
    # byte j of a group: weight j in the low nibble, weight j + 16 in the high one
    first = packed[0, 0].item()
    assert (first & 0xF) - 8 == q[0, 0] and (first >> 4) - 8 == q[0, 16]
    back = dequantize_int4(packed, scales)
    assert torch.equal(back, (q.float().view(70, 4, GROUP) * scales.float()[..., None]).view(70, -1))
    # never worse than llama.cpp Q4_0's scale choice (one of the candidates), per group
    groups = w.view(70, 4, GROUP)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
    d = (extreme / -8).half().float()
    q4_0 = ((groups / d).round().clamp(-8, 7) * d)
    ours_err = ((back.view(70, 4, GROUP) - groups) ** 2).sum(-1)
    assert torch.all(ours_err <= ((q4_0 - groups) ** 2).sum(-1) + 1e-6)
