"""Pure-torch twins of the fused layer kernels (kernels/triton_fused.py): the test oracle (run them in float64)
and what `backend="torch"` runs.

They round exactly where transformers' Llama forward rounds, so the fused path gives the same numbers as the
unfused one in every dtype:
  * RMSNorm: the residual sum in the model dtype; the norm in fp32 (x * rsqrt(mean(x^2) + eps)), cast to the
    model dtype, then times the weight in the model dtype (in fp32 the two products are rounded in fp32);
  * SiLU x up: silu in fp32, rounded, then times up in the model dtype;
  * rotary: cos/sin rounded to the model dtype, x * cos and rotate_half(x) * sin each rounded, then summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import write_kv_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dimension (fp32 inside, the input dtype out; float64 stays float64)."""
    inner = torch.float64 if x.dtype == torch.float64 else torch.float32
    normed = torch.rms_norm(x.to(inner), (x.shape[-1],), eps=eps)
    if x.dtype == inner:
        return normed * weight.to(inner)
    return weight.to(x.dtype) * normed.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x). The sum is in x's dtype."""
    summed = x if residual is None else x + residual
    return rms_norm_ref(summed, weight, eps), summed


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns, then up columns) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, H, D] with cos/sin rows [T, R] (R <= D: the channels past R pass through)."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    part = x[..., :rot]
    half = rot // 2
    rotated = part * cos + torch.cat((-part[..., half:], part[..., :half]), dim=-1) * sin
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x[..., rot:]), dim=-1)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Rotary of q [T, Hq, D] and k [T, Hkv, D] at `positions` (tables cos/sin [max_pos, R], fp32), k and v
    written to their slots (negative slots skipped); returns the rotated q. q_norm / k_norm: per-head RMSNorm
    weights [D] applied before the rotation (Qwen3)."""
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    cos_rows, sin_rows = cos[positions], sin[positions]
    write_kv_ref(rotate_ref(k, cos_rows, sin_rows), v, k_cache, v_cache, slot_mapping)
    return rotate_ref(q, cos_rows, sin_rows)
