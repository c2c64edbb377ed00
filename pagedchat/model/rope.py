"""Rotary tables for the families beyond Llama: partial rotary (Phi-4), Phi-3's longrope, per-layer-type
rope settings (Gemma 3: one theta for sliding layers, another with scaling for global ones).

`TableRotary` has the call signature of layers.RotaryEmbedding, so any attention module takes either.
"""

from __future__ import annotations

import torch



def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inv_freq(config, params: dict, rotary_dim: int, layer_type: str | None, **kw) -> tuple[torch.Tensor, float]:
    if params.get("rope_type", "default") in ("default", "linear"):
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return (inv_freq / params["factor"] if params.get("rope_type") == "linear" else inv_freq), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    extra = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra, **kw)
    return inv_freq.float(), float(scaling)


def _tables(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class TableRotary:
    """Precomputed cos/sin per position over the first `rotary_dim` channels of each head (the rest pass
    through unrotated, as HF's partial rotary does)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, device: torch.device | str = "cpu"):
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.rotary_dim = cos.shape[-1]

    @classmethod
    def from_config(cls, config, head_dim: int, max_positions: int, device: torch.device | str = "cpu",
                    layer_type: str | None = None) -> "TableRotary":
        params = dict(config.rope_parameters[layer_type] if layer_type else config.rope_parameters)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        positions = torch.arange(max_positions)
        inv_freq, scaling = _inv_freq(config, params, rotary_dim, layer_type)
        cos, sin = _tables(inv_freq, scaling, positions)
        if params.get("rope_type") == "longrope":
            # Short factors below the original context, long ones from it on: cached blocks stay valid
            # whatever length their sequence reaches. transformers' generate instead re-encodes the whole
            # sequence with the long factors once it passes the original context (it drops its cache), so
            # the two agree exactly up to that length and differ past it (vLLM makes the same choice).
            original = params["original_max_position_embeddings"]
            long_freq, _ = _inv_freq(config, params, rotary_dim, layer_type, seq_len=original + 1)
            long_cos, long_sin = _tables(long_freq, scaling, positions)
            beyond = (positions >= original)[:, None]
            cos, sin = torch.where(beyond, long_cos, cos), torch.where(beyond, long_sin, sin)
        return cls(cos, sin, device)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [T, H, D] (any heads: the Llama forward passes q and k in one call)."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        x_rot = x[..., :r]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x[..., r:]), dim=-1)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)
