"""How a checkpoint becomes a model's parameters: the model built empty (no memory, no init) on the device,
and each checkpoint tensor's name mapped to the parameter (and rows of a fused projection) it fills.

Shared by the loader and the families that map some names themselves (Gemma's vision-language prefixes, the
MoE experts' stacked tensors); imports nothing else of pagedchat.model but the ArchSpec it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedchat.model.llama import ArchSpec


def materialize(make: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build a module on the meta device (no memory, no init) and give every parameter and buffer
    uninitialized storage on `device` (the checkpoint fills it). Not Module.to_empty: on meta tensors that
    runs torch's Python reference ops, which import sympy (0.5 s of start-up)."""
    with torch.device("meta"):
        module = make()
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:  # tied tensors stay one tensor
                    kind = dtype if tensor.dtype.is_floating_point else tensor.dtype
                    fresh = torch.empty(tuple(tensor.shape), dtype=kind, device=device)
                    made[id(tensor)] = nn.Parameter(fresh, requires_grad=False) \
                        if isinstance(tensor, nn.Parameter) else fresh
                table[name] = made[id(tensor)]
    return module


def param_target(name: str, spec: ArchSpec) -> tuple[str, int, int] | None:
    """Checkpoint tensor name -> (our parameter, row offset, rows) for the fused projections. A model may
    map names itself (`param_target`, e.g. expert weights into stacked tensors: (parameter, (expert,
    row offset), rows))."""
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name:
        return None
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    shards = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
              "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in shards:
        fused, offset, rows = shards[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), offset, rows
    return name, 0, -1


def target_of(model: nn.Module, name: str) -> tuple[str, int | tuple[int, int], int] | None:
    """Where checkpoint tensor `name` goes in `model` (its own mapping if it has one), or None to skip it:
    also None for a tied LM head, which is the embedding."""
    target = model.param_target(name) if hasattr(model, "param_target") else param_target(name, model.spec)
    if target is None or (target[0] == "lm_head.weight" and model.spec.tie_embeddings):
        return None
    return target


def target_rows(param: torch.Tensor, offset: int | tuple[int, int], rows: int) -> torch.Tensor:
    """The part of a parameter a checkpoint tensor fills: all of it, some rows of a fused projection, or an
    expert's rows of a stacked tensor (offset = (expert, row offset))."""
    dest = param.data
    if isinstance(offset, tuple):
        dest, offset = dest[offset[0]], offset[1]
    return dest if rows < 0 else dest.narrow(0, offset, rows)
