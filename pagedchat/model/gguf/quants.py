"""GGUF's block formats, dequantized with torch ops: bit-identical to gguf-py's numpy reference, on CPU or CUDA.

A quantized row is a run of blocks; a block packs `block_size` values into `type_size` bytes: small integers q
plus one or two float16 scales (and, in the K-quants, 4- or 6-bit sub-block scales). A value is d * q, or
d * q + m, or (d * sc) * q - dmin * m_sub. Bit-identical means every float32 op is the reference's, in its
order: float32 rounding makes (d * sc) * q differ from d * (sc * q) in the last bit. Each function below says
what it computes; integer work (unpacking, offsets) is exact in any order.

Byte layouts, per block (f16 = one float16 scale):
    Q8_0  f16 d | 32 int8
    Q4_0  f16 d | 16 bytes: value j < 16 in the low nibble of byte j, value j + 16 in its high nibble
    Q4_1  f16 d, f16 m | 16 bytes as Q4_0
    Q5_0  f16 d | 4 bytes: bit j of the little-endian u32 is bit 4 of value j | 16 bytes as Q4_0
    Q5_1  f16 d, f16 m | 4 bytes as Q5_0 | 16 bytes as Q4_0
    Q2_K  16 bytes sub-block scales (low nibble sc, high nibble m) | 64 bytes q | f16 d, f16 dmin
    Q3_K  32 bytes high bits | 64 bytes q | 12 bytes 6-bit scales | f16 d
    Q4_K  f16 d, f16 dmin | 12 bytes 6-bit (sc, m) pairs | 128 bytes q
    Q5_K  f16 d, f16 dmin | 12 bytes as Q4_K | 32 bytes high bits | 128 bytes q
    Q6_K  128 bytes low nibbles | 64 bytes high 2 bits | 16 int8 scales | f16 d
The K-quants' 256-value blocks are 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K, Q5_K), each with
its own scale. Within a K-quant's q bytes, a run of 32 bytes holds 2, 4 or 8 consecutive runs of 32 values, one
per bit field of the byte, lowest field first (`_fields`).
"""

from __future__ import annotations

from typing import Callable

import torch
from pagedchat.errors import ModelLoadError
from pagedchat.model.gguf.reader import BLOCKS as GGML_QUANT_SIZES, GGMLType as T

# Values dequantized per step. The temporaries are a few float32 and uint8 copies of one step (tens of MiB),
# whatever the tensor's size: a 262144 x 640 embedding needs no more than a small layer.
CHUNK_VALUES = 1 << 21


def type_name(qtype: int) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def row_bytes(qtype: int, n_values: int) -> int:
    """Bytes of a row of `n_values` values in `qtype` (a whole number of blocks)."""
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    if n_values % block_size:
        raise ValueError(f"a {type_name(qtype)} row holds a multiple of {block_size} values, not {n_values}")
    return n_values // block_size * type_size


def check_supported(qtype: int, tensor_name: str) -> None:
    if qtype not in SUPPORTED:
        names = ", ".join(type_name(t) for t in _DEQUANTIZE)
        raise ModelLoadError(f"GGUF tensor {tensor_name} has type {type_name(qtype)}, which pagedchat cannot "
                             f"load (supported: {names})")


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw: uint8 [rows, row_bytes], whole rows of blocks as the file stores them (a 1-D raw is one row) ->
    [rows, values_per_row] in `dtype`, or `shape` when given. Computed in float32, then cast."""
    _check_raw(raw, qtype)
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    rows, per_row = raw.numel() // raw.shape[-1], raw.shape[-1] // type_size * block_size
    out = torch.empty((rows, per_row), dtype=dtype, device=raw.device)
    dequantize_into(raw, qtype, out)
    return out if shape is None else out.view(shape)


# A faster dequantizer of the same values, bit for bit, where one is loaded (the native library's: installed by
# pagedchat/native/dequantize.py, which the model floor cannot import): (blocks uint8 [n, type_size], qtype,
# values [n, block_size]) -> whether it wrote them.
FastDequantizer = Callable[[torch.Tensor, int, torch.Tensor], bool]
_fast: FastDequantizer | None = None


def use_fast_dequantizer(fn: FastDequantizer | None) -> None:
    global _fast
    _fast = fn


def dequantize_into(raw: torch.Tensor, qtype: int, out: torch.Tensor, fast: bool = True) -> None:
    """dequantize(), written into `out` (contiguous, any float dtype, as many values as `raw` holds): lets a
    layer made of several parts fill one weight without a concatenating copy. fast=False: always the torch
    functions below (the reference the fast dequantizer is held to)."""
    _check_raw(raw, qtype)
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    blocks, values = raw.reshape(-1, type_size), out.view(-1, block_size)
    if values.shape[0] != blocks.shape[0]:
        raise ValueError(f"{blocks.shape[0]} {type_name(qtype)} blocks do not fill an output of {out.numel()}")
    if fast and _fast is not None and _fast(blocks, qtype, values):
        return
    blocks_of = _DEQUANTIZE[qtype]
    step = max(1, CHUNK_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        values[start:start + step] = blocks_of(blocks[start:start + step])


def _check_raw(raw: torch.Tensor, qtype: int) -> None:
    if qtype not in SUPPORTED:
        raise ValueError(f"cannot dequantize GGUF type {type_name(qtype)}")
    if raw.dtype != torch.uint8:
        raise ValueError(f"GGUF blocks are raw bytes (uint8), got {raw.dtype}")
    type_size = GGML_QUANT_SIZES[T(qtype)][1]
    if raw.dim() == 0 or raw.shape[-1] == 0 or raw.shape[-1] % type_size:
        raise ValueError(f"{type_name(qtype)} rows are whole {type_size}-byte blocks, got shape {tuple(raw.shape)}")


# -- unpacking helpers: integer work, exact -------------------------------------------------------------------------
def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes of little-endian float16 -> [n, 1] float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _fields(b: torch.Tensor, bits: int, dim: int = -2) -> torch.Tensor:
    """The `bits`-wide fields of every byte, lowest first, stacked along a new dimension `dim`."""
    mask = (1 << bits) - 1
    return torch.stack([(b >> shift) & mask for shift in range(0, 8, bits)], dim=dim)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> the 32 4-bit values of Q4_0/Q4_1/Q5_0/Q5_1 in order (low nibbles first)."""
    return _fields(qs, 4).reshape(qs.shape[0], 32)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes per block, a little-endian u32 -> its 32 bits, bit j as value j's bit 4 (already shifted)."""
    return _fields(qh, 1, dim=-1).reshape(qh.shape[0], 32) << 4


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> (sc, m), 8 6-bit values each, as float32. Bytes 0-3 and 4-7 hold sc and m
    of sub-blocks 0-3 in their low 6 bits; sub-blocks 4-7 take their low 4 bits from bytes 8-11 (sc low nibble,
    m high nibble) and their top 2 bits from the top 2 bits of bytes 0-3 (sc) and 4-7 (m)."""
    sc_lo, m_lo, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (mixed & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=1)
    m = torch.cat([m_lo & 0x3F, (mixed >> 4) | ((m_lo >> 2) & 0x30)], dim=1)
    return sc.float(), m.float()


# -- one function per type: uint8 blocks [n, type_size] -> float32 [n, block_size] -------------------------------
def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_values(b: torch.Tensor) -> torch.Tensor:
    return _f16(b)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # q * d
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, 0:2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d * (q - 8)
    return _f16(b[:, 0:2]) * (_nibbles32(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d * q + m
    return _f16(b[:, 0:2]) * _nibbles32(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d * (q - 16)
    q = _nibbles32(b[:, 6:]) | _high_bits32(b[:, 2:6])
    return _f16(b[:, 0:2]) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d * q + m
    q = _nibbles32(b[:, 8:]) | _high_bits32(b[:, 4:8])
    return _f16(b[:, 0:2]) * q.float() + _f16(b[:, 2:4])


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # (d * sc) * q - (dmin * m), per sub-block of 16
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float())[..., None]
    ml = (dmin * (scales >> 4).float())[..., None]
    q = _fields(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:  # (d * (sc - 32)) * q, q = 2 low bits - 4 unless the high bit is set
    n = b.shape[0]
    hmask, qs, s, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    # 16 6-bit scales: low nibbles from bytes 0-7 (low nibbles first), top 2 bits from bytes 8-11 (2 bits each)
    sc = _fields(s[:, 0:8], 4).reshape(n, 16) | (_fields(s[:, 8:12], 2).reshape(n, 16) << 4)
    dl = (d * (sc.float() - 32))[..., None]
    low = _fields(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    unset = (_fields(hmask, 1).reshape(n, 16, 16) ^ 1).float()
    return (dl * (low - 4 * unset)).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # (d * sc) * q - (dmin * m), per sub-block of 32
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    q = _fields(b[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # as Q4_K, with a fifth bit per value
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    low = _fields(b[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    high = _fields(b[:, 16:48], 1).reshape(n, 8, 32) << 4
    q = (low | high).float()
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # (d * sc) * (q - 32), per sub-block of 16
    n = b.shape[0]
    ql, qh, sc, d = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(torch.int8), _f16(b[:, 208:210])
    # each half of the block: 64 low-nibble bytes (two runs of 64 values), 32 high bytes (four runs of 32)
    low = _fields(ql.reshape(n, 2, 64), 4).reshape(n, 256)
    high = _fields(qh.reshape(n, 2, 32), 2).reshape(n, 256) << 4
    q = ((low | high).float() - 32).reshape(n, 16, 16)
    return ((d * sc.float())[..., None] * q).reshape(n, 256)


_DEQUANTIZE = {
    T.F32: _f32, T.F16: _f16_values, T.BF16: _bf16,
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
SUPPORTED: frozenset[int] = frozenset(int(t) for t in _DEQUANTIZE)
