"""Attention over the paged KV pool. The model sees only tensors and an AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedchat import kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor    # [T] int64: where each new token's K/V goes (-1 = padding, skipped)
    block_tables: torch.Tensor    # [B, max_blocks] int32
    seq_lens: torch.Tensor        # [B] int32: context length of each sequence after this step
    cu_seqlens_q: torch.Tensor    # [B+1] int32: sequence i owns query rows cu[i]:cu[i+1]
    is_decode: bool               # every sequence has exactly one new token
    max_seq_len: int = 0
    window_metas: "list[AttentionMetadata] | None" = None  # per window layer group (engine/core/window_groups.py)


class PagedAttention(nn.Module):
    """Writes the new K/V into the pool, then attends over each sequence's block table."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)  # bound to the pool by the runner
        self.k_scale = self.v_scale = None  # a quantized pool's scales (kernels/kv_quant.py), bound with them
        self.backend = "auto"  # the runner sets "torch" on CPU so TRITON_INTERPRET never slows the engine

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        kernels.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, backend=self.backend,
                         **self._scales())
        return self.attend(q, meta)

    def rope_write_attend(self, positions, q, k, v, rotary, meta: AttentionMetadata, q_norm=None, k_norm=None,
                          eps: float = 0.0) -> torch.Tensor:
        """The fused path (llama.Attention.forward_fused): rotary of q and k (after per-head q/k norms when
        given) and the K/V write into the pool in one kernel, the rotated K going straight to its slot. A
        float pool only (a quantized pool's writes go through write_kv, which quantizes)."""
        assert self.k_scale is None, "the fused rotary + K/V write stores floats: a quantized pool takes forward()"
        rotary.positions.ensure_for(positions)
        q = kernels.rope_write_kv(q, k, v, positions, rotary.cos, rotary.sin, self.k_cache, self.v_cache,
                                  meta.slot_mapping, q_norm=q_norm, k_norm=k_norm, eps=eps, backend=self.backend)
        return self.attend(q, meta)

    def attend(self, q, meta: AttentionMetadata) -> torch.Tensor:
        """q over the pool (its new K/V already written)."""
        scales = self._scales()
        if meta.is_decode:
            return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                                  meta.seq_lens, self.scale, backend=self.backend, **scales)
        return kernels.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                               meta.cu_seqlens_q, meta.seq_lens, self.scale,
                                               backend=self.backend, **scales)

    def _scales(self) -> dict:
        """A quantized pool's scales for the kernels (none for a float pool)."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}
