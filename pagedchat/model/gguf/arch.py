"""What a GGUF file's metadata and tensor names mean in the terms the model code reads: an HF-style config
(the attributes `families.py` builders and `ArchSpec.from_hf` read) and each tensor's HF checkpoint name, with
the transforms llama.cpp's converter applied undone.

llama.cpp is the reference where GGUF leaves something implicit (Gemma's window pattern and local rope base,
Gemma's attention scale, which architectures have their Q/K rows permuted).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from pagedchat.errors import ModelLoadError
from pagedchat.model.gguf.reader import GGUFFile

# GGUF `general.architecture` -> the HF architecture whose model code runs it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",      # also Mistral; Mixtral when it has experts (see hf_architecture)
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Only llama.cpp's `llama` converter interleaves the rotary halves of Q and K rows (for its rope kernel);
# every other family here is stored in HF order, and un-permuting it would scramble it.
PERMUTED_QK = ("llama",)
# Gemma's converter stores RMSNorm weights as w + 1 (llama.cpp multiplies by the weight directly).
NORM_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's Gemma window patterns: a layer is global when (i + 1) % n == 0, else sliding.
GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma models llama.cpp scales queries by 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim) (the 27B sizes,
# which it recognises by their layer count).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# Tensors the model computes itself or that carry rope settings (read into the config, not loaded).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_architecture(gguf: GGUFFile) -> str:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{gguf.paths[0]}: GGUF architecture {arch!r} is not supported; supported: "
                             + ", ".join(ARCHITECTURES))
    if arch == "llama" and int(gguf.get("expert_count", 0) or 0) > 0:
        return "MixtralForCausalLM"
    return ARCHITECTURES[arch]


def config_from_gguf(gguf: GGUFFile) -> SimpleNamespace:
    """The HF config attributes the model code reads, from the file's metadata."""
    arch, hf_arch = gguf.architecture, hf_architecture(gguf)
    heads = int(_required(gguf, "attention.head_count"))
    hidden = int(_required(gguf, "embedding_length"))
    head_dim = int(gguf.get("attention.key_length") or hidden // heads)
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf.paths[0]}: no token_embd.weight tensor")
    layers = int(_required(gguf, "block_count"))
    values = dict(
        architectures=[hf_arch], model_type=_MODEL_TYPES[hf_arch],
        hidden_size=hidden, intermediate_size=int(gguf.get("feed_forward_length") or 0),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(gguf.get("attention.head_count_kv") or heads), head_dim=head_dim,
        vocab_size=embed.shape[0], rms_norm_eps=float(gguf.get("attention.layer_norm_rms_epsilon") or 1e-6),
        max_position_embeddings=int(gguf.get("context_length") or 4096),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_output.bias" in gguf.tensors, mlp_bias=False,
        sliding_window=None, use_sliding_window=False, rope_scaling=None,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"), eos_token_id=gguf.get("tokenizer.ggml.eos_token_id"),
    )
    values["rope_parameters"] = _rope(gguf, head_dim)
    if arch in GEMMA_WINDOW_PATTERN:
        values.update(_gemma(gguf, arch, layers, hidden, heads, head_dim))
    if hf_arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        values.update(_moe(gguf, hf_arch))
    if arch == "phi3":
        values["partial_rotary_factor"] = int(gguf.get("rope.dimension_count") or head_dim) / head_dim
    return SimpleNamespace(**values)


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Phi3ForCausalLM": "phi3",
                "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}


def _required(gguf: GGUFFile, key: str):
    value = gguf.get(key)
    if value is None:
        raise ModelLoadError(f"{gguf.paths[0]}: metadata {gguf.architecture}.{key} is missing")
    return value


def _rope(gguf: GGUFFile, head_dim: int) -> dict:
    """Rope settings in transformers' `rope_parameters` shape. Llama-3's frequency factors come as a tensor
    (`rope_freqs.weight`, one divisor per frequency), which `freq_factors` carries to the rotary tables."""
    params = {"rope_type": "default", "rope_theta": float(gguf.get("rope.freq_base") or 10000.0)}
    scaling = gguf.get("rope.scaling.type")
    if scaling == "linear" and float(gguf.get("rope.scaling.factor") or 1.0) != 1.0:
        params.update(rope_type="linear", factor=float(gguf.get("rope.scaling.factor")))
    elif scaling not in (None, "none", "linear"):
        raise ModelLoadError(f"{gguf.paths[0]}: rope scaling {scaling!r} is not supported in GGUF files yet")
    factors = gguf.tensors.get("rope_freqs.weight")
    if factors is not None:
        params["freq_factors"] = np.frombuffer(factors.data.tobytes(), dtype=np.float32).tolist()
    if "rope_factors_long.weight" in gguf.tensors:
        raise ModelLoadError(f"{gguf.paths[0]}: longrope factors (Phi-3 128k) are not supported in GGUF files "
                             f"yet; the 4k-context variants load")
    return params


def _gemma(gguf: GGUFFile, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    pattern = GEMMA_WINDOW_PATTERN[arch]
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    scalar = hidden // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim
    out = dict(layer_types=types, sliding_window=int(_required(gguf, "attention.sliding_window")),
               use_sliding_window=True, query_pre_attn_scalar=scalar, hidden_activation="gelu_pytorch_tanh",
               attn_logit_softcapping=gguf.get("attn_logit_softcapping"),
               final_logit_softcapping=gguf.get("final_logit_softcapping"), use_bidirectional_attention=False)
    if arch == "gemma3":
        full = _rope(gguf, head_dim)
        out["rope_parameters"] = {"full_attention": full,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}}
        out["attn_logit_softcapping"] = out["final_logit_softcapping"] = None
    return out


def _moe(gguf: GGUFFile, hf_arch: str) -> dict:
    experts, used = int(_required(gguf, "expert_count")), int(_required(gguf, "expert_used_count"))
    if hf_arch == "MixtralForCausalLM":
        return dict(num_local_experts=experts, num_experts_per_tok=used)
    return dict(num_experts=experts, num_experts_per_tok=used, decoder_sparse_step=1, mlp_only_layers=[],
                moe_intermediate_size=int(_required(gguf, "expert_feed_forward_length")),
                norm_topk_prob=bool(gguf.get("expert_weights_norm", True)))


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (None for rope factors, which are settings). Stacked expert
    tensors [experts, ...] name one expert's tensor with an `{e}` to fill in."""
    if gguf_name in ROPE_TENSORS:
        return None
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")
    layer, part, kind = m.groups()
    if part in _EXPERT_NAMES:
        return f"model.layers.{layer}.mlp.experts.{{e}}.{_EXPERT_NAMES[part]}.{kind}"
    names = _GEMMA_LAYER_NAMES if arch in NORM_PLUS_ONE else _LAYER_NAMES
    if arch == "phi3" and part == "ffn_up":  # Phi-3 stores gate and up fused under ffn_up
        return f"model.layers.{layer}.mlp.gate_up_proj.{kind}"
    if part not in names:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")
    return f"model.layers.{layer}.{names[part]}.{kind}"


def row_order(gguf_name: str, arch: str, config) -> np.ndarray | None:
    """The row permutation that undoes llama.cpp's Q/K interleaving (None where nothing was permuted).
    Rows are whole, so it applies to quantized rows as well as to floats."""
    if arch not in PERMUTED_QK or not gguf_name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                                          "attn_k.bias")):
        return None
    heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
    rows = heads * config.head_dim
    # The converter took each head's rows as (2 halves, d/2) and stored them as (d/2, 2): read them back.
    return np.arange(rows).reshape(heads, config.head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


def is_plus_one_norm(gguf_name: str, arch: str) -> bool:
    return arch in NORM_PLUS_ONE and gguf_name.endswith("norm.weight")


def summary(gguf: GGUFFile) -> dict:
    """What `models show` says of a GGUF file: its family, context, size and the formats its tensors use."""
    from collections import Counter

    from pagedchat.model.families import family_for
    from pagedchat.model.gguf.reader import GGMLType

    try:
        family = family_for(hf_architecture(gguf))
        family_text = f"{family.name}: {family.label}"
    except ModelLoadError:
        family_text = f"unsupported GGUF architecture {gguf.architecture!r}"
    formats = Counter(GGMLType(t.qtype).name for t in gguf.tensors.values())
    return {"family": family_text, "max_context": gguf.get("context_length"),
            "formats": ", ".join(f"{name} x{n}" for name, n in formats.most_common()),
            "name": gguf.metadata.get("general.name")}
