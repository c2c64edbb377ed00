"""Pure-torch twins of paged attention with a sliding window and/or logit soft-capping (Gemma 2/3).

Window semantics (transformers'): the query at position p sees keys j with p - window < j <= p. Keys
before a sequence's window are never read, not even through its block table: for window layers the pool
releases those blocks, and their table entries may point anywhere.
Soft-capping: scores become softcap * tanh(scores / softcap) before the mask and softmax.
Same layouts as reference.py (a quantized pool's `k_scale` / `v_scale` included); one sequence at a time
(these paths serve the families that need them).
"""

from __future__ import annotations

import torch

from .reference import _bytes, _heads_major, _into, compute_dtype


def _slots(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Slots lo..hi-1 of one sequence, reading only the blocks that hold them -> [hi - lo, Hkv(, D)]."""
    bs = cache.shape[1]
    blocks = table[lo // bs: -(-hi // bs)].long()
    return _bytes(cache)[blocks].view(cache.dtype).flatten(0, 1)[lo - lo // bs * bs: hi - lo // bs * bs]


def _keys(cache: torch.Tensor, scales: torch.Tensor | None, table: torch.Tensor, lo: int, hi: int,
          dtype: torch.dtype) -> torch.Tensor:
    """Keys (or values) lo..hi-1 of one sequence -> [Hkv, hi - lo, D] in `dtype`, dequantized with `scales`."""
    return _heads_major(_slots(cache, table, lo, hi), dtype, None if scales is None else _slots(scales, table, lo, hi))


def _attend(q, k, v, scale, first_pos, lo, window, softcap):
    """q [M, Hq, D] at positions first_pos.. over keys lo.. -> [M, Hq, D] (causal, windowed)."""
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    qg = q.view(rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)      # [Hkv, G, M, D]
    scores = torch.einsum("hgmd,hld->hgml", qg, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(rows, device=q.device)[:, None] + first_pos
    key = torch.arange(k.shape[1], device=q.device)[None, :] + lo
    visible = key <= pos
    if window:
        visible &= key > pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hgml,hld->hgmd", probs, v)
    return out.permute(2, 0, 1, 3).reshape(rows, num_q_heads, head_dim)


def paged_decode_attention_windowed_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None,
                                        softcap=None, out=None, *, k_scale=None, v_scale=None):
    acc = compute_dtype(q.dtype)
    result = torch.zeros_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        lo = max(0, length - window) if window else 0
        k = _keys(k_cache, k_scale, block_tables[i], lo, length, acc)
        v = _keys(v_cache, v_scale, block_tables[i], lo, length, acc)
        result[i] = _attend(q[i:i + 1].to(acc), k, v, scale, length - 1, lo, window, softcap)[0].to(q.dtype)
    return _into(out, result)


def paged_prefill_attention_windowed_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                         window=None, softcap=None, out=None, *, k_scale=None, v_scale=None):
    acc = compute_dtype(q.dtype)
    result = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0 or length == 0:
            continue
        first = length - (q1 - q0)
        lo = max(0, first - window + 1) if window else 0
        k = _keys(k_cache, k_scale, block_tables[i], lo, length, acc)
        v = _keys(v_cache, v_scale, block_tables[i], lo, length, acc)
        result[q0:q1] = _attend(q[q0:q1].to(acc), k, v, scale, first, lo, window, softcap).to(q.dtype)
    return _into(out, result)
