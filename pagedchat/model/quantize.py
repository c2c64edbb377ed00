"""Weight-only quantization, at load time from the fp checkpoint. The embedding stays in the model's dtype (a
tied LM head gets its own quantized copy).

`--quantize int8`: every linear layer's weight as int8 with one fp32 scale per output channel (symmetric,
max-abs / 127).

On CPU, a few rows at a time (decode) go through torch's int8 weight-packed kernel (`_weight_int8pack_mm`),
which reads a quarter of the fp32 weight bytes. It runs on bf16 activations (its fp32 variant is several times
slower than a plain fp32 matmul), so the layer casts its input to bf16 and scales the output in fp32. Many rows
at once (prefill) and other devices dequantize the weight for one fp matmul instead: the packed kernel is a
matrix-vector loop, ~3x slower than fp32 GEMM on 512 rows, while dequantizing costs one weight-sized pass.
Accuracy against fp32: `pagedchat bench accuracy`, docs/benchmarks.md.

`--quantize int4`: groups of 32 weights with one float16 scale each (model/int4.py: the layout, and why 32).
A layer whose input width is not a multiple of 32 stays int8 (a one-line note says how many). On CUDA the
matmul is the Triton kernel (kernels/triton_int4.py). On CPU, a few rows go through torch's int4 CPU kernel
(`_weight_int4pack_mm_for_cpu`) on a copy of the weight in its own tiled layout, made at the first such call
(a model whose decode steps run natively never needs it); like the int8 kernel it runs on bf16 activations
(fp32 ones take a scalar loop, 50x slower) and so with bf16 scales. More rows dequantize the weight for one
fp matmul (the kernels' torch twin): the int4 kernel's time grows with the rows, dequantizing costs a fixed
~1 ns per weight. Measured on one 512x1536 layer (1 thread, min of 40, 2-core AMD EPYC AVX2, shared machine):
1 row 0.19 ms packed against 0.93 ms dequantized (fp32 0.31, int8 0.26), 16 rows 0.77 vs 1.94, 32 rows 1.49
vs 2.27, 64 rows 3.2 vs 3.4: the packed kernel up to 32 rows.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedchat import kernels
from pagedchat.model.int4 import GROUP, quantize_int4, supports as int4_supports, unpack_int4
from pagedchat.model.layers import linear_children

log = logging.getLogger("pagedchat.model")

METHODS = ("int8", "int4")
# Above this many rows the dequantize-then-GEMM path is faster than the packed kernel (measured on the 2-core
# AVX-512 CPU, 512x3072: packed 0.42 ms at 1 row, 3-5 ms at 16, 110 ms at 512; dequantize + fp32 GEMM 59 ms).
PACKED_MAX_ROWS = 16
# The CPU kernel vectorizes along in_features and returns garbage (or crashes) when it is not a multiple of its
# vector width: checked with torch 2.13, AVX-512. Layers that are not go through the dequantized matmul.
PACKED_IN_MULTIPLE = 16


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        # The kernel wants bf16 scales; bf16 would move a whole channel by up to 0.4%, so it gets ones and
        # the fp32 scales are applied to its output.
        self.register_buffer("ones", torch.ones(self.weight.shape[0], dtype=torch.bfloat16, device=weight.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = weight.device.type == "cpu" and self.in_features % PACKED_IN_MULTIPLE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.packed and rows.shape[0] <= PACKED_MAX_ROWS:
            out = self.packed_matmul(rows)
        else:
            out = self.dequantized_matmul(rows)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.weight, self.ones)
        # bf16 x fp32 promotes to fp32: the same exact upcast and fp32 product as out.float() * scales, one op
        return torch.mul(out, self.scales).to(rows.dtype)

    def dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dtype == torch.float16:  # fp16's range cannot hold the unscaled sums: scale the weight first
            return nn.functional.linear(rows, self.weight.to(rows.dtype) * self.scales.to(rows.dtype)[:, None])
        # int8 values are exact in bf16 and fp32, so the scales can wait for the (fp32) output
        out = nn.functional.linear(rows, self.weight.to(rows.dtype))
        return (out.float() * self.scales).to(rows.dtype)


# Up to this many rows the CPU takes torch's int4 kernel (measured: see the module's docstring).
CPU_PACKED_MAX_ROWS = 32
# torch's int4 CPU layout tiles the output features by 16.
CPU_PACKED_OUT_MULTIPLE = 16
# Rows converted at a time (bounds the int32 temporary of a large LM head): a multiple of its 64-row tiles,
# so the pieces concatenate to the whole layer's layout (checked with torch 2.13).
_CONVERT_ROWS = 4096


class Int4Linear(nn.Module):
    """`packed` uint8 [out, in / 2] and `scales` float16 [out, in / 32] (model/int4.py; the native CPU step
    binds to these two names), `bias` as the layer had it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        packed, scales = quantize_int4(linear.weight.detach())
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.backend = "auto"  # "triton": the Triton kernel on CPU tensors too (under TRITON_INTERPRET, tests)
        self.cpu_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's int4 layout, when made

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        on_cpu = rows.device.type == "cpu" and self.backend != "triton"
        if on_cpu and rows.shape[0] <= CPU_PACKED_MAX_ROWS and self.out_features % CPU_PACKED_OUT_MULTIPLE == 0:
            out = self.cpu_packed_matmul(rows)
        else:
            out = kernels.int4_matmul(rows, self.packed, self.scales, backend="torch" if on_cpu else self.backend)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def cpu_packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.cpu_weight is None:
            self.cpu_weight = cpu_int4_weight(self.packed, self.scales)
        weight, scales_and_zeros = self.cpu_weight
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), weight, GROUP, scales_and_zeros)
        return out.to(rows.dtype)


def cpu_int4_weight(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our layout -> torch's int4 CPU kernel's: its tiled nibbles (from values 0..15, i.e. q + 8), and per
    group a bf16 (scale, zero) pair, [in / 32, out, 2], for its w = (value - 8) * scale + zero."""
    weight = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        unpack_int4(packed[r:r + _CONVERT_ROWS]).to(torch.int32) + 8, 1) for r in range(0, len(packed), _CONVERT_ROWS)])
    d = scales.T.to(torch.bfloat16)
    return weight, torch.stack((d, torch.zeros_like(d)), dim=-1).contiguous()


def quantize_model(model: nn.Module, method: str) -> None:
    """Replace every nn.Linear in `model` by its quantized form, in place, except those a module names in
    its `unquantized` (MoE routers). Weights that are not nn.Linear (MoE experts' stacked tensors) stay fp.
    int4 keeps int8 for layers whose input width it cannot group."""
    assert method in METHODS, f"unknown quantization {method!r}"
    layers = [(m, name, child) for m, name, child in linear_children(model)
              if name not in getattr(m, "unquantized", ())]
    narrow = 0
    for module, name, child in layers:
        if method == "int4" and int4_supports(child.in_features):
            setattr(module, name, Int4Linear(child))
        else:
            narrow += method == "int4"
            setattr(module, name, Int8Linear(child))
    if narrow:
        log.warning("pagedchat: --quantize int4: %d of %d linear layers stay int8 (their input width is not a "
                    "multiple of 32)", narrow, len(layers))
