"""GGUF files for benchmarks and tests, written with gguf-py's GGUFWriter (the `gguf` package): random blocks of a
block format, and a Llama model of any shape typed the way llama.cpp's Q4_K_M types Llama-3.2-1B.

The weights are random blocks: a decode step's speed depends on the shapes and the formats, not on the values
(gguf-py cannot quantize to the K-quants, and a model's real weights are not needed to time it). pagedchat loads
the file like any GGUF (`-m FILE.gguf`), tokenizer included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Where each block keeps its float16 scales (byte offsets of d, and of dmin or the minimum where it has one).
_SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8)
# Super-block scales of the model's random blocks: a Q4_K weight is d * (0..63) * (0..15) - dmin * (0..63), so
# d and dmin of 1e-4 to 4e-4 give weights of a few hundredths (random bytes at the tests' scales would give
# values up to 20, and activations that overflow float16 within a few layers). Q6_K's d * (-128..127) * (-32..31)
# wants a quarter of that.
_MODEL_SCALES = {"Q4_K": (1e-4, 4e-4), "Q6_K": (2.5e-5, 1e-4)}


def random_blocks(shape, kind, rng, scales: tuple[float, float] = (0.002, 0.02)) -> np.ndarray:
    """Random blocks of block format `kind` (a ggml type number: gguf-py's GGMLQuantizationType or pagedchat's
    GGMLType) whose float16 scales are drawn from `scales` (random bytes there could be inf or NaN): uint8
    [*shape[:-1], row bytes]. Needs no gguf-py (the GPU machine has none)."""
    from pagedchat.model.gguf.reader import BLOCKS, GGMLType

    kind = GGMLType(int(kind))
    block, size = BLOCKS[kind]
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, size=(rows, shape[-1] // block, size), dtype=np.uint8)
    for offset in _SCALE_BYTES[kind.name]:
        values = rng.uniform(*scales, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def finish_writer(w) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q4_k_m_type(name: str, layer: int, layers: int) -> str:
    """llama.cpp's Q4_K_M type for a Llama matrix: Q6_K for the output (the embedding when tied) and for attn_v
    and ffn_down in the layers its use_more_bits picks (the first and last eighth, and every third between: half
    of them), Q4_K for the rest."""
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name == "output" or (name in ("attn_v", "ffn_down") and more_bits):
        return "Q6_K"
    return "Q4_K"


def write_llama_q4_k_m(path: Path, shape: dict | None = None, *, context_length: int = 4096, tied: bool = True,
                       seed: int = 0) -> Path:
    """A Llama GGUF of `shape` (HF config keys: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads; other keys are ignored, so a config.json's dict will do; default
    Llama-3.2-1B's) with Q4_K_M's types and random blocks, F32 norms, and a byte-level BPE vocabulary with ChatML
    tokens and template. `tied`: no output matrix, the LM head is the (Q6_K) embedding, as in Llama-3.2-1B."""
    import gguf

    s = {k: (shape or LLAMA_3_2_1B)[k] for k in LLAMA_3_2_1B}
    if s["hidden_size"] % 256 or s["intermediate_size"] % 256:
        raise ValueError(f"Q4_K_M needs widths that are multiples of 256 (K-quant blocks), got hidden "
                         f"{s['hidden_size']} and intermediate {s['intermediate_size']}")
    rng = np.random.default_rng(seed)
    hidden, layers, heads, kv_heads = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                                       s["num_key_value_heads"])
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(s["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab_size"])
    _add_vocabulary(w, s["vocab_size"])

    def matrix(name: str, rows: int, cols: int, qtype: str) -> None:
        kind = getattr(gguf.GGMLQuantizationType, qtype)
        blocks = random_blocks((rows, cols), kind, rng, _MODEL_SCALES[qtype])
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    ones = np.ones(hidden, dtype=np.float32)
    matrix("token_embd.weight", s["vocab_size"], hidden, "Q6_K" if tied else "Q4_K")
    w.add_tensor("output_norm.weight", ones)
    if not tied:
        matrix("output.weight", s["vocab_size"], hidden, "Q6_K")
    widths = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (s["intermediate_size"], hidden), "ffn_up": (s["intermediate_size"], hidden),
              "ffn_down": (hidden, s["intermediate_size"])}
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, (rows, cols) in widths.items():
            matrix(f"blk.{i}.{name}.weight", rows, cols, q4_k_m_type(name, i, layers))
    finish_writer(w)
    return Path(path)


def _add_vocabulary(w, vocab_size: int) -> None:
    """GPT-2's 256 byte tokens, one merge, ChatML's special tokens, and reserved tokens up to `vocab_size` (every
    id the model can sample decodes to text)."""
    from tokenizers import pre_tokenizers

    from pagedchat.demo.corpus import CHAT_TEMPLATE, IM_END, IM_START, PAD

    special = [PAD, IM_START, IM_END]
    tokens = special + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["\u0120t"]   # Ġt: " t"
    tokens += [f"<reserved_{i}>" for i in range(vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))   # control, then normal
    w.add_token_merges(["\u0120 t"])
    w.add_eos_token_id(special.index(IM_END))
    w.add_pad_token_id(special.index(PAD))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
