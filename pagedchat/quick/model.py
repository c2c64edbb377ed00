"""A GGUF file bound to decode.c straight from its mapped bytes: the structs native/abi.py describes, filled with
numpy arrays instead of a torch model, and a paged KV pool of one sequence.

What it computes is what the engine's native step computes for the same file (native/step.py binds the torch
model the loader builds from it): the same parts in the file's formats, the Q/K rows llama.cpp's converter
interleaved put back in HF order, Gemma's norms as (w - 1) + 1 (the loader's subtraction and the plan's
addition, the same fp32 roundings), the same attention scales, and rotary tables computed by the same formula.
`bind` returns None, with the reason, for anything else; the engine then runs the file.

Weights are read where the file is mapped (the engine copies them into one arena first, which costs a copy
of the whole file before the first token).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

from pagedchat.errors import ContextOverLimit
from pagedchat.model.gguf import arch as gguf_arch
from pagedchat.model.gguf.reader import GGUFFile, GGUFTensor
from pagedchat.native import abi

F32, F16 = 0, 1
ARCHITECTURES = ("llama", "gemma3")   # the families decode.c runs whole (Llama's forward, Gemma 3's)


class NotCovered(Exception):
    """What of a file the quick path does not run (the engine does)."""


@dataclass
class QuickModel:
    """decode.c's Model for one file, the arrays it points into, and the pool it writes K/V to."""
    struct: abi.Model
    vocab: int
    max_model_len: int           # the model's positions, or fewer where --max-context asks
    block_size: int
    num_blocks: int
    rope: list["RopeTables"]
    keep: list = field(default_factory=list)   # every array the structs point into: alive while this is

    def prepare_positions(self, end: int) -> None:
        """Rotary rows for positions 0 .. end - 1 computed before decode.c reads them."""
        for tables in self.rope:
            tables.ensure(end)


def bind(gguf: GGUFFile, block_size: int, kv_bytes: int, max_model_len: int | None) -> QuickModel:
    """The file as decode.c's Model with an fp32 pool of at most `kv_bytes` and the context's positions, in whole
    blocks; NotCovered for what decode.c does not run whole, ContextOverLimit as the loader raises it."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES or gguf.get("expert_count"):
        raise NotCovered(f"architecture {arch!r}")
    config = gguf_arch.config_from_gguf(gguf)
    if config.attention_bias or config.head_dim > abi.MAX_HEAD_DIM or config.hidden_size % 32:
        raise NotCovered("attention biases or head size")
    limit = config.max_position_embeddings   # the loader's limit for these two families (no window cap)
    if max_model_len is not None:
        if max_model_len > limit:
            raise ContextOverLimit(max_model_len, limit)
        limit = max_model_len
    gemma = arch == "gemma3"
    keep: list = []
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    num_blocks = min(kv_bytes // (per_token * block_size), -(-limit // block_size))
    if num_blocks < 1:
        raise NotCovered("a pool of no block (the engine says what is wrong with the size)")
    cache_shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    rope = _rope_tables(config, num_blocks * block_size, gemma)
    layers = (abi.Layer * config.num_hidden_layers)()
    for i in range(config.num_hidden_layers):
        layers[i] = _layer(gguf, config, i, gemma, cache_shape, rope, keep)
    embed = _tensor(gguf, "token_embd.weight")
    embed_addr, embed_format = _embedding(embed)
    lm_head = _linear([gguf.tensors.get("output.weight", embed)], config.hidden_size, keep)   # or the tied table
    scale = config.query_pre_attn_scalar ** -0.5 if gemma else config.head_dim ** -0.5
    first = rope[1] if gemma and config.layer_types[0] == "sliding_attention" else rope[0]   # layer 0's
    struct = abi.Model(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim, config.vocab_size, block_size,
                       config.rms_norm_eps, scale, embed_addr, _addr(_norm(gguf, "output_norm.weight", keep)),
                       lm_head, _addr(first.cos), _addr(first.sin), layers,
                       float(np.float32(config.hidden_size ** 0.5)) if gemma else 1.0, int(gemma), embed_format,
                       embed.data.shape[1])
    keep += [layers, rope, gguf]
    return QuickModel(struct, config.vocab_size, limit, block_size, num_blocks, rope, keep)


def _layer(gguf: GGUFFile, config, i: int, gemma: bool, cache_shape: tuple, rope: list, keep: list) -> abi.Layer:
    """Layer i: its norms, q/k/v, output, gate/up and down parts, its K and V caches, its rotary tables and
    window (decode.c's Layer)."""
    name = f"blk.{i}.{{}}.weight".format
    tensors = lambda *parts: [_tensor(gguf, name(p)) for p in parts]   # noqa: E731
    # llama.cpp's `llama` converter interleaved the rotary halves of Q and K rows: back to HF order
    qkv = [_rows_in_hf_order(t, gguf.architecture, config) for t in tensors("attn_q", "attn_k", "attn_v")]
    linears = [_linear(qkv, config.hidden_size, keep),
               _linear(tensors("attn_output"), config.num_attention_heads * config.head_dim, keep),
               _linear(tensors("ffn_gate", "ffn_up"), config.hidden_size, keep),
               _linear(tensors("ffn_down"), config.intermediate_size, keep)]
    k_cache, v_cache = np.zeros(cache_shape, np.float32), np.zeros(cache_shape, np.float32)
    keep += [k_cache, v_cache]
    norm = lambda part: _addr(_norm(gguf, name(part), keep))   # noqa: E731
    if not gemma:
        return abi.Layer(norm("attn_norm"), norm("ffn_norm"), None, None, *linears, _addr(k_cache),
                         _addr(v_cache), None, None, None, None, None, None, 0, 0)
    sliding = config.layer_types[i] == "sliding_attention"
    tables = rope[1] if sliding else rope[0]
    return abi.Layer(norm("attn_norm"), norm("ffn_norm"), norm("attn_q_norm"), norm("attn_k_norm"), *linears,
                     _addr(k_cache), _addr(v_cache), None, None, norm("post_attention_norm"), norm("post_ffw_norm"),
                     _addr(tables.cos), _addr(tables.sin), config.sliding_window if sliding else 0, 0)


def _tensor(gguf: GGUFFile, name: str) -> GGUFTensor:
    tensor = gguf.tensors.get(name)
    if tensor is None:
        raise NotCovered(f"no tensor {name}")
    return tensor


def _rows_in_hf_order(tensor: GGUFTensor, arch: str, config) -> GGUFTensor:
    order = gguf_arch.row_order(tensor.name, arch, config)
    return tensor if order is None else GGUFTensor(tensor.name, tensor.qtype, tensor.shape, tensor.data[order])


def _linear(parts: list[GGUFTensor], in_features: int, keep: list) -> abi.Linear:
    """Parts stacked by rows, each read in its own format: block formats (the input meets them in 8-bit blocks)
    or float ones, never both (decode.c takes one kind of input per layer)."""
    kinds = {p.qtype in abi.GGML_FLOATS for p in parts}
    if not all(p.qtype in abi.GGML_NATIVE for p in parts) or len(kinds) > 1 or in_features % 32:
        raise NotCovered(f"a linear layer in {[p.qtype for p in parts]} (ggml types)")
    if any(p.shape[-1] != in_features for p in parts):
        raise NotCovered(f"{parts[0].name}: {parts[0].shape[-1]} columns, the model has {in_features}")
    data = [np.ascontiguousarray(p.data) for p in parts]
    keep += data
    return abi.chain([(_addr(d), p.qtype, d.shape[0]) for d, p in zip(data, parts)], in_features,
                     sum(d.shape[0] for d in data))


def _embedding(tensor: GGUFTensor) -> tuple[int, int]:
    """(address, decode.c format) of the token table: its blocks as stored (a lookup dequantizes a row), or
    fp32 values."""
    if tensor.qtype in abi.GGML_BLOCKS:
        return _addr(tensor.data), abi.FMT_GGML + tensor.qtype
    if tensor.qtype == F32:
        return _addr(tensor.data), abi.FMT_F32
    raise NotCovered(f"token table in ggml type {tensor.qtype}")


def _norm(gguf: GGUFFile, name: str, keep: list) -> np.ndarray:
    """A norm's weights in fp32; Gemma's file holds w + 1 (its converter's), which the loader turns into w and
    decode.c's plan back into 1 + w: the same two fp32 roundings here."""
    tensor = _tensor(gguf, name)
    if tensor.qtype == F32:
        values = tensor.data.reshape(-1).view(np.float32)
    elif tensor.qtype == F16:
        values = tensor.data.reshape(-1).view(np.float16).astype(np.float32)
    else:
        raise NotCovered(f"{name} in ggml type {tensor.qtype}")
    if gguf_arch.is_plus_one_norm(name, gguf.architecture):
        values = (values - np.float32(1.0)) + np.float32(1.0)
    values = np.ascontiguousarray(values, dtype=np.float32)
    keep.append(values)
    return values


def _addr(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


# -- rotary tables -------------------------------------------------------------------------------------------
class RopeTables:
    """cos and sin per position, filled CHUNK rows at a time as positions are reached, as model/rope.py's
    PositionTables fills the torch model's (in numpy here): an anonymous mapping, whose pages cost memory only
    once written and whose addresses, which decode.c holds, never change."""

    CHUNK = 1024

    def __init__(self, params: dict, head_dim: int, size: int):
        if params.get("rope_type", "default") not in ("default", "linear") or "freq_factors" in params:
            raise NotCovered(f"rope {params.get('rope_type')}")
        self.size, self.filled = size, 0
        self.inv_freq = _inv_freq(params, head_dim)
        self._mapping = mmap.mmap(-1, 2 * size * head_dim * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = np.frombuffer(self._mapping, dtype=np.float32)
        self.cos, self.sin = flat[:size * head_dim].reshape(size, head_dim), flat[size * head_dim:].reshape(size, head_dim)

    def ensure(self, end: int) -> None:
        if end <= self.filled:
            return
        stop = min(self.size, -(-end // self.CHUNK) * self.CHUNK)
        freqs = np.arange(self.filled, stop, dtype=np.float32)[:, None] * self.inv_freq[None, :]   # fp32 products
        angles = np.concatenate((freqs, freqs), axis=-1).astype(np.float64)
        self.cos[self.filled:stop], self.sin[self.filled:stop] = np.cos(angles), np.sin(angles)   # rounded once
        self.filled = stop


def _inv_freq(params: dict, dim: int) -> np.ndarray:
    """1 / base ** (2i / dim) in fp32 (divided by the factor of linear scaling), by model/rope.py's steps: fp32
    exponents, the power rounded to fp32, its fp32 reciprocal. The power is computed in fp64 and rounded once;
    torch's own fp32 power may round an entry the other way (1 of 128 for Gemma 3's bases), so the tables can
    differ from the engine's by an ulp of a frequency: logits by rounding, tokens only at a near-tie."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    powers = (np.float64(params["rope_theta"]) ** exponents.astype(np.float64)).astype(np.float32)
    inv = np.float32(1.0) / powers
    if params.get("rope_type") == "linear":
        inv = inv / np.float32(params["factor"])
    return inv


def _rope_tables(config, size: int, gemma: bool) -> list[RopeTables]:
    """[global] for Llama; [global, sliding] for Gemma 3 (another theta for its window layers)."""
    if not gemma:
        return [RopeTables(config.rope_parameters, config.head_dim, size)]
    params = config.rope_parameters
    return [RopeTables(params["full_attention"], config.head_dim, size),
            RopeTables(params["sliding_attention"], config.head_dim, size)]
