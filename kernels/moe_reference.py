"""Mixture-of-experts feed-forward in pure torch: the CPU path and the oracle of the Triton kernel.

Each token picked `top_k` experts. Instead of a Python loop over tokens, the (token, expert) pairs are
sorted by expert and each expert runs ONE matmul over all its tokens (a grouped matmul): at most
`num_experts` matmul pairs per layer, whatever the batch. Experts are visited in increasing index and
their outputs added into the result in that order, as transformers does (so fp32 results match bit for bit).

Layouts: x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k] (fp32);
topk_ids [T, k] int.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 1:
        return _one_token(x, w13, w2, topk_weights, topk_ids)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)            # pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        h = silu_and_mul(F.linear(x[rows], w13[expert]))
        y = F.linear(h, w2[expert]) * weights[start:start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


def _one_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
    """Batch-1 decode: the same sums in the same order (experts by increasing index) without the sort,
    gather and scatter, whose fixed cost is a large share of a one-token step on CPU."""
    ids = topk_ids[0].tolist()
    out = torch.zeros_like(x)
    for j in sorted(range(len(ids)), key=ids.__getitem__):
        y = F.linear(silu_and_mul(F.linear(x, w13[ids[j]])), w2[ids[j]]) * topk_weights[0, j]
        out.add_(y.to(out.dtype))
    return out
