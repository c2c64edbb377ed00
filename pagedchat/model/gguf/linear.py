"""GGUFLinear: a linear layer whose weight stays in the GGUF file's block format.

Why dequantize per layer, per call: memory. The model stays resident at the file's size (Q4_K is 4.5 bits a
weight, not bf16's 16), and only one layer's weight is dense at a time, a transient the size of the largest
layer. The cost is a dequantization per forward; speed is for kernels that read the blocks directly: on CUDA
the Triton kernels (kernels/triton_gguf.py) multiply by each part as stored, on the CPU the native decode step
does (pagedchat/native/step.py binds these parts). The dequantizing path is what both are checked against.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F
from torch import nn

from pagedchat.model.gguf.quants import SUPPORTED, dequantize_into, row_bytes, type_name


CHUNK_ROWS = 16384   # rows dequantized at a time in forward (a transient of 16384 x in values)


class GGUFLinear(nn.Module):
    """y = x W^T + b with W the parts' rows stacked in order: [(raw uint8 [rows_i, row_bytes_i], qtype_i), ...].
    Several parts because our models fuse q/k/v (and gate/up) into one layer while the file keeps them apart,
    each in its own type (q and k Q5_0, v Q8_0 is common)."""

    def __init__(self, parts: list[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if not parts:
            raise ValueError("a GGUFLinear needs at least one part")
        self.in_features = in_features
        self.qtypes = []
        for i, (raw, qtype) in enumerate(parts):
            if qtype not in SUPPORTED:
                raise ValueError(f"part {i}: cannot dequantize GGUF type {type_name(qtype)}")
            expected = row_bytes(qtype, in_features)
            if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected:
                raise ValueError(f"part {i}: expected uint8 [rows, {expected}] {type_name(qtype)} rows of "
                                 f"{in_features} values, got {raw.dtype} {tuple(raw.shape)}")
            self.register_buffer(f"part{i}", raw)   # a buffer: .to(device) moves it
            self.qtypes.append(int(qtype))
        self.out_features = sum(raw.shape[0] for raw, _ in parts)
        self.register_buffer("bias", bias)

    @property
    def parts(self) -> list[tuple[torch.Tensor, int]]:
        return [(getattr(self, name), qtype) for name, qtype in zip(self.part_names, self.qtypes)]

    @property
    def part_names(self) -> list[str]:
        """The buffers holding the parts' bytes, in order: the native decode step moves them into its weight
        arena by assigning a view there (same bytes) to each name (pagedchat/native/step.py gather_weights)."""
        return [f"part{i}" for i in range(len(self.qtypes))]

    def dequantized(self, dtype: torch.dtype = torch.float32, transient: bool = False) -> torch.Tensor:
        """The whole weight [out_features, in_features] in `dtype`, each part written into its rows; transient:
        in this thread's scratch buffer (valid until the next transient weight)."""
        shape = (self.out_features, self.in_features)
        weight = _transient(shape, dtype, self.part0.device) if transient else \
            torch.empty(shape, dtype=dtype, device=self.part0.device)
        row = 0
        for raw, qtype in self.parts:
            dequantize_into(raw, qtype, weight[row:row + raw.shape[0]])
            row += raw.shape[0]
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and all(type_name(qtype) in _triton_types() for qtype in self.qtypes):
            return self.triton_forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.out_features <= CHUNK_ROWS:
            return F.linear(x, self.dequantized(x.dtype, transient=True), bias)
        # A large layer (a 262k-token LM head) a slice of rows at a time: its dense transient stays small.
        y = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
        row = 0
        for raw, qtype in self.parts:
            for r in range(0, raw.shape[0], CHUNK_ROWS):
                rows = raw[r:r + CHUNK_ROWS]
                w = _transient((rows.shape[0], self.in_features), x.dtype, x.device)
                dequantize_into(rows, qtype, w)
                y[..., row + r:row + r + rows.shape[0]] = F.linear(x, w)
            row += raw.shape[0]
        return y if bias is None else y + bias

    def triton_forward(self, x: torch.Tensor) -> torch.Tensor:
        """forward() on the Triton kernels: one launch per part, each writing its columns of the output (also
        run by the tests on CPU under the Triton interpreter)."""
        from pagedchat.kernels import gguf_matmul_triton

        flat = x.reshape(-1, self.in_features)
        y = torch.empty((flat.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        row = 0
        for raw, qtype in self.parts:
            gguf_matmul_triton(flat, raw, type_name(qtype), out=y[:, row:row + raw.shape[0]])
            row += raw.shape[0]
        if self.bias is not None:
            y += self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        types = "+".join(type_name(qtype) for qtype in self.qtypes)
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


def runs_of_one_type(parts: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """Adjacent parts of one type joined into one (their rows stacked in order; the weight is unchanged). On CUDA
    each part is a kernel launch per step, and a Q4_K_M file keeps q and k (often v), gate and up in one type:
    a batch-1 step of a 16-layer model launches 40 fewer kernels. Not on the CPU: the native step maps each
    part's file pages into its arena as they are, where joining would first copy them all."""
    joined: list[tuple[list[torch.Tensor], int]] = []
    for raw, qtype in parts:
        if joined and joined[-1][1] == qtype:
            joined[-1][0].append(raw)
        else:
            joined.append(([raw], qtype))
    return [(raws[0] if len(raws) == 1 else torch.cat(raws), qtype) for raws, qtype in joined]


_scratch = threading.local()


def _transient(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor for a dense weight that lives for one F.linear. On the CPU one buffer per thread
    is reused: a new allocation of a layer's size (megabytes) is a fresh mapping the kernel page-faults in again
    at every layer of every step, which cost as much as the dequantization itself. (CUDA's caching allocator
    reuses memory already.)"""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = shape[0] * shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < n:
        buf = _scratch.buf = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


@functools.lru_cache(maxsize=None)
def _triton_types() -> frozenset[str]:
    """The GGUF types the Triton kernels multiply as stored; none where Triton is missing or unusable."""
    from pagedchat import kernels

    if not kernels.HAS_TRITON or getattr(kernels, "gguf_matmul_triton", None) is None:
        return frozenset()
    from pagedchat.kernels.triton_gguf import FORMATS

    return frozenset(FORMATS)
