"""Launch helpers shared by the Triton kernels (imported only when triton is installed)."""

from __future__ import annotations

import functools

import torch
import triton
from triton import knobs

# Interpreter-only stand-in for the SM count, so the split heuristic is deterministic on CPU.
_CPU_SM_COUNT = 4


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read at call time."""
    return bool(knobs.runtime.interpret)


@functools.lru_cache(maxsize=None)
def _jitted(fn, interpret: bool):
    # triton.jit picks InterpretedFunction vs JITFunction from TRITON_INTERPRET when it runs, so it
    # runs here, at the first launch, instead of at import: importing pagedchat.kernels before the
    # variable is set (pytest collection order) must not pin the compiled path on a CPU-only machine.
    del interpret  # part of the cache key only
    return triton.jit(fn)


def kernel(fn):
    """The launchable Triton kernel for the plain Python function `fn` in the current mode."""
    return _jitted(fn, interpreting())


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _CPU_SM_COUNT


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently use TF32 tensor cores (~1e-3 relative error); ask for IEEE fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, block_size, Hkv, D], same strides (kernels share one offset), D unit-stride."""
    assert k_cache.dim() == 4, "cache layout is [num_blocks, block_size, num_kv_heads, head_dim]"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), \
        "k_cache and v_cache must have the same shape and strides"
    assert k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device
    assert k_cache.stride(-1) == 1, "head_dim of the caches must be contiguous"
