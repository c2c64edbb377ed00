"""Quantized KV blocks: the layout every path that reads or writes a quantized pool shares.

A quantized pool keeps each layer's K and V as int8 (CPU and CUDA) or float8 e4m3 (CUDA) in the usual cache
layout [num_blocks, block_size, Hkv, D], beside one float16 scale per (slot, KV head): `k_scale`, `v_scale`
[num_blocks, block_size, Hkv]. A token's head is stored as round(x / scale) (int8, clamped to +-127) or
x / scale cast to e4m3 (saturating at +-448), with scale = max|x| / 127 (or / 448) rounded to float16, so
that dequantizing is one multiply: x ~= q * scale.

Why per (token, head) and not per block: a block is written one token at a time (decode, forks, speculation's
rollback), so a per-block scale would have to re-quantize the tokens already there whenever a new one grows
the block's range. Per token and head, every write is final and a block copy (copy-on-write, the RAM and disk
tiers) copies the scales with the values. Why float16 scales: 2 bytes per head keep int8 at 3.9x fewer bytes
than fp32 for head dim 64 (fp32 scales: 3.8x), and 11 bits of mantissa move a scale by at most 0.05%.

These are the torch twins (and the float64 oracle's input); the Triton kernels and the native CPU step
quantize and dequantize the same way.
"""

from __future__ import annotations

import torch

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float16
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _QMAX


def qmax(dtype: torch.dtype) -> float:
    """The largest stored magnitude of a quantized KV dtype."""
    return _QMAX[dtype]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (values [..., D] of `dtype`, scales [...] float16)."""
    top = qmax(dtype)
    amax = x.float().abs().amax(dim=-1)
    scale = (amax / top).to(SCALE_DTYPE)
    # A head of zeros (or one whose scale underflows float16) is stored as zeros with scale 0.
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(amax))
    scaled = x.float() / safe[..., None]
    if dtype == torch.int8:
        values = scaled.round().clamp(-top, top).to(torch.int8)
    else:
        values = scaled.clamp(-top, top).to(dtype)
    return values, scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., D], scales [...]) -> [..., D] in `dtype` (compute in at least fp32)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (values.to(wide) * scale.to(wide)[..., None]).to(dtype)
