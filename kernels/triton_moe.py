"""Triton fused mixture-of-experts: two grouped matmuls over (token, expert) pairs sorted by expert.

The pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so every
BLOCK_M-row tile belongs to one expert: a program loads that expert's weight tile once and multiplies it
with the gathered rows of its tokens. Padding rows hold the sentinel `num_pairs` and are neither read nor
written. The sort happens on the device with no host sync (the padded length is an upper bound), so the
path can be captured in a CUDA graph.

  gemm 1: h[pair]  = x[pair // k] @ w13[e]^T          -> silu(gate) * up (torch, elementwise)
  gemm 2: y[pair]  = h[pair] @ w2[e]^T * weight[pair] -> out[t] = sum over the k pairs of token t
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import dot_precision, kernel, varies_per_step

_BLOCK_M = 16


@varies_per_step("num_pairs")
def _moe_gemm(a_ptr, b_ptr, c_ptr, w_ptr, pairs_ptr, block_expert_ptr, num_pairs, N, K,
              stride_am, stride_be, stride_bn, stride_cm,
              A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < num_pairs
    rows = (pairs // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int = _BLOCK_M):
    """Pair ids sorted by expert, each expert's run padded to block_m with the sentinel; the expert of
    every block_m tile. Lengths are upper bounds (no device->host sync)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    # Not torch.bincount: on CUDA it reads the ids' min and max back to the host, which a CUDA graph
    # cannot capture. Integer adds commute, so the counts are exact whatever order the atomics run in.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - start[sorted_experts]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    pairs[(padded_end - padded)[sorted_experts] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_max(num_experts - 1)
    return pairs, block_expert.to(torch.int32)


def _grouped_gemm(a, weight, pairs, block_expert, num_pairs, a_div, topk_weights=None):
    num_experts, n, k = weight.shape
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    interp = a.device.type == "cpu"
    grid = (pairs.numel() // _BLOCK_M, triton.cdiv(n, block_n))
    kernel(_moe_gemm)[grid](
        a, weight, c, topk_weights if topk_weights is not None else c, pairs, block_expert, num_pairs, n, k,
        a.stride(0), weight.stride(0), weight.stride(1), c.stride(0),
        A_DIV=a_div, MUL_WEIGHT=topk_weights is not None, PRECISION=dot_precision(a.dtype),
        DOT_FP32=interp, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """See pagedchat.kernels.fused_moe for the contract."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs, block_expert = align_pairs(topk_ids, w13.shape[0])
    h = _grouped_gemm(x, w13, pairs, block_expert, num_pairs, a_div=top_k)
    gate, up = h.chunk(2, dim=-1)
    h = (torch.nn.functional.silu(gate) * up).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    y = _grouped_gemm(h, w2, pairs, block_expert, num_pairs, a_div=1, topk_weights=weights)
    return y.view(num_tokens, top_k, -1).sum(dim=1)
