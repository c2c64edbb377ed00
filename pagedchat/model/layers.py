"""Building blocks of the Llama family, written to match transformers' numerics in fp32."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from pagedchat import kernels


class Linear(nn.Linear):
    """nn.Linear without the random init: every weight is loaded from the checkpoint. (On the meta device
    the init would also import torch._dynamo, a second of start-up.)"""

    def reset_parameters(self) -> None:
        pass


def linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of every nn.Linear in `model`: what a load-time rewrite of the linear
    layers (quantize.py, packed.py) replaces with setattr. A list: replacing while walking would walk the new
    modules too."""
    return [(module, name, child) for module in model.modules() for name, child in module.named_children()
            if isinstance(child, nn.Linear)]


class Embedding(nn.Embedding):
    """nn.Embedding without the random init (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and cast back before the weight, exactly as HF does (matters in bf16).
        # torch.rms_norm is the same arithmetic (bit for bit in fp32) in one call instead of six; in fp32
        # the weight goes in too (x * rstd, then * weight: the same two roundings).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                 backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path: (norm(x + residual), x + residual) in one kernel, same roundings as forward."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, backend=backend)


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_parameters(config) -> dict:
    """The rope settings as one dict, from transformers 5 (`rope_parameters`) or 4 (`rope_theta`/`rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling; scaled variants come from transformers itself."""
    params = rope_parameters(config)
    if "freq_factors" in params:  # a GGUF's per-frequency divisors (Llama-3's scaling, precomputed)
        inv_freq, scaling = rope_inv_freq(_without_factors(config, params), head_dim)
        return inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float), scaling
    if params["rope_type"] in ("default", "linear"):
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return (inv_freq / params["factor"] if params["rope_type"] == "linear" else inv_freq), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {params['rope_type']!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def _without_factors(config, params: dict):
    from types import SimpleNamespace

    return SimpleNamespace(rope_parameters={k: v for k, v in params.items() if k != "freq_factors"})


class RotaryEmbedding:
    """Precomputed cos/sin for every position; applied in the non-interleaved (rotate-half) layout.

    A plain object, not a module: the model is built on the meta device and materialized empty, and these
    tables must survive that (they are computed, never loaded).
    """

    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device | str = "cpu"):
        from pagedchat.model.rope import PositionTables

        inv_freq, scaling = rope_inv_freq(config, head_dim)
        half = head_dim // 2

        def compute(positions: torch.Tensor):
            freqs = positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * scaling, emb.sin() * scaling
            # rotate_half(x) * sin == roll(x, half) * signed_sin: one roll instead of two slices, a negation
            # and a concatenation (negating sin is exact, so the result is bit for bit the same).
            return cos, sin, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

        self.positions = PositionTables(compute, max_positions, head_dim, 3, device)
        self.cos, self.sin, self.signed_sin = self.positions.tables
        self._step = (None, None)  # (positions, (cos, sin)) of the step being run: every layer shares it

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows [T, 1, D] for `positions`, looked up once per forward pass."""
        last, cached = self._step
        if last is not positions or cached[0].dtype != dtype:
            self.positions.ensure_for(positions)
            cached = (self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1))
            self._step = (positions, cached)
        return cached

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [T, H, D] (any heads: q and k together in one call)."""
        cos, sin = self.tables(positions, x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q, k: [T, H, D]; positions: [T]
        return self.rotate(positions, q), self.rotate(positions, k)
