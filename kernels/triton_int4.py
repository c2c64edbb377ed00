"""Triton int4 weight matmul (`--quantize int4` on CUDA): x [M, in] @ W^T with W in model/int4.py's layout,
dequantized in registers, never in memory.

Two kernels, picked by the number of rows:
  * gemv (one row: batch-1 decode). Memory-bound: every packed byte and scale is read once (4.5 bits per
    weight against bf16's 16). A program owns BLOCK_N output features and walks the input in runs of
    BLOCK_G groups; the 16 bytes of a group give its 16 low-nibble weights (the group's first 16 inputs) and
    16 high-nibble ones (the last 16), each multiplied by its input in fp32, summed per group, and only the
    group's sum is scaled: one multiply per weight, not two.
  * gemm (more rows: batched decode, prefill). A tile of weights is dequantized to x's dtype (the value
    d * q computed in fp32, rounded once: what the torch twin's weight holds) and fed to tensor-core dots
    with fp32 accumulation. The low and high nibbles of a byte tile are two dots over the matching input
    columns, so no nibble is ever interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import dot_precision, interpreting, kernel, sm_count, varies_per_step

GROUP = 32
HALF = tl.constexpr(GROUP // 2)  # bytes per group (a constexpr: compiled kernels read no other globals)
_GROUP = tl.constexpr(GROUP)
# Rows from which the tensor-core kernel takes over from the one-row kernel (one program per row re-reads the
# weights once per row; the gemm tile reads them once per BLOCK_M rows).
GEMV_MAX_ROWS = 1
# tl.sum / tl.zeros are jit functions frozen in compiled or interpreted form at triton's import; reducing with
# the combine function and tl.full keeps the kernels runnable whatever TRITON_INTERPRET was then (as
# triton_attention.py does).
_sum_combine = tl.standard._sum_combine


def _int4_gemv(x_ptr, packed_ptr, scales_ptr, out_ptr, N, G, stride_xm, stride_pn, stride_sn, stride_om,
               BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_j = tl.arange(0, HALF)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    acc = tl.full((BLOCK_N, BLOCK_G), 0.0, tl.float32)
    for g0 in range(0, G, BLOCK_G):
        groups = g0 + offs_g
        g_ok = groups < G
        cols = groups[:, None] * _GROUP + offs_j[None, :]  # [BLOCK_G, 16]: the low-nibble inputs
        x_low = tl.load(x_ptr + row * stride_xm + cols, mask=g_ok[:, None], other=0.0).to(tl.float32)
        x_high = tl.load(x_ptr + row * stride_xm + cols + HALF, mask=g_ok[:, None], other=0.0).to(tl.float32)
        byte_at = n64[:, None, None] * stride_pn + groups[None, :, None] * HALF + offs_j[None, None, :]
        b = tl.load(packed_ptr + byte_at, mask=n_ok[:, None, None] & g_ok[None, :, None], other=0x88)
        low = (b & 0x0F).to(tl.float32) - 8.0
        high = (b >> 4).to(tl.float32) - 8.0
        # [BLOCK_N, BLOCK_G]: each group's unscaled sum
        sums = tl.reduce(low * x_low[None, :, :] + high * x_high[None, :, :], 2, _sum_combine)
        d = tl.load(scales_ptr + n64[:, None] * stride_sn + groups[None, :],
                    mask=n_ok[:, None] & g_ok[None, :], other=0.0)
        acc += sums * d.to(tl.float32)
    out = tl.reduce(acc, 1, _sum_combine)
    tl.store(out_ptr + row * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@varies_per_step("M")
def _int4_gemm(x_ptr, packed_ptr, scales_ptr, out_ptr, M, N, G, stride_xm, stride_pn, stride_sn, stride_om,
               PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_G * HALF)  # byte index in a run of BLOCK_G groups
    offs_g = tl.arange(0, BLOCK_G)
    m_ok, n_ok = offs_m < M, offs_n < N
    m64, n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for g0 in range(0, G, BLOCK_G):
        group = g0 + offs_b // HALF
        b_ok = group < G
        cols = group * _GROUP + offs_b % HALF  # the low-nibble input of each byte
        x_at = x_ptr + m64[:, None] * stride_xm + cols[None, :]
        x_mask = m_ok[:, None] & b_ok[None, :]
        x_low = tl.load(x_at, mask=x_mask, other=0.0)
        x_high = tl.load(x_at + HALF, mask=x_mask, other=0.0)
        b = tl.load(packed_ptr + n64[None, :] * stride_pn + (offs_b + g0 * HALF)[:, None],
                    mask=b_ok[:, None] & n_ok[None, :], other=0x88)  # [BLOCK_G * 16, BLOCK_N]
        groups = g0 + offs_g
        d = tl.load(scales_ptr + n64[None, :] * stride_sn + groups[:, None],
                    mask=(groups < G)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        # each group's scale over its 16 bytes (loaded once, not once per byte: 20% fewer registers)
        d = tl.reshape(tl.broadcast_to(d[:, None, :], (BLOCK_G, HALF, BLOCK_N)), (BLOCK_G * HALF, BLOCK_N))
        w_low = (((b & 0x0F).to(tl.float32) - 8.0) * d).to(x_low.dtype)
        w_high = (((b >> 4).to(tl.float32) - 8.0) * d).to(x_low.dtype)
        if DOT_FP32:  # the interpreter multiplies bf16 as raw bits: the same (rounded) values in fp32
            x_low, x_high = x_low.to(tl.float32), x_high.to(tl.float32)
            w_low, w_high = w_low.to(tl.float32), w_high.to(tl.float32)
        acc = tl.dot(x_low, w_low, acc, input_precision=PRECISION)
        acc = tl.dot(x_high, w_high, acc, input_precision=PRECISION)
    out = out_ptr + m64[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Int4Config:
    """One launch: which kernel and its tile. `default_config` picks one; scripts/bench_int4.py sweeps them."""
    kernel: str          # "gemv" (one program per row and BLOCK_N features) | "gemm" (tensor cores)
    block_n: int         # output features per program
    block_g: int         # groups of 32 inputs per loop iteration
    block_m: int = 1     # rows per program (gemm)
    num_warps: int = 4
    num_stages: int = 3


def default_config(rows: int, n: int, groups: int, device: torch.device) -> Int4Config:
    """Memory-bound shapes (gemv; gemm up to 16 rows) halve the features per program until every SM has two
    programs or more (a 2048-wide layer would otherwise leave SMs idle). gemv reads 1024 inputs per
    iteration: 2-4 KiB of packed weights per program, one 16-byte load per thread at 4 rows. gemm: 16-row
    tiles for a decode batch, 64 x 128 tiles with 8 warps for prefill. ptxas for sm_90 (bf16): gemv 56-96
    registers, gemm 126 and 210, no spills."""
    def narrowed(block_n: int, least: int) -> int:
        while block_n > least and triton.cdiv(n, block_n) < 2 * sm_count(device):
            block_n //= 2
        return block_n

    if rows <= GEMV_MAX_ROWS:
        return Int4Config("gemv", block_n=narrowed(8, 2), block_g=min(32, triton.next_power_of_2(groups)))
    if rows <= 16:
        return Int4Config("gemm", block_m=16, block_n=narrowed(64, 16), block_g=2)
    return Int4Config("gemm", block_m=64, block_n=128, block_g=2, num_warps=8)


def int4_matmul_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       config: Int4Config | None = None) -> torch.Tensor:
    """x [M, in] (fp16/bf16/fp32) -> [M, out] in x's dtype."""
    rows, in_features = x.shape
    n, half = packed.shape
    groups = in_features // GROUP
    assert in_features % GROUP == 0 and half * 2 == in_features, "packed must be [out, in / 2], in % 32 == 0"
    assert scales.shape == (n, groups) and scales.dtype == torch.float16, "scales must be float16 [out, in / 32]"
    assert packed.dtype == torch.uint8 and packed.stride(1) == 1 and scales.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    c = config or default_config(rows, n, groups, x.device)
    args = (x, packed, scales, out)
    strides = (x.stride(0), packed.stride(0), scales.stride(0), out.stride(0))
    if c.kernel == "gemv":
        kernel(_int4_gemv)[(triton.cdiv(n, c.block_n), rows)](
            *args, n, groups, *strides, BLOCK_N=c.block_n, BLOCK_G=c.block_g, num_warps=c.num_warps,
            num_stages=c.num_stages)
    else:
        kernel(_int4_gemm)[(triton.cdiv(rows, c.block_m), triton.cdiv(n, c.block_n))](
            *args, rows, n, groups, *strides, PRECISION=dot_precision(x.dtype), DOT_FP32=interpreting(),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_G=c.block_g, num_warps=c.num_warps,
            num_stages=c.num_stages)
    return out
