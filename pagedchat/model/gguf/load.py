"""A GGUF file as a loaded model: config and tokenizer from its metadata, weights from its memory-mapped tensors.

Two ways to hold the weights:
  - as the file stores them (the default): every linear layer with a block-format weight becomes a GGUFLinear
    over the file's bytes, so the model stays about the file's size; norms, biases and the embedding are
    dequantized into the model dtype (the engine dequantizes the linear layers too where no kernel runs them
    as stored: dequantize_linears);
  - `--quantize none`: everything dequantized into `--dtype` at load (the exact reference the tests compare
    against transformers' GGUF loading, and the fastest path where memory allows).
Rows llama.cpp's converter permuted are put back; Gemma's norm weights lose the +1 its converter added.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedchat.errors import ModelLoadError
from pagedchat.model.checkpoint import target_of, target_rows
from pagedchat.model.gguf import arch as gguf_arch
from pagedchat.model.gguf.embedding import GGUFEmbedding
from pagedchat.model.gguf.reader import GGUFFile, GGUFTensor, open_gguf

FLOAT_TYPES = (0, 1, 30)   # F32, F16, BF16: nothing to keep in a block format


def load_gguf(paths: list[Path], dev: torch.device, dtype: str, max_model_len: int | None, show_progress: bool,
              chat_template: str | None, quantize: str | None):
    from pagedchat.memory import give_back_free_heap
    from pagedchat.model.loader import LoadedModel, build_empty_model, finish_model, resolve_dtype

    gguf = open_gguf(paths)
    config = gguf_arch.config_from_gguf(gguf)
    keep_blocks = _keep_blocks(gguf, quantize)
    torch_dtype = resolve_dtype(dtype, dev)
    tokenizer, stop_ids = _tokenizer(gguf, chat_template)
    give_back_free_heap()
    model, spec, limit = build_empty_model(config, dev, torch_dtype, max_model_len)
    load_tensors(model, gguf, config, keep_blocks)
    finish_model(model, dev, torch_dtype, None if keep_blocks or quantize == "none" else quantize)
    return LoadedModel(paths[0], config, spec, model, tokenizer, stop_ids, limit, torch_dtype, dev)


def read_tokenizer(path: Path, chat_template: str | None = None):
    """(tokenizer, end-of-generation ids, context limit) of a GGUF model from its header alone (remote mode
    renders prompts with it; no weights are read)."""
    from pagedchat.model.gguf.locate import resolve_gguf

    gguf = open_gguf(resolve_gguf(str(path)) or [Path(path)])
    limit = gguf.get("context_length")
    return (*_tokenizer(gguf, chat_template), int(limit) if limit else None)


def _tokenizer(gguf: GGUFFile, chat_template: str | None):
    """The file's tokenizer (its template replaced by `chat_template` if given) and its end-of-generation ids."""
    from pagedchat.model.gguf.tokenizer import load_gguf_tokenizer, stop_token_ids

    tokenizer = load_gguf_tokenizer(gguf.metadata, str(gguf.paths[0]))
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer, stop_token_ids(gguf.metadata, tokenizer)


def dequantize_linears(model: nn.Module, dtype: torch.dtype) -> bool:
    """Every GGUFLinear replaced by a plain linear layer holding its dequantized weight; whether there was one.
    (The engine calls it where nothing would multiply the blocks as stored: see Engine._weights_as_stored.)"""
    from pagedchat.model.gguf.linear import GGUFLinear
    from pagedchat.model.layers import Linear

    found = False
    for name, module in list(model.named_modules()):
        if isinstance(module, GGUFLinear):
            parent_name, _, attr = name.rpartition(".")
            dense = Linear(module.in_features, module.out_features, bias=module.bias is not None,
                           device=module.part0.device, dtype=dtype)
            if name == "lm_head" and _tied_to_embedding(model, dtype):
                dense.weight = model.embed_tokens.weight   # the same blocks, dequantized the same way: one copy
            else:
                dense.weight.data = module.dequantized(dtype)
            if module.bias is not None:
                dense.bias.data = module.bias.to(dtype)
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, dense)
            found = True
    return found


def _tied_to_embedding(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the LM head's blocks are the embedding's (load_tensors ties them so) and the embedding table,
    already dequantized, holds exactly what dequantizing them again would give (Gemma 3's 262k x 640 table:
    one fp32 copy instead of two, 671 MB)."""
    spec, table = getattr(model, "spec", None), getattr(getattr(model, "embed_tokens", None), "weight", None)
    return bool(getattr(spec, "tie_embeddings", False)) and isinstance(table, torch.Tensor) and table.dtype == dtype


def _keep_blocks(gguf: GGUFFile, quantize: str | None) -> bool:
    """Whether linear weights stay in the file's block formats; int8/int4 only from a float file."""
    quantized = any(t.qtype not in FLOAT_TYPES for t in gguf.tensors.values())
    if quantize in ("int8", "int4") and quantized:
        raise ModelLoadError(f"{gguf.paths[0]} is already quantized; --quantize {quantize} applies to float "
                             f"weights only (use --quantize none to dequantize it to --dtype)")
    return quantized and quantize is None


def load_tensors(model: nn.Module, gguf: GGUFFile, config, keep_blocks: bool) -> None:
    """Every tensor of the file into the model: dequantized into its parameter, or (keep_blocks) linear
    weights gathered per layer and swapped for a GGUFLinear."""
    from pagedchat.model.gguf.quants import check_supported

    arch = gguf.architecture
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    block_parts: dict[str, list[tuple[int, torch.Tensor, int]]] = {}   # linear module -> (row offset, raw, type)
    loaded: dict[str, int] = {}
    kept_embedding = None   # (the embedding module's name, its dtype) when its table stays as blocks
    for tensor in gguf.tensors.values():
        hf = gguf_arch.hf_name(tensor.name, arch)
        if hf is None:
            continue
        check_supported(tensor.qtype, tensor.name)
        for name, data in _split_experts(hf, tensor):
            target = target_of(model, name)
            if target is None:
                continue
            pname, offset, rows = target
            if pname not in params:
                raise ModelLoadError(f"{gguf.paths[0]}: tensor {tensor.name} has no place in a {arch} model")
            raw = _rows_in_hf_order(data, tensor.name, arch, config)
            owner = pname.rsplit(".", 1)[0]
            if keep_blocks and pname.endswith(".weight") and isinstance(modules.get(owner), nn.Linear) \
                    and not isinstance(offset, tuple):
                block_parts.setdefault(owner, []).append((offset, raw, tensor.qtype))
            elif keep_blocks and tensor.name == "token_embd.weight" and _blocks_for_lookup(tensor, params[pname]):
                kept_embedding = (owner, params[pname].dtype)
            else:
                loaded[pname] = loaded.get(pname, 0) + _fill(params[pname], offset, rows, raw, tensor, arch)
    embed = gguf.tensors["token_embd.weight"]
    embed_blocks = torch.from_numpy(embed.data)   # (one tensor: a tied head and the table share its bytes)
    if keep_blocks and model.spec.tie_embeddings and embed.qtype not in FLOAT_TYPES:
        # A tied LM head reads the embedding's blocks as the file stores them: a quarter of the bytes per step
        # at Q8_0, where fp32 logits would read them all.
        block_parts["lm_head"] = [(0, embed_blocks, embed.qtype)]
    for owner, parts in block_parts.items():
        _swap_linear(model, owner, parts)
    if kept_embedding is not None:
        owner, dtype = kept_embedding
        _swap_embedding(model, owner, GGUFEmbedding(embed_blocks, embed.qtype, model.spec.hidden_size, dtype))
        block_parts[owner] = []
    _check_complete(model, params, loaded, block_parts, gguf)


def _blocks_for_lookup(tensor: GGUFTensor, param: torch.Tensor) -> bool:
    """Whether the embedding table stays in the file's blocks (a lookup dequantizes its rows): a quantized
    table, on the CPU (CUDA graphs capture the dense lookup)."""
    return tensor.qtype not in FLOAT_TYPES and param.device.type == "cpu" and tensor.data.ndim == 2


def _as_tensor(raw) -> torch.Tensor:
    return raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)


def _swap_embedding(model: nn.Module, owner: str, table) -> None:
    parent_name, _, attr = owner.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, table)


def _split_experts(hf: str, tensor: GGUFTensor):
    """(HF name, raw rows) per tensor; a stacked expert tensor [experts * rows, bytes] gives one per expert."""
    if "{e}" not in hf:
        return [(hf, tensor.data)]
    experts = tensor.shape[0]
    per = tensor.data.reshape(experts, -1, tensor.data.shape[-1])
    return [(hf.format(e=e), per[e]) for e in range(experts)]


def _rows_in_hf_order(data: np.ndarray, name: str, arch: str, config) -> np.ndarray:
    order = gguf_arch.row_order(name, arch, config)
    return data if order is None else data[order]


def _dequantized(raw: np.ndarray, tensor: GGUFTensor, arch: str) -> torch.Tensor:
    from pagedchat.model.gguf.quants import dequantize

    values = dequantize(torch.from_numpy(np.ascontiguousarray(raw)), tensor.qtype)
    if gguf_arch.is_plus_one_norm(tensor.name, arch):
        values = values - 1.0
    return values


FILL_ROWS = 8192   # rows dequantized at a time into a parameter: no second full-size copy of a large table


def _fill(param: torch.Tensor, offset, rows: int, raw: np.ndarray, tensor: GGUFTensor, arch: str) -> int:
    """Dequantize into the parameter's rows; the number of values filled. A large matrix (Gemma 3's 262k-row
    embedding) goes a slice of rows at a time, so loading never holds its values twice."""
    dest = target_rows(param, offset, rows)
    if raw.ndim == 2 and dest.dim() == 2 and raw.shape[0] == dest.shape[0] > FILL_ROWS:
        for r in range(0, raw.shape[0], FILL_ROWS):
            part = _dequantized(raw[r:r + FILL_ROWS], tensor, arch)
            dest[r:r + FILL_ROWS].copy_(part.reshape(-1, dest.shape[1]))
        return dest.numel()
    values = _dequantized(raw, tensor, arch)
    if values.numel() != dest.numel():
        raise ModelLoadError(f"{tensor.name} has {values.numel()} values, the model expects {tuple(dest.shape)}")
    dest.copy_(values.reshape(dest.shape))
    return dest.numel()


def _swap_linear(model: nn.Module, owner: str, parts: list[tuple[int, np.ndarray, int]]) -> None:
    from pagedchat.model.gguf.linear import GGUFLinear, runs_of_one_type

    parent_name, _, attr = owner.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, attr)
    parts = sorted(parts, key=lambda p: p[0])
    blocks = [(_as_tensor(raw), qtype) for _, raw, qtype in parts]
    if linear.weight.device.type == "cuda":
        blocks = runs_of_one_type(blocks)
    blocks = [(raw.to(linear.weight.device), qtype) for raw, qtype in blocks]
    layer = GGUFLinear(blocks, linear.in_features, None if linear.bias is None else linear.bias.data)
    if layer.out_features != linear.out_features:
        raise ModelLoadError(f"{owner}: the file's weights give {layer.out_features} rows, the model expects "
                             f"{linear.out_features}")
    setattr(parent, attr, layer)


def _check_complete(model, params, loaded, block_parts, gguf: GGUFFile) -> None:
    skip = {"lm_head.weight"} if model.spec.tie_embeddings else set()
    kept = {f"{owner}.weight" for owner in block_parts}
    missing = [n for n, p in params.items() if n not in skip and n not in kept and loaded.get(n, 0) < p.numel()]
    if missing:
        raise ModelLoadError(f"{gguf.paths[0]} is missing tensors for: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
