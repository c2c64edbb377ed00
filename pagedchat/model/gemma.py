"""Gemma 2 and Gemma 3 (text): interleaved sliding-window and global attention layers.

What differs from the Llama forward, all read from the HF config:
  - RMSNorm scales by (1 + weight), computed in fp32; four norms per layer (around attention and MLP);
  - embeddings multiplied by sqrt(hidden_size); tied LM head; GELU (tanh) MLP;
  - attention scale query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps attention scores and final logits;
    Gemma 3 normalizes q and k per head and gives sliding and global layers their own rope settings;
  - `layer_types` marks each layer sliding_attention (window `sliding_window`) or full_attention.
Window layers attend through their own block tables when the pool releases out-of-window blocks
(AttentionMetadata.window_meta); see engine/ for how.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedchat.model.kv_groups import plan_groups
from pagedchat.model.layers import Embedding, Linear
from pagedchat.model.attention import AttentionMetadata, PagedAttention
from pagedchat.model.checkpoint import materialize, param_target
from pagedchat.model.llama import ArchSpec
from pagedchat.model.rope import TableRotary


@dataclass
class GemmaSpec:
    windows: tuple[int | None, ...]   # per layer: its sliding window, or None for a global layer
    layer_types: tuple[str, ...]
    scale: float
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: bool
    embed_scale: float

    @classmethod
    def from_hf(cls, config) -> "GemmaSpec":
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an encoder setting) is not supported")
        types = tuple(config.layer_types)
        windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in types)
        return cls(windows, types, config.query_pre_attn_scalar ** -0.5, config.attn_logit_softcapping,
                   config.final_logit_softcapping, config.model_type == "gemma3_text", config.hidden_size ** 0.5)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class WindowedAttention(PagedAttention):
    """Paged attention with a window and soft-cap; window layers read their own group's block tables."""

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, sliding_window=None, softcap=None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.sliding_window, self.softcap = sliding_window, softcap
        self.window_group = -1  # index among the window groups when the pool releases behind the window

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        from pagedchat import kernels

        if self.window_group >= 0 and meta.window_metas:
            meta = meta.window_metas[self.window_group]
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        kernels.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, backend=self.backend, **scales)
        extra = dict(backend=self.backend, sliding_window=self.sliding_window, softcap=self.softcap, **scales)
        if meta.is_decode:
            return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                                  self.scale, **extra)
        return kernels.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                               meta.seq_lens, self.scale, **extra)


class GemmaAttention(nn.Module):
    def __init__(self, spec: ArchSpec, gemma: GemmaSpec, layer: int, rotary: TableRotary):
        super().__init__()
        self.spec = spec
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm = gemma.qk_norm
        if gemma.qk_norm:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.rotary = rotary
        self.attn = WindowedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, gemma.scale,
                                      gemma.windows[layer], gemma.attn_softcap)

    def forward(self, positions, x, meta):
        s = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k.contiguous(), v.contiguous(), meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, spec: ArchSpec):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, gemma: GemmaSpec, layer: int, rotary: TableRotary):
        super().__init__()
        eps = spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.self_attn = GemmaAttention(spec, gemma, layer, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.mlp = GemmaMLP(spec)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)

    def forward(self, positions, x, meta):
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, spec: ArchSpec, gemma: GemmaSpec, rotaries: dict[str, TableRotary]):
        super().__init__()
        self.spec, self.gemma = spec, gemma
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(spec, gemma, i, rotaries[t])
                                    for i, t in enumerate(gemma.layer_types))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        self.groups = plan_groups(list(gemma.windows))
        self.embed_scale = gemma.embed_scale  # set to the model dtype's rounding by build_gemma_model
        for layer, group in zip(self.layers, self.groups.layer_group):
            layer.self_attn.attn.window_group = group - 1

    def tie_weights(self) -> None:
        if self.spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_groups(self):
        return self.groups

    def param_target(self, name: str):
        """Checkpoint names as Llama's, after the prefix a vision-language checkpoint puts its text model
        under (`language_model.`, or `model.language_model.` in newer saves); its image tower is skipped."""
        for prefix, replacement in (("model.language_model.", "model."), ("language_model.", "")):
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        if name.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        return param_target(name, self.spec)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.gemma.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]


def build_gemma_model(config, spec: ArchSpec, max_len: int, device, dtype) -> GemmaModel:
    gemma = GemmaSpec.from_hf(config)
    if config.model_type == "gemma3_text":
        rotaries = {t: TableRotary.from_config(config, spec.head_dim, max_len, device, layer_type=t)
                    for t in set(gemma.layer_types)}
    else:
        rotary = TableRotary.from_config(config, spec.head_dim, max_len, device)
        rotaries = {t: rotary for t in set(gemma.layer_types)}
    model = materialize(lambda: GemmaModel(spec, gemma, rotaries), device, dtype)
    model.embed_scale = embed_scale_in(gemma.embed_scale, dtype)
    return model


def embed_scale_in(scale: float, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to the model dtype, as a Python float: transformers multiplies by a tensor of the
    model dtype, and a Python scalar of the same value gives the same products (both are widened to fp32
    and rounded once) without creating a tensor from host data in every forward, which a CUDA graph could
    not capture."""
    return torch.tensor(scale, dtype=dtype).item()
