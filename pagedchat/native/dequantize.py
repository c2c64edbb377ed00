"""GGUF blocks dequantized by the native library (decode.c pc_dequantize) wherever the torch path dequantizes.

Why: a step on the torch path (a long prefill, a family or format the native step does not take) dequantizes
each GGUF layer per call (pagedchat/model/gguf/linear.py keeps only the blocks resident). In torch ops that was
about half of a 512-token prefill of Gemma 3's Q4_K_M file; the library does it in a loop per block, in the
same float32 operations, so the weights are bit for bit those of pagedchat/model/gguf/quants.py and nothing the
torch path computes changes. Installed once per process, when the library is loaded (engine/core/runner.py).
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import c_int, c_int64, c_void_p

import torch

from pagedchat.model.gguf import quants
from pagedchat.native.abi import GGML_BLOCKS

# the block formats decode.c dequantizes: those its step multiplies (the float ones are a view and a cast in
# torch already)
TYPES = GGML_BLOCKS


def dequantize(lib: ctypes.CDLL, blocks: torch.Tensor, qtype: int, values: torch.Tensor) -> bool:
    """quants.FastDequantizer: blocks uint8 [n, type_size] -> values [n, block_size] where the library can
    (float32 and contiguous on the CPU, a type it knows); False leaves them to the torch functions."""
    if qtype not in TYPES or values.dtype != torch.float32 or blocks.device.type != "cpu" \
            or values.device.type != "cpu" or not blocks.is_contiguous() or not values.is_contiguous():
        return False
    rc = lib.pc_dequantize(qtype, blocks.data_ptr(), blocks.shape[0], values.data_ptr(), torch.get_num_threads())
    assert rc == 0, f"pc_dequantize refused type {qtype}"
    return True


def install(lib: ctypes.CDLL) -> None:
    """Route every GGUF dequantization of this process through `lib` (where it can)."""
    lib.pc_dequantize.restype = c_int
    lib.pc_dequantize.argtypes = [c_int64, c_void_p, c_int64, c_void_p, c_int]
    quants.use_fast_dequantizer(functools.partial(dequantize, lib))
