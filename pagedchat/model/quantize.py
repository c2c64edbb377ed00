"""Weight-only int8 (`--quantize int8`): every linear layer's weight as int8 with one fp scale per output
channel (symmetric, max-abs / 127), quantized at load time from the fp checkpoint.

On CPU the matmul is torch's int8 weight-packed kernel (`_weight_int8pack_mm`), which reads a quarter of
the fp32 weight bytes; it runs on bf16 activations (its fp32 variant is several times slower than a plain
fp32 matmul), so the layer casts its input to bf16 and scales its output in fp32. Elsewhere the weight is
dequantized per call: same numbers, no speed-up. Accuracy against fp32 is measured by
scripts/int8_accuracy.py (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import nn

METHODS = ("int8",)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        # The kernel wants bf16 scales; bf16 would move a whole channel by up to 0.4%, so it gets ones and
        # the fp32 scales are applied to its output.
        self.register_buffer("ones", torch.ones(self.weight.shape[0], dtype=torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            rows = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight,
                                             self.ones)
            out = (rows.to(self.scales.dtype) * self.scales).view(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            out = nn.functional.linear(x, self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None])
        return out if self.bias is None else out + self.bias


def quantize_model(model: nn.Module, method: str) -> None:
    """Replace every nn.Linear in `model` by its quantized form, in place."""
    assert method in METHODS, f"unknown quantization {method!r}"
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
