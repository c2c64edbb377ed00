"""Paged KV-cache kernels: Triton on the GPU, pure torch elsewhere.

Importable only as `pagedchat.kernels` (relative imports only; nothing of pagedchat is imported here).

Dispatch rule of every entry point (backend="auto", the default):
  * Triton kernel when Triton imports, the dtype is fp16/bf16/fp32 and either the tensors are on CUDA or
    TRITON_INTERPRET=1 is set (the Triton interpreter then runs the kernel on CPU tensors);
  * otherwise the pure-torch twin (`*_ref`), which is also the float64 oracle.
backend="triton" or backend="torch" forces a path.

Quantized pools (kv_quant.py: int8 / float8 values + float16 scales per slot and KV head) pass `k_scale=` and
`v_scale=` to every entry point. The Triton kernels (v2) read and write them on the GPU; elsewhere the torch
twins do.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

import torch

from .fused_reference import add_rms_norm_ref, rope_write_kv_ref, silu_and_mul_ref
from .int4_reference import int4_dequantize, int4_matmul_ref
from .moe_reference import fused_moe_ref
from .reference import (
    copy_blocks_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)
from .windowed_reference import (
    paged_decode_attention_windowed_ref,
    paged_prefill_attention_windowed_ref,
)

# Triton itself is imported on first use only: the import costs a fifth of a second of every CPU start-up,
# where the torch path runs anyway.
HAS_TRITON = importlib.util.find_spec("triton") is not None
_TRITON_FUNCTIONS = {"paged_decode_attention_triton": "triton_attention",
                     "paged_prefill_attention_triton": "triton_attention",
                     "write_kv_triton": "triton_cache", "copy_blocks_triton": "triton_cache",
                     "fused_moe_triton": "triton_moe", "int4_matmul_triton": "triton_int4",
                     "gguf_matmul_triton": "triton_gguf",
                     "add_rms_norm_triton": "triton_fused", "silu_and_mul_triton": "triton_fused",
                     "rope_write_kv_triton": "triton_fused"}

__all__ = [
    "HAS_TRITON",
    "add_rms_norm",
    "add_rms_norm_ref",
    "copy_blocks",
    "copy_blocks_all_layers",
    "copy_blocks_ref",
    "fused_moe",
    "fused_moe_ref",
    "int4_dequantize",
    "int4_matmul",
    "int4_matmul_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_windowed_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "paged_prefill_attention_windowed_ref",
    "resolve_backend",
    "rope_write_kv",
    "rope_write_kv_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "triton_interpret_enabled",
    "write_kv",
    "write_kv_ref",
]
if HAS_TRITON:
    __all__ += sorted(_TRITON_FUNCTIONS)


def _triton_loaded() -> bool:
    """Import the Triton kernels once; a Triton whose API moved leaves the torch path alive."""
    global HAS_TRITON
    if not HAS_TRITON:
        return False
    try:
        for module in set(_TRITON_FUNCTIONS.values()):
            importlib.import_module(f".{module}", __name__)
    except (ImportError, AttributeError) as exc:
        HAS_TRITON = False
        warnings.warn(f"pagedchat.kernels: Triton kernels unavailable ({exc!r}); using the torch path",
                      RuntimeWarning, stacklevel=3)
    return HAS_TRITON


def _triton_function(name: str):
    return getattr(importlib.import_module(f".{_TRITON_FUNCTIONS[name]}", __name__), name)


def __getattr__(name: str):
    """The *_triton entry points, importing Triton when first asked for."""
    if name in _TRITON_FUNCTIONS and _triton_loaded():
        return _triton_function(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BACKENDS = ("auto", "triton", "torch")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn)


def triton_interpret_enabled() -> bool:
    """True when TRITON_INTERPRET asks for the Triton interpreter (read at call time, as Triton does)."""
    if _triton_loaded():
        from ._launch import interpreting

        return interpreting()
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Return "triton" or "torch" for a call on `tensors` (the first one decides the device)."""
    backend = backend or "auto"
    assert backend in _BACKENDS, f"backend must be one of {_BACKENDS}, got {backend!r}"
    if backend == "auto":
        runnable = tensors[0].is_cuda or triton_interpret_enabled()
        supported = all(t.dtype in _TRITON_DTYPES for t in tensors)
        backend = "triton" if supported and runnable and _triton_loaded() else "torch"
    if backend == "triton" and not _triton_loaded():
        raise RuntimeError("backend='triton' requested but triton is not installed")
    return backend


def _scales(k_scale, v_scale) -> dict:
    """The scale keywords of a quantized pool's call (none for a float pool: the calls as before)."""
    assert (k_scale is None) == (v_scale is None), "k_scale and v_scale come together"
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out=None, backend=None,
                           sliding_window=None, softcap=None, impl=None, k_scale=None, v_scale=None):
    """q [B, Hq, D] attends to its paged context -> [B, Hq, D] (a zero-length row gives zeros).

    `out` (optional, shape and dtype of q) receives the result and is returned: every row is written.
    `sliding_window` W: only the last W keys are seen (and read); `softcap` c: scores -> c * tanh(s / c).
    `impl` "v1" / "v2": which Triton kernels (default: $PAGEDCHAT_ATTN, else v2; see docs/kernels.md).
    `k_scale`, `v_scale` [num_blocks, block_size, Hkv]: the caches are quantized (kv_quant.py).
    """
    scales = _scales(k_scale, v_scale)
    if resolve_backend(backend, q, k_cache) == "triton":
        decode = _triton_function("paged_decode_attention_triton")
        return decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, impl=impl,
                      sliding_window=sliding_window, softcap=softcap, **scales)
    if sliding_window or softcap:
        return paged_decode_attention_windowed_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                   sliding_window, softcap, out, **scales)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out, **scales)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, *, out=None,
                            backend=None, sliding_window=None, softcap=None, impl=None, k_scale=None, v_scale=None):
    """Causal attention of each sequence's new tokens (the last ones of its context) -> [total_q, Hq, D].

    `out` (optional) receives the result; rows outside every sequence's query range are unspecified.
    `sliding_window` W: the token at position p sees keys p-W+1..p; `softcap`, `impl` and the scales as for
    decode.
    """
    scales = _scales(k_scale, v_scale)
    if resolve_backend(backend, q, k_cache) == "triton":
        prefill = _triton_function("paged_prefill_attention_triton")
        return prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, impl=impl,
                       sliding_window=sliding_window, softcap=softcap, **scales)
    if sliding_window or softcap:
        return paged_prefill_attention_windowed_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                                    scale, sliding_window, softcap, out, **scales)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                       out, **scales)


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, backend=None, k_scale=None, v_scale=None) -> None:
    """Scatter k, v [N, Hkv, D] into the caches at slot_mapping [N]; negative slots are skipped. With
    `k_scale`, `v_scale`, each (token, head) is quantized to the caches' dtype, its scale written beside it."""
    scales = _scales(k_scale, v_scale)
    if resolve_backend(backend, k_cache, k) == "triton":
        return _triton_function("write_kv_triton")(k, v, k_cache, v_cache, slot_mapping, **scales)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping, **scales)


def copy_blocks(k_cache, v_cache, src, dst, *, backend=None, k_scale=None, v_scale=None) -> None:
    """Copy whole blocks src[i] -> dst[i] in one layer's caches (copy-on-write; dst disjoint from src), and
    a quantized pool's scales with them."""
    scales = _scales(k_scale, v_scale)
    if resolve_backend(backend, k_cache) == "triton":
        return _triton_function("copy_blocks_triton")(k_cache, v_cache, src, dst, **scales)
    return copy_blocks_ref(k_cache, v_cache, src, dst, **scales)


def copy_blocks_all_layers(k_caches, v_caches, src, dst, *, backend=None, k_scales=None, v_scales=None) -> None:
    """copy_blocks over per-layer lists of caches (and of scales: `k_scales`, `v_scales`); the index tensors
    are built once."""
    assert len(k_caches) == len(v_caches)
    if not k_caches:
        return
    device = k_caches[0].device
    src = torch.as_tensor(src, dtype=torch.long, device=device)
    dst = torch.as_tensor(dst, dtype=torch.long, device=device)
    no_scales = [None] * len(k_caches)
    for k_cache, v_cache, k_scale, v_scale in zip(k_caches, v_caches, k_scales or no_scales, v_scales or no_scales):
        copy_blocks(k_cache, v_cache, src, dst, backend=backend, k_scale=k_scale, v_scale=v_scale)


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, backend=None):
    """Mixture-of-experts feed-forward: x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I],
    topk_weights [T, k] (the routing weights, already normalized as the family wants), topk_ids [T, k].
    Returns sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up) with e = topk_ids[t, j]  -> [T, H]."""
    if resolve_backend(backend, x, w13) == "triton":
        return _triton_function("fused_moe_triton")(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def int4_matmul(x, packed, scales, *, backend=None, config=None):
    """x [M, in] times an int4 weight's transpose -> [M, out] in x's dtype: packed uint8 [out, in / 2] and
    scales float16 [out, in / 32] in pagedchat/model/int4.py's layout (groups of 32, Q4_0 nibble order).
    `config` (triton_int4.Int4Config) forces the Triton kernel's choice (benchmarks, tests)."""
    if resolve_backend(backend, x) == "triton":
        return _triton_function("int4_matmul_triton")(x, packed, scales, config)
    return int4_matmul_ref(x, packed, scales)


# -- the fused layer kernels (triton_fused.py; twins in fused_reference.py) ---------------------------------

def add_rms_norm(x, residual, weight, eps, *, backend=None):
    """(RMSNorm(x + residual), x + residual), both in x's dtype, rounded as transformers rounds (the norm in
    fp32, cast, then times the weight). residual None: (RMSNorm(x), x)."""
    if resolve_backend(backend, x) == "triton":
        return _triton_function("add_rms_norm_triton")(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def silu_and_mul(gate_up, *, backend=None):
    """[..., 2I] (gate columns, then up) -> silu(gate) * up [..., I] (silu in fp32, rounded, times up)."""
    if resolve_backend(backend, gate_up) == "triton":
        return _triton_function("silu_and_mul_triton")(gate_up)
    return silu_and_mul_ref(gate_up)


def rope_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm=None, k_norm=None,
                  eps=0.0, backend=None):
    """Rotary (rotate-half layout) of q [T, Hq, D] and k [T, Hkv, D] at `positions` [T], from fp32 tables
    cos/sin [max_positions, R] (R <= D, even: the channels past R pass through); the rotated k and v are
    written to slot_mapping [T] (negative slots skipped) in one pass; returns the rotated q [T, Hq, D]
    (contiguous). q_norm/k_norm [D]: per-head RMSNorm weights applied first (Qwen3), with `eps`."""
    if resolve_backend(backend, k_cache, q) == "triton":
        return _triton_function("rope_write_kv_triton")(q, k, v, positions, cos, sin, k_cache, v_cache,
                                                         slot_mapping, q_norm, k_norm, eps)
    return rope_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps)
