"""The int4 weight layout (`--quantize int4`): what the quantizer writes and every int4 matmul reads (the torch
path, the native CPU step, the Triton kernel).

Group-wise and symmetric, llama.cpp Q4_0's shape: every run of GROUP = 32 input features of an output row has one
float16 scale d, and each weight is d * q with q in -8..7. Why 32: it is Q4_0's block, so the bytes per weight
(4.5 bits) match the peer users compare against, and it is the most accurate end of the usual 32-128 range.
Why symmetric with a searched scale: no zero point keeps the inner loop one multiply per group; instead of
Q4_0's fixed choice (the largest-magnitude weight maps to -8) the scale is picked per group, from a few
candidates, as the one with the least squared error, which is never worse than Q4_0's own choice (one of the
candidates).

Packing: a group's 32 values take 16 bytes; byte j holds q[j] + 8 in its low nibble and q[j + 16] + 8 in its
high nibble, so one 16-byte load, a mask and a shift give 32 consecutive weights in order (the SIMD-friendly
order llama.cpp uses). `packed` is uint8 [out, in / 2], `scales` float16 [out, in / 32]; in must be a multiple
of GROUP.
"""

from __future__ import annotations

import torch

GROUP = 32
# Candidate scales per group, as multiples of max|w| / 8: Q4_0's own choice (the signed extreme -> -8), then
# smaller ones that clip the extreme a little to resolve the rest more finely.
_SHRINK = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76)
_ROWS_PER_CHUNK = 256  # bounds the search's temporary memory on large layers


def supports(in_features: int) -> bool:
    return in_features % GROUP == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (float) -> (packed uint8 [out, in / 2], scales float16 [out, in / GROUP])."""
    out_features, in_features = weight.shape
    assert supports(in_features), f"int4 needs in_features divisible by {GROUP}, got {in_features}"
    packed = torch.empty((out_features, in_features // 2), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((out_features, in_features // GROUP), dtype=torch.float16, device=weight.device)
    for r in range(0, out_features, _ROWS_PER_CHUNK):
        q, d = _quantize_rows(weight[r:r + _ROWS_PER_CHUNK].float())
        packed[r:r + _ROWS_PER_CHUNK] = _pack(q)
        scales[r:r + _ROWS_PER_CHUNK] = d
    return packed, scales


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, in] fp32 -> (q int8 [rows, in] in -8..7, d float16 [rows, in / GROUP]) with the best scale.

    Each candidate's error is computed in place in one scratch tensor and only the best scale per group is kept;
    q is made once, from it (the same q the best candidate made). Keeping each candidate's q too took twice as
    long: 1B parameters on one thread ~100 s."""
    groups = w.view(w.shape[0], -1, GROUP)
    extreme = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))  # signed, [rows, G, 1]
    scratch = torch.empty_like(groups)
    best_d, best_err = None, None
    for shrink in _SHRINK:
        d = (extreme / -8.0 * shrink).to(torch.float16)
        err = _rounded(groups, d, scratch).mul_(d.float()).sub_(groups).square_().sum(dim=-1, keepdim=True)
        if best_err is None:
            best_d, best_err = d, err
        else:
            better = err < best_err
            best_d = torch.where(better, d, best_d)
            best_err = torch.minimum(err, best_err)
    return _rounded(groups, best_d, scratch).to(torch.int8).view(w.shape), best_d.squeeze(-1)


def _rounded(groups: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """round(groups / d) clamped to -8..7, into `out` (a zero scale divides by 1: its group is all zeros)."""
    safe = torch.where(d == 0, torch.ones_like(d), d).float()
    return torch.div(groups, safe, out=out).round_().clamp_(-8, 7)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q int8 [rows, in] in -8..7 -> uint8 [rows, in / 2] in the layout above."""
    u = (q + 8).to(torch.uint8).view(q.shape[0], -1, 2, GROUP // 2)  # [rows, G, half, 16]
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(q.shape[0], -1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] -> int8 [out, in] in -8..7."""
    b = packed.view(packed.shape[0], -1, GROUP // 2)
    low, high = (b & 0x0F).to(torch.int8) - 8, (b >> 4).to(torch.int8) - 8
    return torch.cat((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed, scales) -> the weight [out, in] in `dtype` (computed in fp32)."""
    q = unpack_int4(packed).float().view(packed.shape[0], -1, GROUP)
    return (q * scales.float()[..., None]).reshape(packed.shape[0], -1).to(dtype)
