"""Weight-only int8 (`--quantize int8`): every linear layer's weight as int8 with one fp32 scale per output
channel (symmetric, max-abs / 127), quantized at load time from the fp checkpoint. The embedding stays in the
model's dtype (a tied LM head gets its own int8 copy).

On CPU, a few rows at a time (decode) go through torch's int8 weight-packed kernel (`_weight_int8pack_mm`),
which reads a quarter of the fp32 weight bytes. It runs on bf16 activations (its fp32 variant is several times
slower than a plain fp32 matmul), so the layer casts its input to bf16 and scales the output in fp32. Many rows
at once (prefill) and other devices dequantize the weight for one fp matmul instead: the packed kernel is a
matrix-vector loop, ~3x slower than fp32 GEMM on 512 rows, while dequantizing costs one weight-sized pass.
Accuracy against fp32: `pagedchat bench accuracy`, docs/benchmarks.md.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedchat.model.layers import linear_children

METHODS = ("int8",)
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


def quantize_model(model: nn.Module, method: str) -> None:
    """Replace every nn.Linear in `model` by its quantized form, in place, except those a module names in
    its `unquantized` (MoE routers). Weights that are not nn.Linear (MoE experts' stacked tensors) stay fp."""
    assert method in METHODS, f"unknown quantization {method!r}"
    for module, name, child in linear_children(model):
        if name not in getattr(module, "unquantized", ()):
            setattr(module, name, Int8Linear(child))
