"""The Triton interpreter casts fp32 to bf16 by truncation, where the GPU (LLVM fptrunc) rounds to nearest
even; fp16 is rounded by numpy, correctly. `gpu_rounding()` makes the interpreter round bf16 as the GPU does,
so interpreter tests can compare bf16 kernels bit for bit with torch."""

from __future__ import annotations

import contextlib

import numpy as np
import torch


@contextlib.contextmanager
def gpu_rounding():
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    truncate = InterpreterBuilder.create_fp_trunc

    def round_to_nearest_even(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return TensorHandle(rounded.view(torch.uint16).numpy().reshape(src.data.shape), dst_type.scalar)
        return truncate(self, src, dst_type)

    InterpreterBuilder.create_fp_trunc = round_to_nearest_even
    try:
        yield
    finally:
        InterpreterBuilder.create_fp_trunc = truncate
