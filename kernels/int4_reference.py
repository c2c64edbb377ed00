"""The torch twin of the int4 weight matmul (triton_int4.py): the test oracle (run it in float64) and the path
for many rows on CPU.

The layout is pagedchat/model/int4.py's (not imported: kernels import nothing of pagedchat; a test checks that
both read it alike): `packed` uint8 [out, in / 2], `scales` float16 [out, in / 32]; byte j of a 32-weight
group holds weight j + 8 in its low nibble and weight j + 16 + 8 in its high one.
"""

from __future__ import annotations

import torch

GROUP = 32
CHUNK_WEIGHTS = 1 << 20  # weights dequantized at a time by the matmul (4 MiB in fp32)


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in]: each value d * q computed in fp32 (fp64 for a float64 oracle) and rounded once
    to `dtype`. Each nibble half is scaled straight into its strided place in the output, so no pass
    interleaves bytes (twice as fast as unpack-then-scale on CPU)."""
    rows, half = packed.shape
    assert scales.shape == (rows, half * 2 // GROUP), "scales must be [out, in / 32]"
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    d = scales.to(compute)[:, :, None]
    weight = torch.empty((rows, half // (GROUP // 2), 2, GROUP // 2), dtype=dtype, device=packed.device)
    for h, nibbles in enumerate((packed & 0x0F, packed >> 4)):
        q = (nibbles.view(torch.int8) - 8).view(rows, -1, GROUP // 2)
        torch.mul(q, d, out=weight[:, :, h])
    return weight.view(rows, -1)


def int4_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, in] times the int4 weight's transpose -> [M, out] in x's dtype: the weight dequantized to x's
    dtype, then a matmul (fp32 accumulation in half precision). The weight is dequantized CHUNK_WEIGHTS at a
    time: the piece stays in cache for its matmul, and its buffer is reused, where a whole fp32 copy of a
    large layer would be a fresh allocation, page-faulted in, at every call."""
    rows = max(1, CHUNK_WEIGHTS // x.shape[1])
    if packed.shape[0] <= rows:
        return torch.nn.functional.linear(x, int4_dequantize(packed, scales, x.dtype))
    out = torch.empty((x.shape[0], packed.shape[0]), dtype=x.dtype, device=x.device)
    for r in range(0, packed.shape[0], rows):
        torch.mm(x, int4_dequantize(packed[r:r + rows], scales[r:r + rows], x.dtype).T, out=out[:, r:r + rows])
    return out
