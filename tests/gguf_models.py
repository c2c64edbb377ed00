"""Random HF models of each family written as GGUF files the way llama.cpp's converter writes them (gguf-py's
writer): metadata keys, tensor names, Q/K rows permuted for `llama`, Gemma norms stored as w + 1, Phi-3's
fused projections, stacked experts; the test tokenizer as a byte-level BPE vocabulary with merges.

The files are then read by pagedchat and by transformers' GGUF loading (the oracle).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hf_models import CHATML, build_tokenizer
from pagedchat.bench.gguf_writer import finish_writer, random_blocks  # noqa: F401 (the tests' helpers too)

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}

# Configs the GGUF metadata can express exactly (llama.cpp's conventions, which transformers' GGUF config
# mapping follows): default rope, Gemma's window pattern and 1/sqrt(head_dim) scale.
BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6,
            tie_word_embeddings=False, eos_token_id=2, bos_token_id=None, pad_token_id=0)


def gguf_config(arch: str, **overrides):
    """A tiny HF config of `arch` whose every setting survives the trip through GGUF metadata. `wide`
    (hidden 256) gives rows of whole 256-value super-blocks for the K-quants."""
    import transformers as tf

    c = dict(BASE, **overrides)
    if arch in ("llama", "mistral"):
        return tf.LlamaConfig(**c)
    if arch == "qwen2":
        return tf.Qwen2Config(**{**c, "tie_word_embeddings": True})
    if arch == "qwen3":   # transformers' GGUF mapping of qwen3 reads no head_dim: its default (128) it is
        return tf.Qwen3Config(**{**c, "head_dim": 128})
    if arch == "qwen3_moe":
        # transformers' GGUF mapping reads neither head_dim nor the experts' width: its defaults (128, 768) it is
        return tf.Qwen3MoeConfig(**{**c, "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 4, "num_experts_per_tok": 2,
                                    "norm_topk_prob": True})
    if arch == "mixtral":
        return tf.MixtralConfig(**{**c, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
                                   "sliding_window": None})
    if arch == "phi3":
        return tf.Phi3Config(**{**c, "num_key_value_heads": c["num_attention_heads"]})
    # Gemma's attention scale is 1/sqrt(head_dim) in llama.cpp; transformers' GGUF mapping keeps its default
    # query_pre_attn_scalar of 256 whatever the file says, so the test models have heads of 256, as Gemma has.
    gemma = dict(c, head_dim=256, query_pre_attn_scalar=256, sliding_window=24, tie_word_embeddings=True,
                 hidden_activation="gelu_pytorch_tanh")
    if arch == "gemma2":
        return tf.Gemma2Config(**{**gemma, "num_hidden_layers": 4, "attn_logit_softcapping": 50.0,
                                  "final_logit_softcapping": 30.0})
    if arch == "gemma3":
        types = ["sliding_attention"] * 5 + ["full_attention"]
        return tf.Gemma3TextConfig(**{**gemma, "num_hidden_layers": 6, "layer_types": types,
                                      "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                             "rope_theta": 1000000.0},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10000.0}}})
    raise ValueError(arch)


def build_hf(arch: str, path: Path, seed: int = 0, **overrides):
    """Save a random fp32 model of `arch` (and the test tokenizer) to `path`; return it."""
    from transformers import AutoModelForCausalLM

    from hf_models import _liven_gemma

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gguf_config(arch, **overrides), dtype=torch.float32).eval()
    if arch.startswith("gemma"):
        _liven_gemma(model)
    model.save_pretrained(path)
    return model


def write_gguf(model, hf_dir: Path, out: Path, arch: str, qtype: str = "F32", seed: int = 0) -> dict:
    """The HF model as a GGUF file; matrices in `qtype` (F32, F16, Q8_0, Q4_K, ...), vectors in F32. Types
    gguf-py cannot quantize (the K-quants) get random blocks with small scales instead of the model's weights.
    Returns the oracle's state dict: the HF parameters as a faithful reader gets them back (gguf-py's
    dequantization of what was stored, the converter's transforms undone in fp32)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), GGUF_ARCH[arch])
    _write_hparams(w, model.config, arch)
    _write_vocab(w, hf_dir)
    reference = {}
    for gguf_name, data, undo in _tensors(model, arch):
        stored, kind = _stored(data, qtype, rng)
        w.add_tensor(gguf_name, stored, raw_shape=stored.shape if kind is not None else None, raw_dtype=kind)
        values = data if kind is None and stored.dtype == np.float32 else \
            gguf.quants.dequantize(stored, kind if kind is not None else gguf.GGMLQuantizationType.F16)
        reference.update(undo(np.asarray(values, dtype=np.float32).reshape(data.shape)))
    finish_writer(w)
    return reference


def reference_model(model, reference: dict):
    """A copy of the HF model holding the weights a GGUF file gives back: the oracle for that file."""
    import copy

    ref = copy.deepcopy(model)
    state = ref.state_dict()
    missing = [k for k in state if k not in reference and not (k == "lm_head.weight" and ref.config.tie_word_embeddings)]
    assert not missing, missing
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()}, strict=False)
    ref.generation_config.eos_token_id = None   # replies run their full length (the engine ignores EOS too)
    return ref.eval()


def _write_hparams(w, c, arch: str) -> None:
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(c.num_key_value_heads or heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters) if arch == "gemma3" else c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if arch in ("llama", "mistral", "mixtral", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "qwen3_moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "mixtral":
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)


def _write_vocab(w, hf_dir: Path) -> None:
    """The test tokenizer (byte-level BPE, GPT-2 split rules) as llama.cpp's `gpt2` vocabulary."""
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    for text, i in special.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(special["<|im_end|>"])
    w.add_pad_token_id(special["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each head's rows (for its rope kernel)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _same(key):
    return lambda v: {key: v}


def _tensors(model, arch: str):
    """(GGUF name, fp32 array, undo) in llama.cpp's naming and layout; undo(values read back) gives the HF
    parameters they stand for."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    plus_one = arch.startswith("gemma")
    yield "token_embd.weight", sd["model.embed_tokens.weight"], _same("model.embed_tokens.weight")
    if plus_one:
        yield "output_norm.weight", sd["model.norm.weight"] + 1, lambda v: {"model.norm.weight": v - 1}
    else:
        yield "output_norm.weight", sd["model.norm.weight"], _same("model.norm.weight")
    if not c.tie_word_embeddings:
        yield "output.weight", sd["lm_head.weight"], _same("lm_head.weight")
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp"}
    if plus_one:
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    permute = GGUF_ARCH[arch] == "llama"
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        experts: dict[str, list] = {}
        for key, value in sd.items():
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if ".experts." in rest or rest.startswith("mlp.experts"):
                experts.setdefault(rest, value)
                continue
            module, kind = rest.rsplit(".", 1)
            module = module.replace("block_sparse_moe.", "mlp.")
            gname = f"blk.{i}.{names[module]}.{kind}"
            heads = {"self_attn.q_proj": c.num_attention_heads, "self_attn.k_proj": c.num_key_value_heads}
            if permute and module in heads and kind == "weight":
                n = heads[module]
                yield gname, _permute(value, n), lambda v, key=key, n=n: {key: _unpermute(v, n)}
            elif plus_one and "norm" in module:
                yield gname, value + 1, lambda v, key=key: {key: v - 1}
            else:
                yield gname, value, _same(key)
        yield from _expert_tensors(i, experts, c)


def _expert_tensors(layer: int, experts: dict, c):
    """Stacked experts [E, out, in] as ffn_{gate,up,down}_exps, from either HF layout (and back)."""
    if not experts:
        return
    stacked = [k for k in experts if k.endswith("experts.gate_up_proj")]
    if stacked:
        gate_up_key = f"model.layers.{layer}.{stacked[0]}"
        down_key = gate_up_key.replace("gate_up_proj", "down_proj")
        gate_up, down = experts[stacked[0]], experts[stacked[0].replace("gate_up_proj", "down_proj")]
        half = gate_up.shape[1] // 2
        gate_read = {}

        def undo_gate(v):
            gate_read["v"] = v
            return {}

        def undo_up(v):
            return {gate_up_key: np.concatenate([gate_read["v"], v], axis=1)}

        yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :half]), undo_gate
        yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, half:]), undo_up
        yield f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(down), _same(down_key)
        return
    n = max(int(k.split("experts.")[1].split(".")[0]) for k in experts) + 1
    for ours, names in (("gate", ("gate_proj", "w1")), ("up", ("up_proj", "w3")), ("down", ("down_proj", "w2"))):
        keys = [next(k for k in experts if f"experts.{e}." in k and k.split(".")[-2] in names) for e in range(n)]
        yield (f"blk.{layer}.ffn_{ours}_exps.weight", np.stack([experts[k] for k in keys]),
               lambda v, keys=keys: {f"model.layers.{layer}.{k}": v[e] for e, k in enumerate(keys)})


def _stored(data: np.ndarray, qtype: str, rng):
    """(array to write, its ggml type or None for a float array) for one tensor."""
    import gguf

    data = np.ascontiguousarray(data, dtype=np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if data.ndim == 1 or qtype == "F32" or data.shape[-1] % block:
        return data, None
    if qtype == "F16":
        return data.astype(np.float16), None
    try:
        return gguf.quants.quantize(data, kind), kind
    except NotImplementedError:
        return random_blocks(data.shape, kind, rng), kind
