"""Mixture-of-experts layers for Qwen3-MoE and Mixtral: the Llama-family forward with sparse MLPs.

Routing (both families): softmax over the router logits in fp32, the top-k experts, then Mixtral always
renormalizes the k weights to sum to 1 while Qwen3-MoE does so only with `norm_topk_prob`. Neither family
has shared experts (Qwen2-MoE does; it is not supported). The expert matmuls run in
`kernels.fused_moe` (grouped torch matmuls on CPU, one Triton kernel pair on the GPU).

Checkpoints ship experts one by one (`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral `w1/w3/w2`) or
stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); both load into the stacked
`w13` / `w2` parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedchat import kernels
from pagedchat.model.checkpoint import param_target
from pagedchat.model.layers import Linear
from pagedchat.model.llama import ArchSpec, LlamaFamilyModel


@dataclass
class MoESpec:
    num_experts: int
    top_k: int
    expert_size: int
    normalize_topk: bool
    sparse_layers: tuple[bool, ...]     # which decoder layers have a sparse MLP

    @classmethod
    def from_hf(cls, config) -> "MoESpec":
        layers = config.num_hidden_layers
        if config.model_type == "mixtral":  # every layer sparse, weights always renormalized
            return cls(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True,
                       (True,) * layers)
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
        return cls(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   bool(config.norm_topk_prob), sparse)


class SparseMoE(nn.Module):
    unquantized = ("gate",)  # --quantize int8 keeps the router in fp: a small error flips top-k choices

    def __init__(self, hidden_size: int, moe: MoESpec):
        super().__init__()
        self.moe = moe
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)   # the router
        self.experts = Experts(moe.num_experts, hidden_size, moe.expert_size)
        self.backend = "auto"  # the runner's choice, like the attention layers

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return kernels.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids, backend=self.backend)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, expert_size: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, expert_size))


class MoEModel(LlamaFamilyModel):
    def __init__(self, spec: ArchSpec, moe: MoESpec, rotary):
        super().__init__(spec, rotary)
        self.moe = moe
        for layer, sparse in zip(self.layers, moe.sparse_layers):
            if sparse:
                layer.mlp = SparseMoE(spec.hidden_size, moe)

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def param_target(self, name: str):
        """Expert tensors -> (stacked parameter, (expert, row offset), rows); everything else as Llama."""
        parts = name.removeprefix("model.").replace("block_sparse_moe.", "mlp.").split(".")
        if "experts" not in parts:
            return param_target(".".join(parts), self.spec)
        i = parts.index("experts")
        prefix, rest = ".".join(parts[:i + 1]), parts[i + 1:]
        size = self.moe.expert_size
        if len(rest) == 1:  # stacked layout: experts.gate_up_proj / experts.down_proj
            return f"{prefix}.{'w13' if rest[0] == 'gate_up_proj' else 'w2'}", 0, -1
        expert, proj = int(rest[0]), rest[1]
        rows = {"gate_proj": ("w13", 0, size), "w1": ("w13", 0, size), "up_proj": ("w13", size, size),
                "w3": ("w13", size, size), "down_proj": ("w2", 0, -1), "w2": ("w2", 0, -1)}
        if proj not in rows:
            return f"{prefix}.{'.'.join(rest)}", 0, -1  # unknown: the loader reports it as unexpected
        param, offset, count = rows[proj]
        return f"{prefix}.{param}", (expert, offset), count


def build_moe_model(config, spec: ArchSpec, rotary) -> MoEModel:
    return MoEModel(spec, MoESpec.from_hf(config), rotary)
