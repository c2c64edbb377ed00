"""Triton kernels that move K/V in the block pool: write_kv (scatter new tokens) and copy_blocks (COW).

A quantized pool (kv_quant.py) is written as kv_quant.quantize_kv writes it, bit for bit: one float16 scale per
(slot, KV head), int8 values rounded half to even, float8 e4m3 values rounded to nearest even.

Slots and block ids are widened to int64 before any address arithmetic: a pool of a few million slots
times Hkv x D elements overflows int32.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._launch import MAX_COMBINE as _max_combine
from ._launch import check_cache_pair, device_function, kernel, next_pow2
from .kv_quant import is_quantized, qmax


@device_function
def _round_half_even(y):
    """torch.round on fp32: to the nearest integer, ties to even (exact in fp32 for |y| < 2**22)."""
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 where f is odd
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@device_function
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest float8 e4m3 value, ties to even, so that the cast after it
    is exact whatever rounding the conversion itself does (the interpreter's rounds ties away from zero)."""
    bits = y.to(tl.int32, bitcast=True)
    # normal e4m3 numbers (|y| >= 2^-6) keep 3 of fp32's 23 mantissa bits: round the other 20 to even
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = kept.to(tl.float32, bitcast=True)
    subnormal = _round_half_even(y * 512.0) * (1.0 / 512.0)  # below 2^-6: multiples of 2^-9
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@device_function
def _quantize(x, QMAX: tl.constexpr, INT8: tl.constexpr):
    """x [heads, D] (fp32, masked lanes 0) -> (values in fp32, exactly representable in the cache dtype; float16
    scales [heads]) as kv_quant.quantize_kv makes them."""
    # IEEE divisions (div_rn): Triton's `/` compiles to an approximate division, which would differ from
    # torch's by an ulp now and then
    scale = tl.math.div_rn(tl.reduce(tl.abs(x), 1, _max_combine), QMAX).to(tl.float16)
    safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe[:, None]), -QMAX), QMAX)
    if INT8:
        y = _round_half_even(y)
    else:
        y = _round_to_e4m3(y)
    return y, scale


def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slot_ptr, num_kv_heads,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_kv_heads
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + token * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if QUANT:  # one float16 scale per (slot, head) beside the values (kv_quant.py)
        k, k_scale = _quantize(k.to(tl.float32), QMAX, INT8)
        v, v_scale = _quantize(v.to(tl.float32), QMAX, INT8)
        scale_dst = block * stride_sb + offset * stride_st + h * stride_sh
        tl.store(ks_ptr + scale_dst, k_scale, mask=h_ok)
        tl.store(vs_ptr + scale_dst, v_scale, mask=h_ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter k, v [N, Hkv, D] to their slots (block_id * block_size + offset); negative slots skip. A quantized
    pool's caches get each (token, head) quantized as kv_quant.quantize_kv does, its scale in k_scale / v_scale."""
    check_cache_pair(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "k/v heads and head_dim must match the cache"
    quant = is_quantized(k_cache)
    assert quant == (k_scale is not None) == (v_scale is not None), \
        "a quantized cache needs its scales (and a float one has none)"
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    block_d = max(16, next_pow2(head_dim))
    block_h = max(1, min(next_pow2(num_kv_heads), 4096 // block_d))  # <= 4096 elements per program
    grid = (num_tokens, -(-num_kv_heads // block_h))
    scale_strides = k_scale.stride() if quant else (0, 0, 0)
    kernel(_write_kv_kernel)[grid](
        k, v, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, slot_mapping,
        num_kv_heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        QUANT=quant, QMAX=qmax(k_cache.dtype) if quant else 1.0, INT8=k_cache.dtype == torch.int8,
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


def copy_blocks_triton(k_cache, v_cache, src, dst, k_scale=None, v_scale=None) -> None:
    """Copy whole blocks src[i] -> dst[i] in one layer's caches (and a quantized pool's scales); no dst may also
    be a src."""
    check_cache_pair(k_cache, v_cache)
    # A block is one contiguous run of block_size * Hkv * D elements (blocks themselves may be strided).
    assert k_cache.stride()[1:] == (k_cache.shape[2] * k_cache.shape[3], k_cache.shape[3], 1), \
        "blocks must be contiguous"
    assert (k_scale is None) == (v_scale is None)
    src = torch.as_tensor(src, dtype=torch.int64, device=k_cache.device).contiguous()
    dst = torch.as_tensor(dst, dtype=torch.int64, device=k_cache.device).contiguous()
    assert src.shape == dst.shape and src.dim() == 1
    if src.numel() == 0:
        return
    _copy_pages(k_cache, v_cache, src, dst)
    if k_scale is not None:
        assert k_scale.shape == k_cache.shape[:3] and v_scale.stride() == k_scale.stride()
        assert k_scale.stride()[1:] == (k_scale.shape[2], 1), "scale blocks must be contiguous"
        _copy_pages(k_scale, v_scale, src, dst)


def _copy_pages(k_pages, v_pages, src, dst) -> None:
    """Pages src[i] -> dst[i] of two tensors of one layout (dim 0: pages, each one contiguous run)."""
    block_elems = k_pages[0].numel()
    chunk = min(4096, next_pow2(block_elems))
    grid = (src.numel(), -(-block_elems // chunk))
    kernel(_copy_blocks_kernel)[grid](
        k_pages, v_pages, src, dst, k_pages.stride(0),
        BLOCK_ELEMS=block_elems, CHUNK=chunk, num_warps=4,
    )
