"""fp32 linear layers on CPU: a second copy of each weight packed once at load into the blocked layout oneDNN's
matmul reads (`torch.ops.mkldnn._linear_pointwise`: the path inductor's CPU weight freezing takes), for the
matmuls of a few rows and more.

Why: MKL's fp32 GEMM behind nn.Linear runs a few rows at a time far below the memory-bandwidth floor. Every
layer of the small llama on the 2-core AVX-512 CPU, interleaved A/B (a harness since removed: `git show
247beda:scripts/bench_packed.py`): 4-6 rows 1.4x faster packed, 16 rows 1.1-1.2x, 64 rows 1.05x, 512 rows the
same. Those are the shapes of speculative verification (1 + k rows per sequence), batched decode (serve,
variants) and short extends. Up to 3 rows (batch-1 decode, two variants) MKL is as fast or ~10% faster: the
plain weight stays for them.

The copy costs memory, so it is made only while the copies stay a small share of the RAM still available.
Small weights stay plain: oneDNN's per-call cost (~20 us) outweighs its gain below about 1 MiB (the demo
model's 192-wide layers: 6 rows 0.7x, 16 rows 0.9x of MKL). A tied LM head (the embedding's table) stays
plain too. Results differ from MKL's by float rounding (another summation order), as one GEMM shape already
differs from another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedchat.memory import available_ram
from pagedchat.model.layers import linear_children

# The row count oneDNN picks its packed layout for: the few-row matmuls this exists for.
PACK_FOR_ROWS = 8
# From this many rows on the packed copy is used: MKL's kernels win below (small llama, interleaved A/B:
# 1 row 0.90x, 2 rows 0.90x, 3 rows 0.99x, 4 rows 1.43x; AVX-512, the harness named above).
PACKED_MIN_ROWS = 4
# The packed copies may take at most this share of the RAM still available after loading.
MAX_RAM_SHARE = 0.25
# Weights with fewer elements stay plain (see above): 512 x 512, the smallest layer of the small llama, is in.
MIN_ELEMENTS = 1 << 18


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available() \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """The plain weight for fewer than PACKED_MIN_ROWS rows, the packed copy for more."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] < PACKED_MIN_ROWS:
            out = F.linear(rows, self.weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Give every nn.Linear of at least MIN_ELEMENTS whose weight nothing else uses a packed copy (in place),
    if the copies fit in MAX_RAM_SHARE of the available RAM; how many were packed."""
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    targets = [(module, name, child) for module, name, child in linear_children(model)
               if counts.get(id(child.weight)) == 1 and child.weight.numel() >= MIN_ELEMENTS]
    extra = sum(child.weight.numel() * child.weight.element_size() for _, _, child in targets)
    if extra > MAX_RAM_SHARE * available_ram():
        return 0
    for module, name, child in targets:
        setattr(module, name, PackedLinear(child))
    return len(targets)
