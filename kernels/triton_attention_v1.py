"""Triton paged attention, first generation (v1): split-KV decode (flash decoding) and chunked causal prefill.

Kept selectable beside v2 (PAGEDCHAT_ATTN=v1) so one GPU run measures both; see triton_attention.py.

Both kernels read K/V straight from the block pool [num_blocks, block_size, Hkv, D] through the block
table, one tile of BLOCK_N tokens at a time (a tile may span several small blocks or part of a big one:
the physical block is looked up per token, which is a cached int32 load). The query heads that share a
KV head are stacked as rows of one tl.dot, so every KV tile is read from memory once per KV head.

Numerics: scores are kept in base 2 (scale * log2 e folded in, exp2), softmax state (running max, sum,
accumulator) in fp32. The running max starts at a finite -1e30 and masked scores are -inf, so
exp2(old_max - new_max) and exp2(score - max) are never inf - inf; a row that sees no key ends with
sum 0 and is written as zeros. All addresses derived from a block id or a token index are int64.

Kernels are plain functions made launchable by `kernel(fn)` at the first call (see _launch.py).
DOT_FP32 (set only under the interpreter) upcasts the tl.dot operands: the interpreter multiplies bf16
tensors as their raw uint16 bits. The compiled path never sets it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    LOG2E,
    check_cache_pair,
    dot_precision,
    interpreting,
    kernel,
    next_pow2,
    sm_count,
    varies_per_step,
)
from ._launch import LOG2E_C as _LOG2E
from ._launch import MAX_COMBINE as _max_combine
from ._launch import NEG_BIG as _NEG_BIG
from ._launch import SUM_COMBINE as _sum_combine

# ---------------------------------------------------------------------------------------------------
# Decode: stage 1, one program per (sequence, KV head [x head block], split)
# ---------------------------------------------------------------------------------------------------

@varies_per_step("num_splits", "stride_tb")
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_splits, window, softcap,
    stride_qb, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_tb,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    # Splits are cut from this sequence's own length (rounded to whole tiles), so a short sequence in
    # a batch sized for long ones still spreads over all its splits; trailing splits may be empty.
    # With a window only its last `window` keys exist for it (the blocks before may be released).
    seq_len = tl.load(lens_ptr + seq)
    kv_lo = tl.maximum(seq_len - window, 0) if WINDOWED else 0
    per_split = (seq_len - kv_lo + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv_start = kv_lo + split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)

    g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # rows: query heads of this KV head's group
    head_ok = g < GROUP
    q_head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_mask = head_ok[:, None] & d_ok[None, :]
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qb + q_head[:, None] * stride_qh + d[None, :], mask=row_mask,
                other=0.0).to(k_ptr.dtype.element_ty)  # tl.dot wants one dtype; a no-op when they match
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    table_row = table_ptr + seq64 * stride_tb
    for tile in range(kv_start, kv_end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        token = block * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_ct + kv_head * stride_ch
        kv_offs = token[:, None] + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        if SOFTCAP:  # c * tanh(x / c) on the base-2 score s = x log2(e): tanh(y) = 1 - 2 / (e^2y + 1)
            s = softcap * _LOG2E * (1.0 - 2.0 / (tl.exp2(2.0 * s / softcap) + 1.0))
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        p = p.to(v.dtype)  # flash-attention convention: P in the input dtype for the second dot
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # empty split or sequence -> zeros
    if SINGLE_SPLIT:
        out_offs = seq64 * stride_ob + q_head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        part_offs = seq64 * stride_pb + q_head[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(part_out_ptr + part_offs, out, mask=row_mask)
        tl.store(part_lse_ptr + seq64 * stride_lb + q_head * stride_lh + split, lse, mask=head_ok)


# ---------------------------------------------------------------------------------------------------
# Decode: stage 2, merge the splits of one (sequence, query head) by their log-sum-exp
# ---------------------------------------------------------------------------------------------------

@varies_per_step("num_splits")
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.reduce(lse, 0, _max_combine)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights all 0, output 0
    weight = tl.exp2(lse - top)
    total = tl.reduce(weight, 0, _sum_combine)
    part = tl.load(part_out_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.reduce(part * weight[:, None], 0, _sum_combine) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.stride(-1) == 1, "out must have a contiguous head_dim"
    return out


def _head_blocking(group: int, max_rows: int) -> tuple[int, int]:
    """Rows per tile for a GQA group (pow2, >= 16 for tl.dot) and how many tiles cover the group."""
    block_h = min(max(16, next_pow2(group)), max_rows)
    return block_h, triton.cdiv(group, block_h)


def choose_num_splits(batch: int, programs_per_seq: int, max_len: int, block_n: int,
                      device: torch.device) -> int:
    """Split count for decode: enough programs for several waves of SMs, >= 2 tiles per split.

    `max_len` is an upper bound (block-table width x block size), not seq_lens.max(): reading the
    lengths would be a device->host sync and break CUDA-graph capture.
    """
    target_programs = 8 * sm_count(device)
    want = triton.cdiv(target_programs, max(1, batch * programs_per_seq))
    by_length = triton.cdiv(max(1, max_len), 2 * block_n)
    return max(1, min(want, by_length, 64))


def _decode_config(head_dim: int) -> dict:
    block_d = max(16, next_pow2(head_dim))
    # KV tile of 64 tokens x 128 dims x 2 bytes = 16 KiB per operand; halve the tokens for D=256 to
    # keep two pipeline stages of K and V in shared memory with room for another program per SM.
    return dict(BLOCK_D=block_d, BLOCK_N=64 if block_d <= 128 else 32, num_warps=4, num_stages=2)


def paged_decode_attention_v1(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, *,
                                  num_splits: int | None = None, sliding_window: int | None = None,
                                  softcap: float | None = None):
    """Triton decode attention; see pagedchat.kernels.paged_decode_attention for the contract."""
    check_cache_pair(k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim and num_q_heads % num_kv_heads == 0
    assert block_tables.shape[0] == batch and seq_lens.shape[0] == batch
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = _output_buffer(q, out)
    if batch == 0:
        return out

    group = num_q_heads // num_kv_heads
    cfg = _decode_config(head_dim)
    block_h, head_blocks = _head_blocking(group, max_rows=64)
    max_len = block_tables.shape[1] * block_size
    if sliding_window:
        max_len = min(max_len, sliding_window + block_size)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads * head_blocks, max_len, cfg["BLOCK_N"], q.device)
    assert num_splits >= 1
    single = num_splits == 1
    if single:  # stage 1 writes the output directly; the partial buffers are never touched
        part_out = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    else:
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((batch, num_q_heads, num_splits), device=q.device, dtype=torch.float32)

    grid = (batch, num_kv_heads * head_blocks, num_splits)
    kernel(_decode_split_kernel)[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_splits, int(sliding_window or 0), float(softcap or 1.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], HEAD_BLOCKS=head_blocks,
        SINGLE_SPLIT=single, DOT_FP32=interpreting(), PRECISION=dot_precision(k_cache.dtype),
        WINDOWED=bool(sliding_window), SOFTCAP=bool(softcap),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if not single:
        kernel(_decode_merge_kernel)[(batch, num_q_heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"], BLOCK_S=next_pow2(num_splits),
            num_warps=4 if cfg["BLOCK_D"] <= 128 else 8,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# Prefill: one program per (sequence, KV head [x head block], tile of query tokens)
# ---------------------------------------------------------------------------------------------------

@varies_per_step("stride_tb")
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, cu_q_ptr, lens_ptr, out_ptr,
    scale_log2, window, softcap,
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    tile_start = tl.program_id(2) * BLOCK_M

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile_start >= q_len:  # the grid is sized for the longest chunk of the batch
        return
    ctx_len = tl.load(lens_ptr + seq)
    prefix_len = ctx_len - q_len  # cached tokens before this chunk

    # Rows are (query token, query head of the group) pairs: BLOCK_M tokens x BLOCK_G heads, so the
    # K/V tile loaded for this KV head serves every query head that shares it.
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    t = tile_start + r // BLOCK_G
    g = head_block * BLOCK_G + r % BLOCK_G
    row_ok = (t < q_len) & (g < GROUP)
    q_head = kv_head * GROUP + g
    pos = prefix_len + t  # the row's absolute position: it sees keys 0..pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = (q_start + t).to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask, other=0.0).to(k_ptr.dtype.element_ty)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M * BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    # Keys after the tile's last token are invisible to all its rows: stop there.
    kv_end = tl.minimum(ctx_len, prefix_len + tl.minimum(tile_start + BLOCK_M, q_len))
    # With a window, keys before the first row's window are invisible to all rows (and may be released).
    kv_lo = tl.maximum(prefix_len + tile_start - window + 1, 0) if WINDOWED else 0
    for tile in range(kv_lo, kv_end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        token = block * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_ct + kv_head * stride_ch
        kv_offs = token[:, None] + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFTCAP:  # c * tanh(x / c) on the base-2 score s = x log2(e): tanh(y) = 1 - 2 / (e^2y + 1)
            s = softcap * _LOG2E * (1.0 - 2.0 / (tl.exp2(2.0 * s / softcap) + 1.0))
        # Only tiles reaching into the chunk need the causal part of this mask; the prefix tiles
        # pay one compare, which is cheaper than a second copy of the loop body.
        visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
        if WINDOWED:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        p = p.to(v.dtype)
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + t).to(tl.int64) * stride_ot + q_head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _prefill_config(head_dim: int) -> dict:
    block_d = max(16, next_pow2(head_dim))
    if block_d <= 128:
        return dict(BLOCK_D=block_d, ROWS=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_D=block_d, ROWS=64, BLOCK_N=32, num_warps=8, num_stages=2)


def paged_prefill_attention_v1(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                   out=None, *, sliding_window: int | None = None, softcap: float | None = None):
    """Triton chunked causal prefill; see pagedchat.kernels.paged_prefill_attention for the contract."""
    check_cache_pair(k_cache, v_cache)
    total_q, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim and num_q_heads % num_kv_heads == 0
    batch = seq_lens.shape[0]
    assert cu_seqlens_q.shape[0] == batch + 1 and block_tables.shape[0] == batch
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = _output_buffer(q, out)
    if batch == 0 or total_q == 0:
        return out
    # Rows of a sequence without query tokens are never written; none exist outside the sequences'
    # ranges unless cu_seqlens_q[-1] < total_q, which we treat as a caller error.
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # host sync: prefill is not graphed
    if max_q_len == 0:
        return out

    group = num_q_heads // num_kv_heads
    cfg = _prefill_config(head_dim)
    # No head padding here: query tokens fill the rows (BLOCK_M x BLOCK_G = ROWS >= 16 for tl.dot).
    block_g = min(next_pow2(group), cfg["ROWS"])
    head_blocks = triton.cdiv(group, block_g)
    block_m = cfg["ROWS"] // block_g
    grid = (batch, num_kv_heads * head_blocks, triton.cdiv(max_q_len, block_m))
    assert grid[1] < 65536 and grid[2] < 65536, "chunk too long for one launch: split the prefill"
    kernel(_prefill_kernel)[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E, int(sliding_window or 0), float(softcap or 1.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
        HEAD_BLOCKS=head_blocks, DOT_FP32=interpreting(), PRECISION=dot_precision(k_cache.dtype),
        WINDOWED=bool(sliding_window), SOFTCAP=bool(softcap),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
