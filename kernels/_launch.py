"""Launch helpers shared by the Triton kernels (imported only when triton is installed)."""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton import knobs

LOG2E = math.log2(math.e)
# tl.max / tl.sum / tl.zeros / tl.cdiv are themselves @triton.jit functions, frozen into compiled or
# interpreted form when triton is first imported. Reducing with their combine functions directly (and
# using tl.full and integer arithmetic) keeps the kernels runnable by the interpreter whatever the
# TRITON_INTERPRET value was at import time; the interpreter maps these two combiners to numpy.
MAX_COMBINE = tl.standard._elementwise_max
SUM_COMBINE = tl.standard._sum_combine
NEG_BIG = tl.constexpr(-1e30)  # initial running max: finite, far below any real score
LOG2E_C = tl.constexpr(LOG2E)

# Interpreter-only stand-in for the SM count, so the split heuristic is deterministic on CPU.
_CPU_SM_COUNT = 4


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read at call time."""
    return bool(knobs.runtime.interpret)


def varies_per_step(*names: str):
    """Mark a kernel's integer arguments that change from step to step (a batch size, a row count, the width of
    the step's block tables). Triton would otherwise compile a variant for each value that is 1 or a multiple of
    16 as it first meets it: seconds of compiling in the middle of a conversation, for no faster code (these
    values bound loops and masks; they address nothing that vectorizes)."""
    def mark(fn):
        fn.__pagedchat_varies_per_step__ = names
        return fn
    return mark


def device_function(fn):
    """Mark a plain function that kernels call: it is jitted together with them, in their mode."""
    fn.__pagedchat_device_function__ = True
    return fn


@functools.lru_cache(maxsize=None)
def _jitted(fn, interpret: bool):
    # triton.jit picks InterpretedFunction vs JITFunction from TRITON_INTERPRET when it runs, so it
    # runs here, at the first launch, instead of at import: importing pagedchat.kernels before the
    # variable is set (pytest collection order) must not pin the compiled path on a CPU-only machine.
    # The interpreter runs the kernel as Python, calling its plain helpers as they are; the compiler
    # only calls jitted functions, so the compiled kernel sees its module's helpers jitted too.
    unspecialized = getattr(fn, "__pagedchat_varies_per_step__", ())
    if interpret:
        return triton.jit(fn, do_not_specialize=unspecialized)
    return triton.jit(_with_jitted_helpers(fn), do_not_specialize=unspecialized)


def _with_jitted_helpers(fn):
    """`fn` over a copy of its module's globals in which every device function is jitted."""
    names = (name for name in fn.__code__.co_names if name in fn.__globals__)  # the globals fn reads
    helpers = {name: _jitted(fn.__globals__[name], False) for name in names
               if getattr(fn.__globals__[name], "__pagedchat_device_function__", False)}
    if not helpers:
        return fn
    clone = types.FunctionType(fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__,
                               fn.__closure__)
    clone.__module__, clone.__qualname__, clone.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    # Triton reads which parameters are constexpr from the annotations: a clone without them would make every
    # tl.constexpr an ordinary argument (and a str one, such as PRECISION, fails to launch).
    clone.__annotations__, clone.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
    return clone


def kernel(fn):
    """The launchable Triton kernel for the plain Python function `fn` in the current mode."""
    return _jitted(fn, interpreting())


def compiled(fn):
    """`fn` as a compiled-mode JITFunction whatever the mode (for ahead-of-time compiles)."""
    return _jitted(fn, False)


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


@dataclass
class Launch:
    """One kernel launch, described before it runs: run it, or compile it ahead of time for another GPU."""
    fn: object              # the plain kernel function
    grid: tuple
    args: tuple             # runtime arguments, in the kernel's order (they come before its constexprs)
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def __call__(self) -> None:
        kernel(self.fn)[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                                   num_stages=self.num_stages)
