"""Triton matmul of activations by GGUF block-format weights (a GGUF model on CUDA): x [M, in] @ W^T with W the
file's raw blocks, dequantized in registers, never in memory. The torch twin is the dequantizer of
pagedchat/model/gguf/quants.py followed by F.linear (what GGUFLinear does off CUDA); each weight is computed by the
twin's float32 formula, in its order (compiled, a multiply-add may be fused: a last-bit difference at most).

Every format is walked in "units": a unit is a run of 2 * RUN consecutive inputs whose weights sit in one run of
RUN bytes, in two pieces of RUN values (the low and high nibbles of those bytes; for Q8_0 the two halves of the
block). So a byte tile is loaded once and gives two weight tiles, each multiplied by its own run of inputs, and no
nibble is ever interleaved:

    type   values/block  bytes/block  RUN  piece 0 / piece 1 of unit r of a block
    Q8_0   32            34           16   int8 values 0-15 / 16-31
    Q4_0   32            18           16   low / high nibbles of the 16 bytes (values 0-15 / 16-31)
    Q4_1   32            20           16   as Q4_0, plus a minimum
    Q5_0   32            22           16   as Q4_0, fifth bit from the 32-bit mask
    Q5_1   32            24           16   as Q5_0, plus a minimum
    Q4_K   256           144          32   low / high nibbles of q bytes 32r..32r+31 (sub-blocks 2r / 2r+1)
    Q5_K   256           176          32   as Q4_K, fifth bit r*2 (+1) of the 32 high-bit bytes
    Q6_K   256           210          64   low / high nibbles of ql bytes 64r..64r+63 (values 128r + 0-63 / 64-127),
                                           two more bits from the qh bytes, a scale per 16 values

Two kernels, picked by the number of rows:
  * gemv (decode, a few rows): memory-bound. A program owns BLOCK_N output features and up to BLOCK_M rows, so
    every block byte is read once per row group; the weights are dequantized to fp32 in registers and multiplied
    by each row's inputs with fp32 accumulation.
  * gemm (prefill, larger batches): each weight tile is dequantized to x's dtype (the twin's F.linear weight) and
    fed to tensor-core dots with fp32 accumulation, one dot per piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import (SUM_COMBINE, Launch, device_function, dot_precision, interpreting, next_pow2, sm_count,
                      varies_per_step)

# GGML type name -> (values per block, bytes per block, RUN)
FORMATS = {"Q8_0": (32, 34, 16), "Q4_0": (32, 18, 16), "Q4_1": (32, 20, 16), "Q5_0": (32, 22, 16),
           "Q5_1": (32, 24, 16), "Q4_K": (256, 144, 32), "Q5_K": (256, 176, 32), "Q6_K": (256, 210, 64)}
# Rows up to which the gemv runs: it re-reads the weights once per BLOCK_M rows, the gemm once per 16 or 64.
GEMV_MAX_ROWS = 4


# -- reading the blocks: integer work, then each type's float32 formula ------------------------------------------
@device_function
def _f16(ptr, mask):
    """The little-endian float16 at ptr (a byte pointer tensor), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@device_function
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@device_function
def _spread(v, GROUPS: tl.constexpr, LEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """[GROUPS, BLOCK_N] -> [GROUPS * LEN, BLOCK_N]: each group's value over its LEN weights."""
    return tl.reshape(tl.broadcast_to(v[:, None, :], (GROUPS, LEN, BLOCK_N)), (GROUPS * LEN, BLOCK_N))


@device_function
def _k_scale_min(scales, s, mask):
    """Q4_K/Q5_K's 6-bit (scale, min) of sub-block s (a tensor, 0-7) from the 12 scale bytes at `scales`, as
    float32. Sub-blocks 0-3: the low 6 bits of bytes s and s + 4. Sub-blocks 4-7: low 4 bits from byte s + 4
    (scale: low nibble, min: high nibble), top 2 bits from the top of byte s - 4 (scale) and byte s (min)."""
    low = s < 4
    a = _byte(scales + tl.where(low, s, s + 4)[:, None], mask)
    b = _byte(scales + tl.where(low, s + 4, s - 4)[:, None], mask)
    c = _byte(scales + s[:, None], mask)
    sc = tl.where(low[:, None], a & 63, (a & 15) | ((b >> 6) << 4))
    m = tl.where(low[:, None], b & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@device_function
def _weights(rows, n_ok, u0, UNITS, QTYPE: tl.constexpr, BLOCK_VALUES: tl.constexpr, TYPE_SIZE: tl.constexpr,
             RUN: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weights of units u0 .. u0 + BLOCK_U - 1 of the rows at `rows` (byte pointers [BLOCK_N]), as two
    float32 tiles [BLOCK_U * RUN, BLOCK_N]: piece 0 and piece 1 of each unit, RUN values each."""
    PER_BLOCK: tl.constexpr = BLOCK_VALUES // (2 * RUN)        # units per block
    unit = u0 + tl.arange(0, BLOCK_U)                           # per unit: its block
    unit_ok = (unit < UNITS)[:, None] & n_ok[None, :]
    block = rows[None, :] + (unit // PER_BLOCK).to(tl.int64)[:, None] * TYPE_SIZE
    i = tl.arange(0, BLOCK_U * RUN)                             # per weight of a piece: its block, its place
    w_unit = u0 + i // RUN
    ok = (w_unit < UNITS)[:, None] & n_ok[None, :]
    at = rows[None, :] + (w_unit // PER_BLOCK).to(tl.int64)[:, None] * TYPE_SIZE
    j = (i % RUN)[:, None]                                      # position in the piece
    r = (w_unit % PER_BLOCK)[:, None]                           # the unit's place in its block
    if QTYPE == "Q6_K":
        w0, w1 = _q6_k(rows, n_ok, u0, UNITS, at, ok, j, r, PER_BLOCK, TYPE_SIZE, BLOCK_U, BLOCK_N)
    elif QTYPE == "Q4_K" or QTYPE == "Q5_K":
        w0, w1 = _q4_k_q5_k(block, unit_ok, unit % PER_BLOCK, at, ok, j, r, QTYPE, RUN, BLOCK_U, BLOCK_N)
    else:
        w0, w1 = _32_value_blocks(block, unit_ok, at, ok, j, QTYPE, RUN, BLOCK_U, BLOCK_N)
    return w0, w1


@device_function
def _32_value_blocks(block, unit_ok, at, ok, j, QTYPE: tl.constexpr, RUN: tl.constexpr, BLOCK_U: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: one unit per block (`block`: its start, `at`: each weight's block start)."""
    d = _spread(_f16(block, unit_ok), BLOCK_U, RUN, BLOCK_N)
    if QTYPE == "Q8_0":                                         # q * d
        q0 = tl.load(at + 2 + j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        q1 = tl.load(at + 2 + RUN + j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w0, w1 = q0 * d, q1 * d
    elif QTYPE == "Q4_0":                                       # d * (q - 8)
        b = _byte(at + 2 + j, ok)
        w0, w1 = d * ((b & 15).to(tl.float32) - 8), d * ((b >> 4).to(tl.float32) - 8)
    elif QTYPE == "Q4_1":                                       # d * q + m
        m = _spread(_f16(block + 2, unit_ok), BLOCK_U, RUN, BLOCK_N)
        b = _byte(at + 4 + j, ok)
        w0, w1 = d * (b & 15).to(tl.float32) + m, d * (b >> 4).to(tl.float32) + m
    elif QTYPE == "Q5_0":                                       # d * (q - 16); bit v of the u32 at byte 2
        b = _byte(at + 6 + j, ok)
        q0 = (b & 15) | (((_byte(at + 2 + j // 8, ok) >> (j % 8)) & 1) << 4)
        q1 = (b >> 4) | (((_byte(at + 4 + j // 8, ok) >> (j % 8)) & 1) << 4)
        w0, w1 = d * (q0.to(tl.float32) - 16), d * (q1.to(tl.float32) - 16)
    else:                                                       # Q5_1: d * q + m; bit v of the u32 at byte 4
        m = _spread(_f16(block + 2, unit_ok), BLOCK_U, RUN, BLOCK_N)
        b = _byte(at + 8 + j, ok)
        q0 = (b & 15) | (((_byte(at + 4 + j // 8, ok) >> (j % 8)) & 1) << 4)
        q1 = (b >> 4) | (((_byte(at + 6 + j // 8, ok) >> (j % 8)) & 1) << 4)
        w0, w1 = d * q0.to(tl.float32) + m, d * q1.to(tl.float32) + m
    return w0, w1


@device_function
def _q4_k_q5_k(block, unit_ok, ru, at, ok, j, r, QTYPE: tl.constexpr, RUN: tl.constexpr, BLOCK_U: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(d * sc) * q - (dmin * m), a 6-bit (sc, m) per sub-block of 32: unit r of a block is sub-blocks 2r
    (piece 0) and 2r + 1 (piece 1); `ru`: each unit's r, `r`: each weight's."""
    sc0, m0 = _k_scale_min(block + 4, 2 * ru, unit_ok)
    sc1, m1 = _k_scale_min(block + 4, 2 * ru + 1, unit_ok)
    d, dmin = _f16(block, unit_ok), _f16(block + 2, unit_ok)
    dsc0, dm0 = _spread(d * sc0, BLOCK_U, RUN, BLOCK_N), _spread(dmin * m0, BLOCK_U, RUN, BLOCK_N)
    dsc1, dm1 = _spread(d * sc1, BLOCK_U, RUN, BLOCK_N), _spread(dmin * m1, BLOCK_U, RUN, BLOCK_N)
    if QTYPE == "Q4_K":
        b = _byte(at + 16 + 32 * r + j, ok)
        q0, q1 = b & 15, b >> 4
    else:                                                       # bit s of high byte j: value j of sub-block s
        b = _byte(at + 48 + 32 * r + j, ok)
        qh = _byte(at + 16 + j, ok)
        q0 = (b & 15) | (((qh >> (2 * r)) & 1) << 4)
        q1 = (b >> 4) | (((qh >> (2 * r + 1)) & 1) << 4)
    return dsc0 * q0.to(tl.float32) - dm0, dsc1 * q1.to(tl.float32) - dm1


@device_function
def _q6_k(rows, n_ok, u0, UNITS, at, ok, j, r, PER_BLOCK: tl.constexpr, TYPE_SIZE: tl.constexpr,
          BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr):
    """(d * sc) * (q - 32), an int8 scale per 16 values: unit r (0, 1) of a block is its 64 ql bytes 64r.. (low
    nibbles: piece 0, high: piece 1), two more bits of each value from qh bytes 128 + 32r.."""
    # groups of 16 weights of a piece: unit g // 4, sub-block 8 * r + 4 * piece + g % 4 of its block
    g = tl.arange(0, BLOCK_U * 4)
    g_unit = u0 + g // 4
    g_ok = (g_unit < UNITS)[:, None] & n_ok[None, :]
    g_block = rows[None, :] + (g_unit // PER_BLOCK).to(tl.int64)[:, None] * TYPE_SIZE
    sub = (8 * (g_unit % PER_BLOCK) + g % 4)[:, None]
    d = _f16(g_block + 208, g_ok)
    sc0 = tl.load(g_block + 192 + sub, mask=g_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    sc1 = tl.load(g_block + 196 + sub, mask=g_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    dsc0 = _spread(d * sc0, BLOCK_U * 4, 16, BLOCK_N)
    dsc1 = _spread(d * sc1, BLOCK_U * 4, 16, BLOCK_N)
    ql = _byte(at + 64 * r + j, ok)
    qh = _byte(at + 128 + 32 * r + j % 32, ok)
    shift = 2 * (j // 32)                                       # piece 0: bits 0-1 or 2-3; piece 1: 4-5 or 6-7
    q0 = (ql & 15) | (((qh >> shift) & 3) << 4)
    q1 = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
    return dsc0 * (q0.to(tl.float32) - 32), dsc1 * (q1.to(tl.float32) - 32)


@device_function
def _unit_tiles(x_ptr, rows, n_ok, m64, m_ok, stride_xm, u0, UNITS, QTYPE: tl.constexpr,
                BLOCK_VALUES: tl.constexpr, TYPE_SIZE: tl.constexpr, RUN: tl.constexpr, BLOCK_U: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Units u0 .. u0 + BLOCK_U - 1: the inputs of each piece (x's dtype, [rows, BLOCK_U * RUN]; piece 1's are
    RUN further on than piece 0's) and the weights of each (float32, [BLOCK_U * RUN, BLOCK_N])."""
    w0, w1 = _weights(rows, n_ok, u0, UNITS, QTYPE, BLOCK_VALUES, TYPE_SIZE, RUN, BLOCK_U, BLOCK_N)
    i = tl.arange(0, BLOCK_U * RUN)
    unit = u0 + i // RUN
    x_at = x_ptr + m64[:, None] * stride_xm + (unit * (2 * RUN) + i % RUN)[None, :]
    x_mask = m_ok[:, None] & (unit < UNITS)[None, :]
    return tl.load(x_at, mask=x_mask, other=0.0), tl.load(x_at + RUN, mask=x_mask, other=0.0), w0, w1


# -- the kernels -------------------------------------------------------------------------------------------------
def _gguf_gemv(x_ptr, w_ptr, out_ptr, M, N, UNITS, stride_xm, stride_wn, stride_om,
               QTYPE: tl.constexpr, BLOCK_VALUES: tl.constexpr, TYPE_SIZE: tl.constexpr, RUN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows, m64 = w_ptr + offs_n.to(tl.int64) * stride_wn, offs_m.to(tl.int64)
    # each thread's products summed in place, across threads once at the end (not once per iteration)
    acc = tl.full((BLOCK_M, BLOCK_U * RUN, BLOCK_N), 0.0, tl.float32)
    for u0 in range(0, UNITS, BLOCK_U):
        x0, x1, w0, w1 = _unit_tiles(x_ptr, rows, n_ok, m64, m_ok, stride_xm, u0, UNITS, QTYPE, BLOCK_VALUES,
                                     TYPE_SIZE, RUN, BLOCK_U, BLOCK_N)
        acc += x0.to(tl.float32)[:, :, None] * w0[None, :, :] + x1.to(tl.float32)[:, :, None] * w1[None, :, :]
    out = tl.reduce(acc, 1, SUM_COMBINE).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m64[:, None] * stride_om + offs_n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@varies_per_step("M")
def _gguf_gemm(x_ptr, w_ptr, out_ptr, M, N, UNITS, stride_xm, stride_wn, stride_om,
               QTYPE: tl.constexpr, BLOCK_VALUES: tl.constexpr, TYPE_SIZE: tl.constexpr, RUN: tl.constexpr,
               PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows, m64 = w_ptr + offs_n.to(tl.int64) * stride_wn, offs_m.to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for u0 in range(0, UNITS, BLOCK_U):
        x0, x1, w0, w1 = _unit_tiles(x_ptr, rows, n_ok, m64, m_ok, stride_xm, u0, UNITS, QTYPE, BLOCK_VALUES,
                                     TYPE_SIZE, RUN, BLOCK_U, BLOCK_N)
        w0, w1 = w0.to(x0.dtype), w1.to(x0.dtype)           # the twin's weight: its fp32 value rounded once
        if DOT_FP32:  # the interpreter multiplies bf16 as raw bits: the same (rounded) values in fp32
            x0, x1, w0, w1 = x0.to(tl.float32), x1.to(tl.float32), w0.to(tl.float32), w1.to(tl.float32)
        acc = tl.dot(x1, w1, tl.dot(x0, w0, acc, input_precision=PRECISION), input_precision=PRECISION)
    tl.store(out_ptr + m64[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# -- choosing and launching ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFConfig:
    """One launch: which kernel and its tile. `default_config` picks one; tests force either kernel."""
    kernel: str          # "gemv" (fp32 in registers, a few rows) | "gemm" (tensor cores)
    block_n: int         # output features per program
    block_u: int         # units (2 * RUN inputs each) per loop iteration
    block_m: int = 1     # rows per program
    num_warps: int = 4
    num_stages: int = 3


# The gemv's tile: inputs per loop iteration at one row, and warps up to 2 rows. A decode step's layers are a few MB
# each, so a gemv is latency-bound: each iteration waits on one round trip to memory, and halving the iterations
# halves those waits. 1,024 inputs on 8 warps hold what 512 on 4 warps held per thread (sm_90 registers at one row:
# 59-121 against 51-126 before), and a 2048-wide layer takes 2 iterations instead of 4; at 3-4 rows 4 warps keep
# 256 inputs (82-94 registers; 8 warps spill there). The former tile (512 inputs, 4 warps) stays nameable:
# `bench gguf` times both, and candidates around them, on a GPU.
GEMV_INPUTS, GEMV_WARPS = 1024, 8


def gemv_config(qtype: str, rows: int, n: int, num_sms: int, inputs: int = GEMV_INPUTS,
                num_warps: int | None = None, block_n: int = 8) -> GGUFConfig:
    """The gemv for up to GEMV_MAX_ROWS rows: `inputs` per iteration for one row, halved per doubling of the rows
    (the products kept per thread grow with both); `block_n` halved down to 2 until every SM has two programs or
    more (a 2048-wide layer would otherwise leave SMs idle)."""
    block_m = next_pow2(rows)
    return GGUFConfig("gemv", block_n=_narrowed(block_n, 2, n, num_sms),
                      block_u=max(1, inputs // (2 * FORMATS[qtype][2] * block_m)), block_m=block_m,
                      num_warps=num_warps or (GEMV_WARPS if block_m <= 2 else 4))


def _narrowed(block_n: int, least: int, n: int, num_sms: int) -> int:
    """block_n halved down to `least` until n features make two programs or more per SM."""
    while block_n > least and triton.cdiv(n, block_n) < 2 * num_sms:
        block_n //= 2
    return block_n


def default_config(qtype: str, rows: int, n: int, dtype: torch.dtype, num_sms: int) -> GGUFConfig:
    """gemv up to GEMV_MAX_ROWS rows (gemv_config). gemm: 16-row tiles for a decode batch (BLOCK_N narrowed
    alike), 64 x 128 with 8 warps for prefill; 64 inputs per iteration (Q6_K: its unit, 128). fp32 inputs take
    16 x 32 tiles at any row count: IEEE dots run on the FMA units, where each thread holds its tile's rows and
    columns whole (larger tiles spill). ptxas for sm_90: the table in docs/kernels.md, no spills."""
    if rows <= GEMV_MAX_ROWS:
        return gemv_config(qtype, rows, n, num_sms)
    block_u = max(1, 32 // FORMATS[qtype][2])
    if dtype == torch.float32:
        return GGUFConfig("gemm", block_n=_narrowed(32, 16, n, num_sms), block_u=block_u, block_m=16)
    if rows <= 16:
        return GGUFConfig("gemm", block_n=_narrowed(64, 16, n, num_sms), block_u=block_u, block_m=16)
    return GGUFConfig("gemm", block_n=128, block_u=block_u, block_m=64, num_warps=8)


def gguf_launch(x: torch.Tensor, raw: torch.Tensor, qtype: str, out: torch.Tensor, config: GGUFConfig | None = None,
                num_sms: int | None = None) -> Launch:
    """The launch computing out = x @ W^T (W: `raw` in `qtype`), described before it runs (kernel_resources
    compiles it for a GPU of `num_sms` SMs; default: x's device)."""
    values, size, run = FORMATS[qtype]
    rows, n = x.shape[0], raw.shape[0]
    c = config or default_config(qtype, rows, n, x.dtype, num_sms or sm_count(x.device))
    args = (x, raw, out, rows, n, x.shape[1] // (2 * run), x.stride(0), raw.stride(0), out.stride(0))
    constexprs = dict(QTYPE=qtype, BLOCK_VALUES=values, TYPE_SIZE=size, RUN=run)
    if c.kernel == "gemv":
        grid = (triton.cdiv(n, c.block_n), triton.cdiv(rows, c.block_m))
        fn = _gguf_gemv
    else:
        grid = (triton.cdiv(rows, c.block_m), triton.cdiv(n, c.block_n))
        fn = _gguf_gemm
        constexprs.update(PRECISION=dot_precision(x.dtype), DOT_FP32=interpreting())
    constexprs.update(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_U=c.block_u)
    return Launch(fn, grid, args, constexprs, num_warps=c.num_warps, num_stages=c.num_stages)


def gguf_matmul_triton(x: torch.Tensor, raw: torch.Tensor, qtype: str, out: torch.Tensor | None = None,
                       config: GGUFConfig | None = None) -> torch.Tensor:
    """x [M, in] (fp16/bf16/fp32) times the weight whose rows are `raw` (uint8 [out, row bytes], GGUF type name
    `qtype`) -> [M, out] in x's dtype, written into `out` when given (a column slice of a wider output is fine:
    its rows may be strided, its columns must be contiguous)."""
    values, size, _ = FORMATS[qtype]
    rows, in_features = x.shape
    assert in_features % values == 0 and raw.shape[1] == in_features // values * size, \
        f"{qtype} rows of {in_features} values are {in_features // values * size} bytes, got {tuple(raw.shape)}"
    assert raw.dtype == torch.uint8 and raw.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((rows, raw.shape[0]), dtype=x.dtype, device=x.device)
    assert out.shape == (rows, raw.shape[0]) and out.stride(1) == 1 and out.dtype == x.dtype
    if rows:
        gguf_launch(x, raw, qtype, out, config)()
    return out
