"""Triton paged attention, second generation (v2): page-tiled split-KV decode and FlashAttention-2-style prefill.

Both kernels read K/V from the block pool [num_blocks, block_size, Hkv, D] in tiles of whole pages (or of
part of one page when pages are larger than a tile): a tile costs one block-table read per page, then
contiguous rows of head_dim elements. The query heads of a GQA group are stacked as rows of one tl.dot, so
a KV tile is read once per KV head, and the loop over tiles is software-pipelined (num_stages).

Decode (one query token per sequence) is memory-bound: the whole job is to keep enough loads in flight on
every SM. The grid is (KV head programs, work items) and sized from static bounds only (no device->host
read, so a CUDA graph captures it); every program computes the same split plan from the lengths on device:
    tiles_i  = the KV tiles sequence i reads (its window only, when there is one)
    chunk    = max(min_tiles, ceil(sum_i tiles_i x head programs / target programs))
    splits_i = ceil(tiles_i / chunk)     (at least 1, at most max_splits)
so a batch of one long sequence spreads over the whole GPU, a large batch is not split at all, and a mixed
batch splits only its long sequences. Work item w belongs to the sequence whose prefix of splits covers it;
the grid has batch + ceil(target / head programs) work items, which bounds sum_i splits_i, and spare items
exit at once. A sequence with one split writes its output directly; the others write a normalized partial
and its log-sum-exp, merged by a second small kernel (which exits at once for unsplit sequences).

Prefill / extend (causal, chunked over a cached prefix) is compute-bound: 128-row query tiles (tokens x GQA
heads), KV tiles walked in three phases so that only the tiles that need a mask pay for it (the window's
lead-in, the full tiles every row sees, the causal diagonal), and a flat grid over every sequence's query
tiles (a batch of short extends over long contexts is as dense as one long prompt), heaviest tiles first.
Its grid, too, comes from static sizes (total query rows + batch), so prefill never reads the device.

Numerics as in v1: base-2 scores (scale x log2 e folded in), fp32 softmax state, a finite -1e30 initial
running max so no inf - inf, zero output for a row that sees no key, int64 addresses from block ids.
Every `//` and `%` has non-negative operands (the interpreter floors, compiled code truncates). The final
normalizations divide with IEEE rounding (div_rn: Triton's `/` is an approximate division on the GPU, exact in
the interpreter); exp2 / log2 stay the hardware's approximations, whose error is far below fp32 softmax's.

Quantized pools (kv_quant.py: int8 / float8 e4m3 values, a float16 scale per slot and KV head) are read in
the same tiles, with each tile's scales: the values are exact in the queries' dtype, so the dots run on it and
the scales multiply the scores (keys) and the softmax weights (values) in fp32, which is values x scale as
kv_quant.dequantize_kv defines it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._launch import (LOG2E, Launch, check_cache_pair, device_function, dot_precision, interpreting, next_pow2,
                      sm_count, varies_per_step)
from ._launch import LOG2E_C as _LOG2E
from ._launch import MAX_COMBINE as _max_combine
from ._launch import NEG_BIG as _NEG_BIG
from ._launch import SUM_COMBINE as _sum_combine
from .kv_quant import SCALE_DTYPE, is_quantized
from .triton_attention_configs import (DecodeConfig, PrefillConfig, decode_config, decode_size_class, prefill_config,
                                       prefill_size_class)

# Host code computes ceil-divisions as -(-a // b): triton.cdiv is a jitted function, slow to call from Python.
# Batches up to this size are planned on device (a vector of their lengths per program); larger batches have
# work enough for every SM without splitting and run one program per (sequence, KV head program).
_PLAN_MAX_BATCH = 1024
_MAX_SPLITS = 128     # a split of a split of ... : beyond this the merge costs more than it spreads
_MERGE_SPLITS = 32    # splits merged per vector step


# ---------------------------------------------------------------------------------------------------
# Device helpers shared by both kernels
# ---------------------------------------------------------------------------------------------------

@device_function
def _tile_slots(table_row, tok0, kv_lo, kv_hi, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                PAGED_TILES: tl.constexpr):
    """(block, slot) [TILE] int64 of the tokens tok0 .. tok0+TILE-1 of a sequence (tok0 % TILE == 0).

    Pages wholly outside [kv_lo, kv_hi) are not looked up (a window's released pages may hold any id)."""
    if PAGED_TILES:
        if BLOCK_SIZE >= TILE:  # part of one page: one table read, contiguous slots
            block = tl.load(table_row + tok0 // BLOCK_SIZE).to(tl.int64) + tl.full([TILE], 0, tl.int64)
            slot = (tok0 % BLOCK_SIZE + tl.arange(0, TILE)).to(tl.int64)
        else:  # whole pages: one table read per page, broadcast over its slots
            page = tok0 // BLOCK_SIZE + tl.arange(0, TILE // BLOCK_SIZE)
            live = (page * BLOCK_SIZE < kv_hi) & ((page + 1) * BLOCK_SIZE > kv_lo)
            pages = tl.load(table_row + page, mask=live, other=0).to(tl.int64)
            block = tl.reshape(tl.broadcast_to(pages[:, None], [TILE // BLOCK_SIZE, BLOCK_SIZE]), [TILE])
            slot = tl.reshape(tl.broadcast_to(tl.arange(0, BLOCK_SIZE)[None, :], [TILE // BLOCK_SIZE, BLOCK_SIZE]),
                              [TILE]).to(tl.int64)
    else:  # a page size that is not a power of two: the table is read per token
        n = tok0 + tl.arange(0, TILE)
        block = tl.load(table_row + n // BLOCK_SIZE, mask=(n >= kv_lo) & (n < kv_hi), other=0).to(tl.int64)
        slot = (n % BLOCK_SIZE).to(tl.int64)
    return block, slot


@device_function
def _kv_tile(k_head, v_head, ks_head, vs_head, table_row, tok0, kv_lo, kv_hi, d, d_ok,
             BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PAGED_TILES: tl.constexpr,
             STRIDE_CB: tl.constexpr, STRIDE_CT: tl.constexpr, STRIDE_SB: tl.constexpr, STRIDE_ST: tl.constexpr,
             MASKED: tl.constexpr, QUANT: tl.constexpr):
    """K and V [TILE, BLOCK_D] of keys tok0.. of one KV head (keys outside [kv_lo, kv_hi) are 0 when MASKED),
    and a quantized pool's scales of those keys [TILE] in fp32 (1.0 for a float pool: unused)."""
    block, slot = _tile_slots(table_row, tok0, kv_lo, kv_hi, BLOCK_SIZE, TILE, PAGED_TILES)
    rows = block * STRIDE_CB + slot * STRIDE_CT
    n = tok0 + tl.arange(0, TILE)
    n_ok = (n >= kv_lo) & (n < kv_hi)
    if MASKED:
        mask = n_ok[:, None] & d_ok[None, :]
    else:
        mask = d_ok[None, :]
    k = tl.load(k_head + rows[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_head + rows[:, None] + d[None, :], mask=mask, other=0.0)
    if QUANT:
        scale_rows = block * STRIDE_SB + slot * STRIDE_ST
        if MASKED:
            ks = tl.load(ks_head + scale_rows, mask=n_ok, other=0.0).to(tl.float32)
            vs = tl.load(vs_head + scale_rows, mask=n_ok, other=0.0).to(tl.float32)
        else:
            ks = tl.load(ks_head + scale_rows).to(tl.float32)
            vs = tl.load(vs_head + scale_rows).to(tl.float32)
    else:
        ks = tl.full([TILE], 1.0, tl.float32)
        vs = ks
    return k, v, ks, vs


@device_function
def _softmax_step(acc, m_i, l_i, q, k, v, ks, vs, visible, scale_log2, softcap,
                  SOFTCAP: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr):
    """One KV tile of online softmax: acc, m_i, l_i updated with keys k, values v (visible: bool mask).

    A quantized pool's tile holds values and per-key scales: q . (k x ks) = (q . k) x ks and
    p . (v x vs) = (p x vs) . v, with the int8 / e4m3 values exact in q's dtype, so the dots run on q's dtype
    and the scales are applied in fp32 (the values x scale of kv_quant.dequantize_kv)."""
    if QUANT:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if DOT_FP32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if QUANT:
        s = s * (ks * scale_log2)[None, :]
    else:
        s = s * scale_log2
    if SOFTCAP:  # c * tanh(x / c) on the base-2 score s = x log2(e): tanh(y) = 1 - 2 / (e^2y + 1)
        s = (1.0 - 2.0 / (tl.exp2(2.0 * s / softcap) + 1.0)) * (softcap * _LOG2E)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
    if QUANT:
        p = p * vs[None, :]
    p = p.to(v.dtype)  # flash-attention convention: P in the input dtype for the second dot
    if DOT_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@device_function
def _split_plan(lens_ptr, batch, window, target_programs, max_splits,
                PLAN_BATCH: tl.constexpr, TILE: tl.constexpr, MIN_TILES: tl.constexpr,
                HEAD_PROGRAMS: tl.constexpr, WINDOWED: tl.constexpr):
    """Per sequence (vectors of PLAN_BATCH): first KV tile, tile count, split count, end of its work items."""
    b = tl.arange(0, PLAN_BATCH)
    lens = tl.load(lens_ptr + b, mask=b < batch, other=0)
    if WINDOWED:
        first = tl.maximum(lens - window, 0) // TILE
    else:
        first = lens * 0
    tiles = (lens + TILE - 1) // TILE - first
    work = tl.reduce(tiles, 0, _sum_combine) * HEAD_PROGRAMS
    chunk = tl.maximum((work + target_programs - 1) // target_programs, MIN_TILES)
    splits = tl.minimum(tl.maximum((tiles + chunk - 1) // chunk, 1), max_splits)
    ends = tl.associative_scan(splits, 0, _sum_combine)
    return first, tiles, splits, ends


@device_function
def _pick(values, lanes, index):
    """values[index] of a vector (lanes = tl.arange over it)."""
    return tl.reduce(tl.where(lanes == index, values, 0), 0, _sum_combine)


# ---------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------

@varies_per_step("batch", "stride_tb")
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2, window, softcap, batch, target_programs, max_splits,
    stride_qb, stride_qh, stride_tb, stride_ob, stride_oh, stride_pw, stride_lw,
    STRIDE_CB: tl.constexpr, STRIDE_CT: tl.constexpr, STRIDE_CH: tl.constexpr,
    STRIDE_SB: tl.constexpr, STRIDE_ST: tl.constexpr, STRIDE_SH: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED_TILES: tl.constexpr,
    BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    MIN_TILES: tl.constexpr, PLAN_BATCH: tl.constexpr, HEAD_PROGRAMS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    head_prog = tl.program_id(0)
    work = tl.program_id(1)
    kv_head = head_prog // HEAD_BLOCKS
    head_block = head_prog % HEAD_BLOCKS

    if PLAN_BATCH > 0:
        first, tiles, splits, ends = _split_plan(lens_ptr, batch, window, target_programs, max_splits,
                                                 PLAN_BATCH, TILE, MIN_TILES, HEAD_PROGRAMS, WINDOWED)
        lanes = tl.arange(0, PLAN_BATCH)
        seq = tl.reduce((ends <= work).to(tl.int32), 0, _sum_combine)
        if seq >= batch:  # a spare work item: the plan used fewer
            return
        n_splits = _pick(splits, lanes, seq)
        split = work - (_pick(ends, lanes, seq) - n_splits)
        tile0 = _pick(first, lanes, seq)
        n_tiles = _pick(tiles, lanes, seq)
    else:
        seq = work
        n_splits = 1
        split = 0
        seq_len0 = tl.load(lens_ptr + seq)
        tile0 = tl.maximum(seq_len0 - window, 0) // TILE if WINDOWED else 0
        n_tiles = (seq_len0 + TILE - 1) // TILE - tile0

    seq_len = tl.load(lens_ptr + seq)
    kv_lo = tl.maximum(seq_len - window, 0) if WINDOWED else 0
    # balanced: split s reads tiles [s * n / S, (s + 1) * n / S) of the sequence's n tiles
    t_begin = tile0 + split * n_tiles // n_splits
    t_end = tile0 + (split + 1) * n_tiles // n_splits

    g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # rows: query heads of this KV head's group
    head_ok = g < GROUP
    q_head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_mask = head_ok[:, None] & d_ok[None, :]
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qb + q_head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    if not QUANT:
        q = q.to(k_ptr.dtype.element_ty)  # tl.dot wants one dtype; a no-op when they match
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    table_row = table_ptr + seq64 * stride_tb
    k_head, v_head = k_ptr + kv_head * STRIDE_CH, v_ptr + kv_head * STRIDE_CH
    ks_head, vs_head = ks_ptr + kv_head * STRIDE_SH, vs_ptr + kv_head * STRIDE_SH
    for t in range(t_begin, t_end):
        tok0 = t * TILE
        k, v, ks, vs = _kv_tile(k_head, v_head, ks_head, vs_head, table_row, tok0, kv_lo, seq_len, d, d_ok,
                                BLOCK_SIZE, TILE, PAGED_TILES, STRIDE_CB, STRIDE_CT, STRIDE_SB, STRIDE_ST, True, QUANT)
        n = tok0 + tl.arange(0, TILE)
        visible = ((n >= kv_lo) & (n < seq_len))[None, :]
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, ks, vs, visible, scale_log2, softcap,
                                      SOFTCAP, True, QUANT, DOT_FP32, PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = tl.math.div_rn(acc, l_safe[:, None])  # an empty sequence -> zeros
    if n_splits == 1:
        out_offs = seq64 * stride_ob + q_head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        w64 = work.to(tl.int64)
        tl.store(part_ptr + w64 * stride_pw + q_head[:, None] * BLOCK_D + d[None, :], out, mask=row_mask)
        tl.store(lse_ptr + w64 * stride_lw + q_head, lse, mask=head_ok)


@varies_per_step("batch")
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, lens_ptr,
    window, batch, target_programs, max_splits,
    stride_pw, stride_lw, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    TILE: tl.constexpr, MIN_TILES: tl.constexpr, PLAN_BATCH: tl.constexpr, HEAD_PROGRAMS: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """One program per (sequence, query head): its partials, weighted by their log-sum-exp (one program per
    head keeps a long sequence's merge short: batch 1 at 32k has 64 splits)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _, _, splits, ends = _split_plan(lens_ptr, batch, window, target_programs, max_splits,
                                     PLAN_BATCH, TILE, MIN_TILES, HEAD_PROGRAMS, WINDOWED)
    lanes = tl.arange(0, PLAN_BATCH)
    n_splits = _pick(splits, lanes, seq)
    if n_splits == 1:  # the split kernel wrote this sequence's output
        return
    w0 = _pick(ends, lanes, seq) - n_splits
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for c in range(0, n_splits, BLOCK_S):
        w = (w0 + c + s).to(tl.int64)
        top = tl.maximum(top, tl.load(lse_ptr + w * stride_lw + head, mask=c + s < n_splits, other=float("-inf")))
    top_all = tl.reduce(top, 0, _max_combine)
    top_all = tl.where(top_all == float("-inf"), 0.0, top_all)  # every split empty: weights 0, output 0
    total = tl.full([BLOCK_S], 0.0, tl.float32)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for c in range(0, n_splits, BLOCK_S):
        w = (w0 + c + s).to(tl.int64)
        s_ok = c + s < n_splits
        weight = tl.exp2(tl.load(lse_ptr + w * stride_lw + head, mask=s_ok, other=float("-inf")) - top_all)
        part = tl.load(part_ptr + w[:, None] * stride_pw + head * BLOCK_D + d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        total += weight
        acc += tl.reduce(part * weight[:, None], 0, _sum_combine)
    total_all = tl.reduce(total, 0, _sum_combine)
    out = tl.math.div_rn(acc, tl.where(total_all > 0, total_all, 1.0))
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


def split_counts(lens: list[int], head_programs: int, tile: int, min_tiles: int, target_programs: int,
                 window: int = 0) -> list[int]:
    """The device split plan (_split_plan) on the host: each sequence's split count (tests, bench reports)."""
    first = [max(n - window, 0) // tile if window else 0 for n in lens]
    tiles = [-(-n // tile) - f for n, f in zip(lens, first)]
    chunk = max(min_tiles, -(-sum(tiles) * head_programs // target_programs))
    return [min(max(-(-t // chunk), 1), _MAX_SPLITS) for t in tiles]


def _head_blocking(group: int, max_rows: int = 64) -> tuple[int, int]:
    """Rows per tile for a GQA group (pow2, >= 16 for tl.dot) and how many tiles cover the group."""
    block_h = min(max(16, next_pow2(group)), max_rows)
    return block_h, -(-group // block_h)


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """int32 with a unit last stride, without a copy when it already is."""
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _or(scales, cache):
    """A float pool's calls pass its caches where the scale pointers go (never read: QUANT is off)."""
    return cache if scales is None else scales


def _output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.stride(-1) == 1, "out must have a contiguous head_dim"
    return out


def _cache_constants(k_cache: torch.Tensor, head_dim: int, q_dtype: torch.dtype, k_scale, v_scale) -> dict:
    """The constexprs a pool's layout fixes (one compile per model): strides, page size, quantization."""
    quant = k_scale is not None
    assert quant == is_quantized(k_cache) and (k_scale is None) == (v_scale is None), \
        "a quantized pool (int8 / float8 caches) comes with its k_scale and v_scale, a float pool without"
    if quant:
        assert k_scale.shape == k_cache.shape[:3] and k_scale.dtype == SCALE_DTYPE
        assert v_scale.shape == k_scale.shape and v_scale.stride() == k_scale.stride()
    block_size = k_cache.shape[1]
    scale_strides = k_scale.stride() if quant else (0, 0, 0)
    return dict(STRIDE_CB=k_cache.stride(0), STRIDE_CT=k_cache.stride(1), STRIDE_CH=k_cache.stride(2),
                STRIDE_SB=scale_strides[0], STRIDE_ST=scale_strides[1], STRIDE_SH=scale_strides[2],
                HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAGED_TILES=block_size == next_pow2(block_size),
                BLOCK_D=max(16, next_pow2(head_dim)), DOT_FP32=interpreting(),
                PRECISION=dot_precision(q_dtype if quant else k_cache.dtype), QUANT=quant)


def paged_decode_attention_v2(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, *,
                              sliding_window: int | None = None, softcap: float | None = None,
                              k_scale=None, v_scale=None, config: DecodeConfig | None = None,
                              num_sms: int | None = None):
    """Triton decode attention; see pagedchat.kernels.paged_decode_attention for the contract.

    config: a launch configuration instead of the measured / default one of this shape class;
    num_sms: plan the splits for this many SMs instead of the device's (tests).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = _output_buffer(q, out)
    for launch in decode_launches(q, k_cache, v_cache, _as_int32(block_tables), _as_int32(seq_lens), scale, out,
                                  sliding_window=sliding_window, softcap=softcap, k_scale=k_scale,
                                  v_scale=v_scale, config=config, num_sms=num_sms):
        launch()
    return out


def decode_launches(q, k_cache, v_cache, block_tables, seq_lens, scale, out, *, sliding_window=None, softcap=None,
                    k_scale=None, v_scale=None, config: DecodeConfig | None = None,
                    num_sms: int | None = None) -> list[Launch]:
    """The split kernel's launch and, when the plan may split, the merge's (tensors already checked)."""
    check_cache_pair(k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim and num_q_heads % num_kv_heads == 0
    assert block_tables.shape[0] == batch and seq_lens.shape[0] == batch
    if batch == 0:
        return []
    group = num_q_heads // num_kv_heads
    consts = _cache_constants(k_cache, head_dim, q.dtype, k_scale, v_scale)
    if config is None:
        config = decode_config(head_dim, group, k_cache.shape[1], k_cache.dtype, decode_size_class(batch),
                               q.device, q.dtype if consts["QUANT"] else None)
    block_h, head_blocks = _head_blocking(group)
    head_programs = num_kv_heads * head_blocks
    target = (num_sms or sm_count(q.device)) * config.programs_per_sm
    if batch <= _PLAN_MAX_BATCH:
        plan_batch = next_pow2(max(batch, 2))
        work_items = batch - (-target // head_programs)  # bounds sum_i splits_i (module docstring)
    else:
        plan_batch, work_items = 0, batch
    assert work_items < 65536, "decode batch too large for one launch"
    # partials per work item: [work item, query head, BLOCK_D] fp32 and [work item, query head] lse
    block_d = consts["BLOCK_D"]
    part = torch.empty(work_items * num_q_heads * (block_d + 1) if plan_batch else 1, device=q.device,
                       dtype=torch.float32)
    stride_pw, stride_lw = num_q_heads * block_d, num_q_heads
    lse = part[work_items * stride_pw:] if plan_batch else part

    window = int(sliding_window or 0)
    plan = dict(TILE=config.tile, MIN_TILES=config.min_tiles, PLAN_BATCH=plan_batch, HEAD_PROGRAMS=head_programs,
                WINDOWED=bool(sliding_window))
    launches = [Launch(
        _decode_kernel, (head_programs, work_items),
        (q, k_cache, v_cache, _or(k_scale, k_cache), _or(v_scale, v_cache), block_tables, seq_lens, out, part, lse,
         scale * LOG2E, window, float(softcap or 1.0), batch, target, _MAX_SPLITS,
         q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), stride_pw, stride_lw),
        dict(GROUP=group, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks, SOFTCAP=bool(softcap), **plan, **consts),
        config.num_warps, config.num_stages)]
    if plan_batch:
        launches.append(Launch(
            _decode_merge_kernel, (batch, num_q_heads),
            (part, lse, out, seq_lens, window, batch, target, _MAX_SPLITS,
             stride_pw, stride_lw, out.stride(0), out.stride(1)),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=_MERGE_SPLITS, **plan),
            num_warps=4, num_stages=1))
    return launches


# ---------------------------------------------------------------------------------------------------
# Prefill / extend
# ---------------------------------------------------------------------------------------------------

@device_function
def _find_sequence(cu_ptr, batch, tile_id, BLOCK_Q: tl.constexpr):
    """The sequence owning flat query tile `tile_id`: sequence i owns tiles cu[i] // BLOCK_Q + i onwards."""
    lo = tl.program_id(0) * 0
    hi = lo + batch - 1  # a tensor even where Triton specialized batch == 1 to a constant
    while lo < hi:
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_ptr + mid) // BLOCK_Q + mid <= tile_id
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


@device_function
def _prefill_tiles(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, table_row, t_begin, t_end, kv_lo, kv_hi,
                   pos, d, d_ok, scale_log2, softcap, window,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PAGED_TILES: tl.constexpr,
                   STRIDE_CB: tl.constexpr, STRIDE_CT: tl.constexpr, STRIDE_SB: tl.constexpr,
                   STRIDE_ST: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                   QUANT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """KV tiles t_begin..t_end-1 of one query tile; MASKED applies the causal / window / length masks."""
    for t in range(t_begin, t_end):
        tok0 = t * TILE
        k, v, ks, vs = _kv_tile(k_head, v_head, ks_head, vs_head, table_row, tok0, kv_lo, kv_hi, d, d_ok,
                                BLOCK_SIZE, TILE, PAGED_TILES, STRIDE_CB, STRIDE_CT, STRIDE_SB, STRIDE_ST, MASKED,
                                QUANT)
        if MASKED:
            n = tok0 + tl.arange(0, TILE)
            visible = ((n >= kv_lo) & (n < kv_hi))[None, :] & (n[None, :] <= pos[:, None])
            if WINDOWED:
                visible = visible & (n[None, :] > pos[:, None] - window)
        else:
            visible = None
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, ks, vs, visible, scale_log2, softcap,
                                      SOFTCAP, MASKED, QUANT, DOT_FP32, PRECISION)
    return acc, m_i, l_i


@varies_per_step("batch", "stride_tb")
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, cu_ptr, lens_ptr, out_ptr,
    scale_log2, window, softcap, batch,
    stride_qt, stride_qh, stride_tb, stride_ot, stride_oh,
    STRIDE_CB: tl.constexpr, STRIDE_CT: tl.constexpr, STRIDE_CH: tl.constexpr,
    STRIDE_SB: tl.constexpr, STRIDE_ST: tl.constexpr, STRIDE_SH: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED_TILES: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
):
    # The last query tiles of a sequence see the most keys: they start first (the grid runs backwards).
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    seq = _find_sequence(cu_ptr, batch, tile_id, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    local = tile_id - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:  # the grid is a bound on the number of query tiles
        return
    ctx_len = tl.load(lens_ptr + seq)
    prefix_len = ctx_len - q_len  # cached tokens before this chunk

    # Rows are (query token, query head of the group) pairs: BLOCK_Q tokens x BLOCK_G heads, so the
    # K/V tile loaded for this KV head serves every query head that shares it.
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    t = local * BLOCK_Q + r // BLOCK_G
    g = head_block * BLOCK_G + r % BLOCK_G
    row_ok = (t < q_len) & (g < GROUP)
    q_head = kv_head * GROUP + g
    pos = prefix_len + t  # the row's absolute position: it sees keys 0..pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = (q_start + t).to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask, other=0.0)
    if not QUANT:
        q = q.to(k_ptr.dtype.element_ty)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys [kv_lo, kv_hi) are seen by some row; [full_lo, first_pos] by every row (no mask needed there).
    first_pos = prefix_len + local * BLOCK_Q
    last_pos = prefix_len + tl.minimum((local + 1) * BLOCK_Q, q_len) - 1
    kv_hi = last_pos + 1
    if WINDOWED:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, 0)
    else:
        kv_lo = first_pos * 0
        full_lo = kv_lo
    t_lo = kv_lo // TILE
    t_hi = (kv_hi + TILE - 1) // TILE
    t_full_lo = tl.minimum(tl.maximum((full_lo + TILE - 1) // TILE, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum((first_pos + 1) // TILE, t_full_lo), t_hi)

    m_i = tl.full([BLOCK_Q * BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    k_head, v_head = k_ptr + kv_head * STRIDE_CH, v_ptr + kv_head * STRIDE_CH
    ks_head, vs_head = ks_ptr + kv_head * STRIDE_SH, vs_ptr + kv_head * STRIDE_SH
    if WINDOWED:  # the window's lead-in: keys some rows no longer see
        acc, m_i, l_i = _prefill_tiles(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, table_row, t_lo, t_full_lo,
                                       kv_lo, kv_hi, pos, d, d_ok, scale_log2, softcap, window, BLOCK_SIZE, TILE,
                                       PAGED_TILES, STRIDE_CB, STRIDE_CT, STRIDE_SB, STRIDE_ST, True, WINDOWED,
                                       SOFTCAP, QUANT, DOT_FP32, PRECISION)
    acc, m_i, l_i = _prefill_tiles(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, table_row, t_full_lo, t_full_hi,
                                   kv_lo, kv_hi, pos, d, d_ok, scale_log2, softcap, window, BLOCK_SIZE, TILE,
                                   PAGED_TILES, STRIDE_CB, STRIDE_CT, STRIDE_SB, STRIDE_ST, False, WINDOWED,
                                   SOFTCAP, QUANT, DOT_FP32, PRECISION)
    acc, m_i, l_i = _prefill_tiles(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, table_row, t_full_hi, t_hi,
                                   kv_lo, kv_hi, pos, d, d_ok, scale_log2, softcap, window, BLOCK_SIZE, TILE,
                                   PAGED_TILES, STRIDE_CB, STRIDE_CT, STRIDE_SB, STRIDE_ST, True, WINDOWED,
                                   SOFTCAP, QUANT, DOT_FP32, PRECISION)

    out = tl.math.div_rn(acc, tl.where(l_i > 0, l_i, 1.0)[:, None])
    out_rows = (q_start + t).to(tl.int64) * stride_ot + q_head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention_v2(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None, *,
                               sliding_window: int | None = None, softcap: float | None = None,
                               k_scale=None, v_scale=None, config: PrefillConfig | None = None):
    """Triton chunked causal prefill; see pagedchat.kernels.paged_prefill_attention for the contract."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = _output_buffer(q, out)
    for launch in prefill_launches(q, k_cache, v_cache, _as_int32(block_tables), _as_int32(cu_seqlens_q),
                                   _as_int32(seq_lens), scale, out, sliding_window=sliding_window, softcap=softcap,
                                   k_scale=k_scale, v_scale=v_scale, config=config):
        launch()
    return out


def prefill_launches(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, *, sliding_window=None,
                     softcap=None, k_scale=None, v_scale=None, config: PrefillConfig | None = None) -> list[Launch]:
    check_cache_pair(k_cache, v_cache)
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim and num_q_heads % num_kv_heads == 0
    batch = seq_lens.shape[0]
    assert cu_seqlens_q.shape[0] == batch + 1 and block_tables.shape[0] == batch
    if batch == 0 or total_q == 0:
        return []
    group = num_q_heads // num_kv_heads
    consts = _cache_constants(k_cache, head_dim, q.dtype, k_scale, v_scale)
    if config is None:
        config = prefill_config(head_dim, group, k_cache.shape[1], k_cache.dtype,
                                prefill_size_class(total_q, batch), q.device, q.dtype if consts["QUANT"] else None)
    # No head padding beyond a power of two: query tokens fill the rows (BLOCK_Q x BLOCK_G = rows >= 16).
    block_g = min(next_pow2(group), config.rows)
    head_blocks = -(-group // block_g)
    block_q = config.rows // block_g
    # Sequence i owns flat query tiles cu[i] // block_q + i ..: total_q // block_q + batch bounds them all.
    grid = (total_q // block_q + batch, num_kv_heads * head_blocks)
    assert grid[1] < 65536
    return [Launch(
        _prefill_kernel, grid,
        (q, k_cache, v_cache, _or(k_scale, k_cache), _or(v_scale, v_cache), block_tables, cu_seqlens_q, seq_lens,
         out, scale * LOG2E, int(sliding_window or 0), float(softcap or 1.0), batch,
         q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(GROUP=group, BLOCK_Q=block_q, BLOCK_G=block_g, HEAD_BLOCKS=head_blocks, TILE=config.tile,
             WINDOWED=bool(sliding_window), SOFTCAP=bool(softcap), **consts),
        config.num_warps, config.num_stages)]
