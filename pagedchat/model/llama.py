"""One forward pass for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 and Qwen3.

The differences between them are a handful of flags (qkv bias, q/k norm, explicit head_dim), read from the
HF config into ArchSpec. Projections are fused (qkv, gate+up) at load time: fewer, larger matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedchat import kernels
from pagedchat.model.attention import AttentionMetadata, PagedAttention
from pagedchat.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SiluAndMul

@dataclass
class ArchSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_embeddings: bool

    @classmethod
    def from_hf(cls, config) -> "ArchSpec":
        arch = (getattr(config, "architectures", None) or ["?"])[0]
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.spec = spec
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = self.q_norm(qkv[:, :self.q_size].view(-1, s.num_heads, s.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(-1, s.num_kv_heads, s.head_dim))
            q, k = self.rotary(positions, q, k)
        else:  # q and k heads side by side: one rotary pass over both
            qk = self.rotary.rotate(positions, qkv[:, :self.q_size + self.kv_size].view(
                -1, s.num_heads + s.num_kv_heads, s.head_dim))
            q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(-1, self.q_size))

    def forward_fused(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One kernel between the two projections' and attention's: rotary (and Qwen3's q/k norms) fused
        with the K/V write (PagedAttention.rope_write_attend)."""
        if self.attn.k_scale is not None:  # a quantized pool: write_kv quantizes its writes
            return self.forward(positions, x, meta)
        s = self.spec
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].view(-1, s.num_heads, s.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(-1, s.num_kv_heads, s.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, s.num_kv_heads, s.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, s.rms_norm_eps) if s.qk_norm else (None, None, 0.0)
        out = self.attn.rope_write_attend(positions, q, k, v, self.rotary, meta, *norms)
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def forward_fused(self, x: torch.Tensor, backend: str | None) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x), backend=backend))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, positions, x, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, positions, x, residual, meta, backend):
        """The fused path: each residual add rides in the next norm's kernel; returns (output, residual)
        whose sum is what forward returns (residual None on the first layer: x is the stream itself)."""
        h, residual = self.input_layernorm.add_norm(x, residual, backend)
        h = self.self_attn.forward_fused(positions, h, meta)
        h, residual = self.post_attention_layernorm.add_norm(h, residual, backend)
        mlp = self.mlp  # a mixture of experts (moe.py) is one fused call already
        return (mlp.forward_fused(h, backend) if isinstance(mlp, MLP) else mlp(h)), residual


class LlamaFamilyModel(nn.Module):
    """Decoder-only transformer over flattened tokens [T]; attention state lives in the paged pool."""

    def __init__(self, spec: ArchSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.spec = spec
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = rotary
        # None: the layer ops one by one (the CPU path, twins of transformers' ops); a kernels backend
        # ("auto", "triton", "torch"): the fused layer kernels (the CUDA path; see use_fused_kernels)
        self.fused_backend: str | None = None

    def tie_weights(self) -> None:
        if self.spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused_backend is None:
            for layer in self.layers:
                x = layer(positions, x, meta)
            return self.norm(x)
        residual = None
        for layer in self.layers:
            x, residual = layer.forward_fused(positions, x, residual, meta, self.fused_backend)
        return self.norm.add_norm(x, residual, self.fused_backend)[0]

    def use_fused_kernels(self, backend: str | None) -> None:
        """Run the fused layer kernels (norm + residual add, rotary + K/V write, SiLU x up) through
        `backend`, or the unfused ops (None). Same numbers either way; fewer launches fused."""
        self.fused_backend = backend

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only the rows that will be sampled reach the LM head."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]
