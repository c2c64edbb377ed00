"""Triton kernels that fuse a Llama layer's small steps, so a decode step launches a few full kernels per
layer instead of twenty small ones (the CUDA path; twins in fused_reference.py):

  add_rms_norm   residual + x, then RMSNorm of the sum, both written in the model dtype (one read of each)
  silu_and_mul   silu(gate) * up from the fused gate_up projection
  rope_write_kv  rotary of q and k (after Qwen3's per-head q/k norms when given) and the write of the
                 rotated k and of v into their pool slots; the rotated q comes back for attention

Every value is computed in fp32 and rounded to the model dtype exactly where transformers rounds (see
fused_reference.py), so the results equal the unfused torch ops up to the last bit of fp32 reductions and
transcendental functions. Rows are addressed with int64 (slots times Hkv x D overflow int32).

Reductions use tl.reduce with the standard combiner (see triton_attention.py: tl.sum is itself a jit function,
frozen into compiled or interpreted form at import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import kernel, next_pow2

_sum_combine = tl.standard._sum_combine
_MAX_ROW = 65536  # widest row one program normalizes in registers


def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(sum_ptr.dtype.element_ty)  # the residual stream stays in the model dtype
        tl.store(sum_ptr + row * stride_s + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.reduce(x * x, 0, _sum_combine) / n_cols + eps)
    normed = x * rstd
    if ROUND_NORMED:  # half precision: the norm is cast to the model dtype before the weight multiplies it
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) over rows of x [..., N]; residual None: (RMSNorm(x), x)."""
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,) and n_cols <= _MAX_ROW
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    summed = x2
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        res2 = residual.reshape(-1, n_cols)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        summed = torch.empty_like(out)
    else:
        res2 = x2
    if x2.shape[0]:
        kernel(_add_rms_norm_kernel)[(x2.shape[0],)](
            x2, res2, weight, out, summed, n_cols, float(eps),
            x2.stride(0), res2.stride(0), out.stride(0), summed.stride(0),
            HAS_RESIDUAL=residual is not None, ROUND_NORMED=x.dtype != torch.float32,
            BLOCK=next_pow2(n_cols), num_warps=_warps(n_cols),
        )
    return out.view(x.shape), (x if residual is None else summed.view(x.shape))


def _silu_and_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    n_cols = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * n_cols)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    out = torch.empty((gu.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(n_cols))
    if gu.shape[0]:
        kernel(_silu_and_mul_kernel)[(gu.shape[0], triton.cdiv(n_cols, block))](
            gu, out, n_cols, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n_cols)


def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
    qw_ptr, kw_ptr, num_q_heads, num_kv_heads, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
    stride_cb, stride_ct, stride_ch,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, Q_BLOCKS: tl.constexpr, QK_NORM: tl.constexpr,
):
    """Program (token, head block): head blocks [0, Q_BLOCKS) rotate q heads into q_out; the others rotate
    k heads into the cache slot of the token and copy its v heads there (a negative slot writes nothing)."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    dt = q_out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = ROT_DIM // 2
    # rotate_half: channel d < half takes -x[d + half] * sin, channel half <= d < ROT_DIM takes x[d - half];
    # channels past ROT_DIM pass through (cos 1, sin 0: x * 1 + x * 0 is x exactly).
    rotary = d < ROT_DIM
    partner = tl.where(d < half, d + half, tl.where(rotary, d - half, d))
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_table + d, mask=rotary, other=1.0).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + d, mask=rotary, other=0.0).to(dt).to(tl.float32)
    sin = tl.where(d < half, -sin, sin)
    if block < Q_BLOCKS:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        num_heads = num_q_heads
        src = q_ptr + token * stride_qt + heads[:, None] * stride_qh
        w_ptr = qw_ptr
    else:
        heads = (block - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        num_heads = num_kv_heads
        src = k_ptr + token * stride_kt + heads[:, None] * stride_kh
        w_ptr = kw_ptr
    mask = (heads < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # per-head RMSNorm (fp32 inside, rounded, times the weight in the model dtype)
        rstd = tl.rsqrt(tl.reduce(x * x, 1, _sum_combine) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
        x_partner = ((x_partner * rstd).to(dt).to(tl.float32) * w_partner[None, :]).to(dt).to(tl.float32)
    rotated = (x * cos[None, :]).to(dt).to(tl.float32) + (x_partner * sin[None, :]).to(dt).to(tl.float32)
    rotated = rotated.to(dt)
    if block < Q_BLOCKS:
        tl.store(q_out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], rotated, mask=mask)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + heads[:, None] * stride_ch \
            + d[None, :]
        write = mask & ((heads * 0 + slot) >= 0)[:, None]  # a tensor mask (the interpreter wants one)
        tl.store(k_cache_ptr + dst, rotated.to(k_cache_ptr.dtype.element_ty), mask=write)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=write)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=write)


def rope_write_kv_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm=None, k_norm=None,
                         eps: float = 0.0) -> torch.Tensor:
    """See pagedchat.kernels.rope_write_kv."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and q.stride(-1) == k.stride(-1) == 1
    assert v.stride(-1) == 1 and k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and cos.shape == sin.shape and cos.stride(-1) == 1
    assert cos.stride() == sin.stride() and cos.shape[-1] <= head_dim and cos.shape[-1] % 2 == 0
    assert (q_norm is None) == (k_norm is None)
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    block_d = max(16, next_pow2(head_dim))
    # tiles of <= 1024 elements: a decode step has few tokens, so more, smaller programs finish sooner
    block_h = max(1, min(next_pow2(max(num_q_heads, num_kv_heads)), 1024 // block_d))
    q_blocks, kv_blocks = triton.cdiv(num_q_heads, block_h), triton.cdiv(num_kv_heads, block_h)
    weights = (q_norm, k_norm) if q_norm is not None else (cos, cos)  # unread without QK_NORM
    kernel(_rope_write_kv_kernel)[(num_tokens, q_blocks + kv_blocks)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, *weights,
        num_q_heads, num_kv_heads, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, ROT_DIM=cos.shape[-1], BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        Q_BLOCKS=q_blocks, QK_NORM=q_norm is not None, num_warps=4,
        enable_fp_fusion=False,  # x * cos + x' * sin rounded as two products and a sum, as torch does in fp32
    )
    return q_out


def _warps(n_cols: int) -> int:
    return 4 if n_cols <= 4096 else 8 if n_cols <= 16384 else 16
