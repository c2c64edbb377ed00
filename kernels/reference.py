"""Pure-torch twins of the paged kernels.

They are the test oracle (run them in float64) and the CPU execution path of the engine, so they are
vectorized: the block table is turned into one gather, attention is one batched matmul pair with a
length mask, and GQA is expressed by grouping query heads instead of repeating K/V.

Layouts (shared with the Triton kernels):
    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      int32 [B, max_blocks]      (entries past a sequence's length are ignored)
    seq_lens          int32 [B]                  (number of tokens whose K/V are in the cache)
    slot              block_id * block_size + offset
"""

from __future__ import annotations

import torch

# Upper bound on the fp32 score tensor built by one prefill matmul (elements); bigger prefills are
# processed in query chunks so a long prompt on CPU does not allocate gigabytes of scores.
_MAX_SCORE_ELEMENTS = 1 << 25
# Up to this batch, decode loops over sequences at their exact lengths; above it, one padded batched call
# amortizes the per-sequence Python overhead.
_PER_SEQUENCE_MAX_BATCH = 64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half precision in fp32; keep fp64 for the oracle."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Gather the first `num_tokens` slots of the blocks in `block_table`.

    cache [num_blocks, block_size, Hkv, D], block_table [..., max_blocks] -> [..., num_tokens, Hkv, D].
    Table entries that are not needed for `num_tokens` are never read (they may be garbage or -1).
    """
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    table = block_table[..., :num_blocks].long().clamp_min(0)  # padding ids (-1) point at block 0
    kv = cache[table]  # [..., num_blocks, block_size, Hkv, D]
    kv = kv.flatten(-4, -3)  # [..., num_blocks * block_size, Hkv, D]
    return kv[..., :num_tokens, :, :]


def _heads_major(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., L, Hkv, D] -> contiguous [..., Hkv, L, D] in `dtype`, one copy (strided matmuls are slow)."""
    return kv.transpose(-3, -2).to(dtype, memory_format=torch.contiguous_format)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     num_visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention where query row m sees keys [0, num_visible[..., m]).

    q [..., Hkv, G, M, D], k and v [..., Hkv, L, D], num_visible [..., M] (broadcast over heads).
    Rows that see no key return zeros (never NaN). Computes in q's dtype (caller upcasts).
    """
    *lead, num_kv_heads, group, rows, head_dim = q.shape
    # Fold the query heads of a group into the row axis: one plain batched matmul per KV head, K/V
    # are read in place instead of being repeated G times.
    q_rows = q.reshape(*lead, num_kv_heads, group * rows, head_dim)
    scores = torch.matmul(q_rows, k.transpose(-1, -2)) * scale  # [..., Hkv, G*M, L]
    scores = scores.view(*lead, num_kv_heads, group, rows, k.shape[-2])
    key_pos = torch.arange(k.shape[-2], device=q.device)
    visible = key_pos < num_visible[..., None]  # [..., M, L]
    visible = visible[..., None, None, :, :]  # broadcast over Hkv, G
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)  # exp(-inf) = 0 for masked keys
    denom = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs.view(*lead, num_kv_heads, group * rows, -1), v)
    out = out.view(*lead, num_kv_heads, group, rows, head_dim)
    return out / torch.where(denom > 0, denom, torch.ones_like(denom))


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context: q [B, Hq, D] -> out [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    group = num_q_heads // num_kv_heads
    lens = seq_lens.to(q.device).long()
    max_len = int(lens.max()) if batch > 0 else 0
    if max_len == 0:
        return _into(out, torch.zeros_like(q))
    acc = compute_dtype(q.dtype)
    if batch <= _PER_SEQUENCE_MAX_BATCH:
        return _into(out, _decode_per_sequence(q, k_cache, v_cache, block_tables, lens.tolist(), scale, acc))
    # Pad every sequence to the longest one and mask: one batched call instead of a loop. Table
    # entries past a sequence's own blocks may be garbage: point them at block 0.
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].to(q.device).long()
    owned = torch.arange(num_blocks, device=q.device) < (lens[:, None] + block_size - 1) // block_size
    table = torch.where(owned, table, torch.zeros_like(table))
    k = _heads_major(gather_kv(k_cache, table, max_len), acc)  # [B, Hkv, L, D]
    v = _heads_major(gather_kv(v_cache, table, max_len), acc)
    # Slots past a sequence's length hold anything (NaN included); a zero weight times NaN is NaN.
    past_end = torch.arange(max_len, device=q.device) >= lens[:, None]  # [B, L]
    v = v.masked_fill(past_end[:, None, :, None], 0)
    qg = q.to(acc).view(batch, num_kv_heads, group, 1, head_dim)  # query heads grouped by KV head
    o = masked_attention(qg, k, v, scale, lens.view(batch, 1))  # [B, Hkv, G, 1, D]
    return _into(out, o.reshape(batch, num_q_heads, head_dim).to(q.dtype))


def _decode_per_sequence(q, k_cache, v_cache, block_tables, lens: list[int], scale: float,
                         acc: torch.dtype) -> torch.Tensor:
    """Each sequence over exactly its own slots: no padding, no masks, nothing past its end is read.
    For the batch sizes a CPU serves this is several times faster than the padded batched call."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    result = torch.zeros(batch, num_kv_heads, group, head_dim, dtype=acc, device=q.device)
    qg = q.to(acc).view(batch, num_kv_heads, group, head_dim)
    tables = block_tables.to(device=q.device, dtype=torch.long)
    block_size = k_cache.shape[1]
    for i, length in enumerate(lens):
        if length == 0:
            continue
        owned = tables[i, : -(-length // block_size)]  # a sequence's own entries are valid block ids
        k = k_cache[owned].flatten(0, 1)[:length].to(acc)  # [L, Hkv, D]
        v = v_cache[owned].flatten(0, 1)[:length].to(acc)
        probs = (torch.einsum("hgd,lhd->hgl", qg[i], k) * scale).softmax(dim=-1)
        result[i] = torch.einsum("hgl,lhd->hgd", probs, v)
    return result.view(batch, num_q_heads, head_dim).to(q.dtype)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """Return `result`, copied into the caller's `out` buffer when one is given."""
    if out is None:
        return result
    assert out.shape == result.shape and out.dtype == result.dtype
    return out.copy_(result)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (new tokens included).

    q [total_q, Hq, D]; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1], which are the LAST
    tokens of its seq_lens[i]-token context; their K/V are already in the cache.
    """
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    group = num_q_heads // num_kv_heads
    acc = compute_dtype(q.dtype)
    result = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    assert len(starts) == len(lens) + 1, "cu_seqlens_q must have B+1 entries"
    for i, ctx_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_new = q_end - q_start
        if num_new == 0 or ctx_len == 0:
            continue
        assert num_new <= ctx_len, "query tokens are the last tokens of the context"
        k = _heads_major(gather_kv(k_cache, block_tables[i], ctx_len), acc)  # [Hkv, L, D]
        v = _heads_major(gather_kv(v_cache, block_tables[i], ctx_len), acc)
        # Query j of this chunk sits at position ctx_len - num_new + j and sees keys 0..that position.
        chunk = max(1, _MAX_SCORE_ELEMENTS // (num_q_heads * ctx_len))
        for c0 in range(0, num_new, chunk):
            c1 = min(num_new, c0 + chunk)
            qs = q[q_start + c0:q_start + c1].to(acc)  # [M, Hq, D]
            qg = qs.view(c1 - c0, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, M, D]
            num_visible = torch.arange(c0, c1, device=q.device) + (ctx_len - num_new + 1)
            o = masked_attention(qg, k, v, scale, num_visible)  # [Hkv, G, M, D]
            result[q_start + c0:q_start + c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, num_q_heads,
                                                                          head_dim).to(q.dtype)
    return _into(out, result)


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> [num_slots, Hkv, D] view (writes must reach the cache)."""
    return cache.view(cache.shape[0] * cache.shape[1], cache.shape[2], cache.shape[3])


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [N, Hkv, D] into slot_mapping[N]; a negative slot means "skip" (padding)."""
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    slots = slot_mapping.to(k_cache.device).long()
    keep = slots >= 0
    slots = slots[keep]
    _flat_slots(k_cache)[slots] = k[keep].to(k_cache.dtype)
    _flat_slots(v_cache)[slots] = v[keep].to(v_cache.dtype)


def copy_blocks_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, src, dst) -> None:
    """Copy whole blocks src[i] -> dst[i] of one layer's caches (copy-on-write).

    src and dst are int lists or integer tensors; a dst must not also be a src (fresh COW blocks).
    """
    src = torch.as_tensor(src, dtype=torch.long, device=k_cache.device)
    dst = torch.as_tensor(dst, dtype=torch.long, device=k_cache.device)
    assert src.shape == dst.shape
    if src.numel() == 0:
        return
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]
