"""Pure-torch twins of the paged kernels.

They are the test oracle (run them in float64) and the CPU execution path of the engine, so they are
vectorized: the block table is turned into one gather, attention is one fused SDPA call (GQA without
repeating K/V), and the KV write is one index_copy per cache. At batch 1 a decode step's cost is the
number of ops, not their size: every op here is there because the result needs it.

Layouts (shared with the Triton kernels):
    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      int32 [B, max_blocks]      (entries past a sequence's length are ignored)
    seq_lens          int32 [B]                  (number of tokens whose K/V are in the cache)
    slot              block_id * block_size + offset

A quantized pool (kv_quant.py) keeps int8 / float8 values in the caches plus k_scale, v_scale [num_blocks,
block_size, num_kv_heads] float16: every function here takes them as `k_scale=` / `v_scale=` and reads
values * scale (writes quantize). Without scales the caches hold the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_quant import dequantize_kv, is_quantized, quantize_kv

# Above this many fp32 score elements per prefill call, queries are processed in chunks, bounding the
# memory of SDPA's math fallback (fp64 oracle, explicit masks) on a long prompt.
_MAX_SCORE_ELEMENTS = 1 << 25


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half precision in fp32; keep fp64 for the oracle."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Gather the first `num_tokens` slots of the blocks in `block_table`: one index op for the whole batch.

    cache [num_blocks, block_size, Hkv, D], block_table [..., max_blocks] -> [..., num_tokens, Hkv, D]
    (a scale tensor [num_blocks, block_size, Hkv] -> [..., num_tokens, Hkv]).
    Table entries that are not needed for `num_tokens` are never read (they may be garbage or -1).
    """
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    table = block_table[..., :num_blocks].long()
    kv = _bytes(cache)[table].view(cache.dtype)  # [..., num_blocks, block_size, Hkv(, D)]
    kv = kv.flatten(table.dim() - 1, table.dim())  # [..., num_blocks * block_size, Hkv(, D)]
    return kv.narrow(table.dim() - 1, 0, num_tokens)


def _heads_major(kv: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[..., L, Hkv, D] -> [..., Hkv, L, D] in `dtype` (a view where no cast is needed). `scale` [..., L, Hkv]:
    the values are quantized, and read as values * scale."""
    if scale is not None:
        kv = dequantize_kv(kv, scale, dtype)
    return kv.to(dtype).transpose(-3, -2)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte (quantized) values are moved as raw bytes: float8 lacks some index kernels (index_copy_ on
    CPU), and a byte copy is the same copy."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None, *, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context: q [B, Hq, D] -> out [B, Hq, D].

    Sequences of similar length share one padded gather and one fused SDPA call (GQA without repeating K/V);
    a batch of mixed lengths takes a few such calls, so short contexts do not pay for the longest one's
    padding (_DecodePlan). A sequence of length 0 gets zeros, never NaN.
    """
    batch, num_q_heads, head_dim = q.shape
    assert num_q_heads % k_cache.shape[2] == 0, "Hq must be a multiple of Hkv"
    plan = _decode_plan(block_tables, seq_lens, k_cache.shape[1], q.device)
    acc = compute_dtype(q.dtype)
    caches = (k_cache, v_cache, k_scale, v_scale)
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _into(out, _attend_group(q, caches, plan.groups[0], scale, acc))
    result = q.new_zeros(q.shape)  # rows of empty sequences stay zero
    for group in plan.groups:
        result.index_copy_(0, group.rows, _attend_group(q.index_select(0, group.rows), caches, group, scale, acc))
    return _into(out, result)


def _attend_group(q: torch.Tensor, caches: tuple, group: "_DecodeGroup", scale: float,
                  acc: torch.dtype) -> torch.Tensor:
    k, v = group.keys_and_values(*caches, acc)  # [n, Hkv, L, D]
    o = F.scaled_dot_product_attention(q.to(acc).unsqueeze(2), k, v, attn_mask=_mask(group.mask, acc), scale=scale,
                                       enable_gqa=True)  # [n, Hq, 1, D]
    return o.view(q.shape).to(q.dtype)


# What one more SDPA call costs, in (sequence, key) slots read: a sequence joins a longer group when the
# padding it brings costs less than a call of its own, or when it is at least 2/3 of the group's length
# (measured on the 2-core CPU: a call is ~60-80 us, a slot ~1 us at Hkv x D = 256).
_CALL_COST_SLOTS = 64


def group_by_length(lens: list[int]) -> list[list[int]]:
    """Indices of the non-empty sequences in groups of similar length, longest first (one padded call each)."""
    groups: list[list[int]] = []
    longest = 0
    for i in sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: -lens[i]):
        if groups and (longest - lens[i] <= _CALL_COST_SLOTS or 3 * lens[i] >= 2 * longest):
            groups[-1].append(i)
        else:
            groups.append([i])
            longest = lens[i]
    return groups


class _DecodeGroup:
    """Sequences attended by one padded SDPA call: their slots, and the mask of the shorter ones' padding."""

    def __init__(self, table: torch.Tensor, lens: list[int], rows: list[int] | None, block_size: int,
                 device: torch.device):
        self.rows = None if rows is None else torch.tensor(rows, device=device)
        self.max_len = max(lens)
        offsets = torch.arange(block_size, device=device)
        slots = (table[:, : -(-self.max_len // block_size)].long()[:, :, None] * block_size + offsets).flatten(1)
        slots = slots[:, :self.max_len]
        self.mask = None
        if min(lens) < self.max_len:
            # Padding reads the sequence's own first slot: written K/V, so finite (the pool is not zero-filled
            # and a masked NaN would still poison the sum), and the mask gives it weight exactly 0.
            visible = torch.arange(self.max_len, device=device) < torch.tensor(lens, device=device)[:, None]
            slots = torch.where(visible, slots, slots[:, :1])
            self.mask = _additive(visible[:, None, None, :])  # SDPA's CPU kernel takes a float mask faster
        self.slots = slots.reshape(-1)
        self.shape = (len(lens), self.max_len)
        # One sequence whose blocks are consecutive (the pool hands out a table's next block when it can) is
        # read in place: the gather copies the whole context twice per layer, which is most of a long
        # context's decode attention on CPU. Same values, same SDPA call: the same result.
        self.first_slot = None
        if len(lens) == 1:
            ids = table[0, : -(-self.max_len // block_size)].tolist()
            if ids == list(range(ids[0], ids[0] + len(ids))):
                self.first_slot = ids[0] * block_size

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """[n, max_len, Hkv, D]: the group's slots of `cache` (of a scale tensor: [n, max_len, Hkv])."""
        flat = _flat_slots(cache)
        if self.first_slot is not None:
            return flat.narrow(0, self.first_slot, self.max_len).view(*self.shape, *cache.shape[2:])
        return _bytes(flat).index_select(0, self.slots).view(cache.dtype).view(*self.shape, *cache.shape[2:])

    def keys_and_values(self, k_cache, v_cache, k_scale, v_scale, dtype: torch.dtype):
        """The group's K and V as [n, Hkv, max_len, D] in `dtype` (dequantized when scales are given)."""
        return tuple(_heads_major(self.gather(cache), dtype, None if scales is None else self.gather(scales))
                     for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)))


class _DecodePlan:
    """What a decode step's tables and lengths imply (groups, slots, masks), computed by its first layer and
    reused by the others: at batch 1 a step costs what its op count costs."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, lens: list[int], block_size: int,
                 device: torch.device):
        self.key = (block_tables, seq_lens, lens, block_size, device)
        table = block_tables.to(device)
        groups = group_by_length(lens)
        if len(groups) == 1 and len(groups[0]) == len(lens):  # every sequence, in one call
            self.groups = [_DecodeGroup(table, lens, None, block_size, device)]
        else:
            self.groups = [_DecodeGroup(table[g], [lens[i] for i in g], g, block_size, device) for g in groups]

    def matches(self, block_tables, seq_lens, lens, block_size, device) -> bool:
        tables, lengths, *rest = self.key
        return tables is block_tables and lengths is seq_lens and rest == [lens, block_size, device]


_last_plan: _DecodePlan | None = None


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask as SDPA's additive float mask (0 where visible, -inf elsewhere)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def _mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive mask in the dtype SDPA computes in (fp64 for the oracle)."""
    return mask if mask is None or mask.dtype == dtype else mask.to(dtype)


def _decode_plan(block_tables, seq_lens, block_size: int, device) -> _DecodePlan:
    """The plan for these metadata tensors: the same objects (and lengths) as the last call reuse it."""
    global _last_plan
    lens = [int(n) for n in seq_lens.tolist()]
    if _last_plan is None or not _last_plan.matches(block_tables, seq_lens, lens, block_size, device):
        _last_plan = _DecodePlan(block_tables, seq_lens, lens, block_size, device)
    return _last_plan


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """Return `result`, copied into the caller's `out` buffer when one is given."""
    if out is None:
        return result
    assert out.shape == result.shape and out.dtype == result.dtype
    return out.copy_(result)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float,
                                out: torch.Tensor | None = None, *, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (new tokens included).

    q [total_q, Hq, D]; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1], which are the LAST
    tokens of its seq_lens[i]-token context; their K/V are already in the cache. Per sequence: one gather
    of exactly its context and one fused causal SDPA call (its flash kernel never builds the scores).
    """
    total_q, num_q_heads, head_dim = q.shape
    assert num_q_heads % k_cache.shape[2] == 0, "Hq must be a multiple of Hkv"
    acc = compute_dtype(q.dtype)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    assert len(starts) == len(lens) + 1, "cu_seqlens_q must have B+1 entries"
    most_rows = max(b - a for a, b in zip(starts, starts[1:]))
    if most_rows <= _SHORT_EXTEND and (len(lens) > 1 or most_rows < lens[0]):
        plan = _extend_plan(block_tables, cu_seqlens_q, seq_lens, starts, lens, k_cache.shape[1], q.device)
        return _into(out, _short_extend(q, (k_cache, v_cache, k_scale, v_scale), plan, scale, acc))
    result = out if out is not None else torch.empty_like(q)
    for i, ctx_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_new = q_end - q_start
        if num_new == 0:
            continue
        assert num_new <= ctx_len, "query tokens are the last tokens of the context"
        table = block_tables[i].to(q.device)
        k, v = (_heads_major(gather_kv(cache, table, ctx_len), acc,
                             None if scales is None else gather_kv(scales, table, ctx_len))  # [Hkv, L, D]
                for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)))
        chunk = num_new if acc == torch.float32 else max(1, _MAX_SCORE_ELEMENTS // (num_q_heads * ctx_len))
        for c0 in range(0, num_new, chunk):
            c1 = min(num_new, c0 + chunk)
            qs = q[q_start + c0:q_start + c1].to(acc).transpose(0, 1)  # [Hq, M, D]
            o = _causal_sdpa(qs, k, v, scale, first_position=ctx_len - num_new + c0)
            result[q_start + c0:q_start + c1] = o.transpose(0, 1).to(q.dtype)
    return result


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 first_position: int) -> torch.Tensor:
    """q [Hq, M, D] at positions first_position.. over k, v [Hkv, L, D]: query j sees keys 0..its position."""
    rows, keys = q.shape[-2], k.shape[-2]
    if first_position == 0 and rows == keys:
        mask, causal = None, True  # SDPA's own causal mask is aligned at the top-left: right only here
    else:
        positions = torch.arange(rows, device=q.device)[:, None] + first_position
        mask, causal = torch.arange(keys, device=q.device)[None, :] <= positions, False
    # a batch dimension of 1: unbatched (3-D) GQA inputs with a mask fall back to SDPA's slow math path on CPU
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=True)[0]


# Batches whose sequences all add at most this many query rows (decode + speculative drafts, short chunks)
# run as ONE padded gather + SDPA for the whole batch instead of one per sequence; so does one sequence
# extending a cached context by a few rows (a verify step at batch 1), which then pays for its mask and
# gather once per step instead of once per layer. A prefill from scratch keeps SDPA's own causal path.
_SHORT_EXTEND = 64


class _ExtendPlan:
    """A padded layout of a short-query batch, computed by a step's first layer and reused by the others:
    queries [B, M] with M the longest row count, keys [B, L] with L the longest context."""

    def __init__(self, block_tables, cu_seqlens_q, seq_lens, starts: list[int], lens: list[int], block_size: int,
                 device: torch.device):
        self.key = (block_tables, cu_seqlens_q, seq_lens, starts, lens, block_size, device)
        news = [b - a for a, b in zip(starts, starts[1:])]
        self.rows, self.max_len = max(news), max(lens)
        # keys gathered as a decode step gathers them (padding reads each sequence's own first slot: finite,
        # and masked below; one sequence whose blocks are consecutive is read in place)
        self.keys = _DecodeGroup(block_tables.to(device), lens, None, block_size, device)
        # flat query row r of sequence b sits at padded row (b, i): one index for the scatter and the gather;
        # none when every sequence has the same row count (the flat rows already are the padded layout)
        self.flat = None if min(news) == self.rows else \
            torch.tensor([b * self.rows + i for b, n in enumerate(news) for i in range(n)], device=device)
        if min(news) == self.rows and min(lens) == self.max_len:
            # the same causal mask for every sequence (a verify step where all draft alike; batch 1)
            causal = torch.ones(self.rows, self.max_len, dtype=torch.bool, device=device)
            self.mask = _additive(causal.tril_(self.max_len - self.rows))  # [M, L]
            return
        length = torch.tensor(lens, device=device)
        first = length - torch.tensor(news, device=device)  # position of each sequence's first query row
        keys = torch.arange(self.max_len, device=device)
        visible = keys[None, None, :] <= first[:, None, None] + torch.arange(self.rows, device=device)[None, :, None]
        visible &= keys[None, None, :] < length[:, None, None]
        visible[:, :, 0] = True  # padding query rows see key 0 (their output is dropped): never an empty row
        self.mask = _additive(visible[:, None])                        # [B, 1, M, L]

    def matches(self, *key) -> bool:
        return all(a is b for a, b in zip(self.key[:3], key[:3])) and list(self.key[3:]) == list(key[3:])


_last_extend: _ExtendPlan | None = None


def _extend_plan(block_tables, cu_seqlens_q, seq_lens, starts, lens, block_size, device) -> _ExtendPlan:
    global _last_extend
    key = (block_tables, cu_seqlens_q, seq_lens, starts, lens, block_size, device)
    if _last_extend is None or not _last_extend.matches(*key):
        _last_extend = _ExtendPlan(*key)
    return _last_extend


def _short_extend(q, caches: tuple, plan: _ExtendPlan, scale: float, acc: torch.dtype) -> torch.Tensor:
    """Every sequence's query rows padded to [B, Hq, M, D] against its gathered context (padding slots read
    the sequence's own first slot and are masked). caches: (k_cache, v_cache, k_scale, v_scale)."""
    batch, (total_q, num_q_heads, head_dim) = plan.keys.shape[0], q.shape
    k, v = plan.keys.keys_and_values(*caches, acc)
    if plan.flat is None:
        padded = q.to(acc)
    else:
        padded = q.new_zeros((batch * plan.rows, num_q_heads, head_dim), dtype=acc)
        padded[plan.flat] = q.to(acc)
    padded = padded.view(batch, plan.rows, num_q_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(padded, k, v, attn_mask=_mask(plan.mask, acc), scale=scale,
                                       enable_gqa=True)  # [B, Hq, M, D]
    o = o.transpose(1, 2).reshape(batch * plan.rows, num_q_heads, head_dim)
    return (o if plan.flat is None else o[plan.flat]).to(q.dtype)


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv(, D)] -> [num_slots, Hkv(, D)] view (writes must reach the cache)."""
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Scatter k, v [N, Hkv, D] into slot_mapping[N]; a negative slot means "skip" (padding). With scales,
    each (token, head) is quantized to the caches' dtype and its scale written beside it."""
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    assert (k_scale is not None) == (v_scale is not None) == is_quantized(k_cache), \
        "a quantized cache needs its scales (and a float one has none)"
    slots = slot_mapping.to(k_cache.device).long()
    if slots.numel() and int(slots.min()) < 0:  # padding rows (CUDA-graph batches): drop them first
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scales is None:
            _flat_slots(cache).index_copy_(0, slots, x.to(cache.dtype))
        else:
            values, x_scale = quantize_kv(x, cache.dtype)
            _bytes(_flat_slots(cache)).index_copy_(0, slots, _bytes(values))
            _flat_slots(scales).index_copy_(0, slots, x_scale)


def copy_blocks_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, src, dst, *, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Copy whole blocks src[i] -> dst[i] of one layer's caches (copy-on-write), and their scales with them.

    src and dst are int lists or integer tensors; a dst must not also be a src (fresh COW blocks).
    """
    src = torch.as_tensor(src, dtype=torch.long, device=k_cache.device)
    dst = torch.as_tensor(dst, dtype=torch.long, device=k_cache.device)
    assert src.shape == dst.shape
    if src.numel() == 0:
        return
    for cache in (k_cache, v_cache, k_scale, v_scale):
        if cache is not None:
            raw = _bytes(cache)
            raw[dst] = raw[src]
