"""Rotary tables for the families beyond Llama: partial rotary (Phi-4), Phi-3's longrope, per-layer-type
rope settings (Gemma 3: one theta for sliding layers, another with scaling for global ones).

`TableRotary` has the call signature of layers.RotaryEmbedding, so any attention module takes either.
"""

from __future__ import annotations

import mmap
from typing import Callable

import torch


class PositionTables:
    """Tables with a row per position (cos, sin), computed only as far as positions have been asked for.

    Why: a row for every position a model allows is large, and mostly never read: Gemma 3's 32k positions x
    256 channels x (cos, sin) x 2 rope settings are 134 MB, more than the 270M model's Q4_K_M weights, while a
    chat reaches a few thousand positions. On the CPU the tensors are views of an anonymous mapping, whose pages
    take memory only once written, so they are allocated whole (their addresses never change: the native step
    holds them) and filled CHUNK rows at a time, each row computed as a whole-table computation would (rows of
    whole vectors). On other devices every row is computed at once (CUDA graphs and kernels read them)."""

    CHUNK = 1024

    def __init__(self, compute: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], size: int, width: int,
                 count: int, device: torch.device | str = "cpu"):
        """compute(positions) -> `count` tables [len(positions), width] (float32) for those positions."""
        self.compute, self.size, self.filled = compute, size, 0
        if torch.device(device).type == "cpu" and hasattr(mmap, "MAP_PRIVATE"):
            self._mapping = mmap.mmap(-1, max(count * size * width * 4, 1),
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            flat = torch.frombuffer(self._mapping, dtype=torch.float32)
            self.tables = [flat[i * size * width:(i + 1) * size * width].view(size, width) for i in range(count)]
        else:
            self.tables = [t.to(device) for t in compute(torch.arange(size))]
            self.filled = size

    def ensure(self, positions: int) -> None:
        """Rows 0 .. positions - 1 computed."""
        if positions <= self.filled:
            return
        end = min(self.size, -(-positions // self.CHUNK) * self.CHUNK)
        for table, rows in zip(self.tables, self.compute(torch.arange(self.filled, end))):
            table[self.filled:end] = rows
        self.filled = end

    def ensure_for(self, positions: torch.Tensor) -> None:
        """Rows up to the largest of `positions` computed (a step's positions)."""
        if self.filled < self.size and positions.numel():
            self.ensure(int(positions.max()) + 1)



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
    """cos/sin per position over the first `rotary_dim` channels of each head (the rest pass through
    unrotated, as HF's partial rotary does), in PositionTables."""

    def __init__(self, tables: PositionTables):
        self.positions = tables
        self.cos, self.sin = tables.tables
        self.rotary_dim = self.cos.shape[-1]

    @classmethod
    def from_config(cls, config, head_dim: int, max_positions: int, device: torch.device | str = "cpu",
                    layer_type: str | None = None) -> "TableRotary":
        params = dict(config.rope_parameters[layer_type] if layer_type else config.rope_parameters)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, scaling = _inv_freq(config, params, rotary_dim, layer_type)
        if params.get("rope_type") == "longrope":
            # Short factors below the original context, long ones from it on: cached blocks stay valid
            # whatever length their sequence reaches. transformers' generate instead re-encodes the whole
            # sequence with the long factors once it passes the original context (it drops its cache), so
            # the two agree exactly up to that length and differ past it (vLLM makes the same choice).
            original = params["original_max_position_embeddings"]
            long_freq, _ = _inv_freq(config, params, rotary_dim, layer_type, seq_len=original + 1)

            def compute(positions):
                beyond = (positions >= original)[:, None]
                (cos, sin), (long_cos, long_sin) = (_tables(f, scaling, positions) for f in (inv_freq, long_freq))
                return torch.where(beyond, long_cos, cos), torch.where(beyond, long_sin, sin)
        else:
            def compute(positions):
                return _tables(inv_freq, scaling, positions)
        return cls(PositionTables(compute, max_positions, rotary_dim, 2, device))

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [T, H, D] (any heads: the Llama forward passes q and k in one call)."""
        self.positions.ensure_for(positions)
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        x_rot = x[..., :r]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x[..., r:]), dim=-1)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)
