"""Triton kernels that move K/V in the block pool: write_kv (scatter new tokens) and copy_blocks (COW).

Slots and block ids are widened to int64 before any address arithmetic: a pool of a few million slots
times Hkv x D elements overflows int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_cache_pair, kernel, next_pow2


def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_ct, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + token * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter k, v [N, Hkv, D] to their slots (block_id * block_size + offset); negative slots skip."""
    check_cache_pair(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "k/v heads and head_dim must match the cache"
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    block_d = max(16, next_pow2(head_dim))
    block_h = max(1, min(next_pow2(num_kv_heads), 4096 // block_d))  # <= 4096 elements per program
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    kernel(_write_kv_kernel)[grid](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )


def _copy_blocks_kernel(
    k_cache_ptr, v_cache_ptr, src_ptr, dst_ptr, stride_cb,
    BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    k = tl.load(k_cache_ptr + src * stride_cb + offs, mask=mask)
    tl.store(k_cache_ptr + dst * stride_cb + offs, k, mask=mask)
    v = tl.load(v_cache_ptr + src * stride_cb + offs, mask=mask)
    tl.store(v_cache_ptr + dst * stride_cb + offs, v, mask=mask)


def copy_blocks_triton(k_cache, v_cache, src, dst) -> None:
    """Copy whole blocks src[i] -> dst[i] in one layer's caches; no dst may also be a src."""
    check_cache_pair(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    # A block is one contiguous run of block_size * Hkv * D elements (blocks themselves may be strided).
    assert k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1), "blocks must be contiguous"
    src = torch.as_tensor(src, dtype=torch.int64, device=k_cache.device).contiguous()
    dst = torch.as_tensor(dst, dtype=torch.int64, device=k_cache.device).contiguous()
    assert src.shape == dst.shape and src.dim() == 1
    if src.numel() == 0:
        return
    block_elems = block_size * num_kv_heads * head_dim
    chunk = min(4096, next_pow2(block_elems))
    grid = (src.numel(), triton.cdiv(block_elems, chunk))
    kernel(_copy_blocks_kernel)[grid](
        k_cache, v_cache, src, dst, k_cache.stride(0),
        BLOCK_ELEMS=block_elems, CHUNK=chunk, num_warps=4,
    )
