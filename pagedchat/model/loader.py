"""Find a model (local HF folder or the HF cache), check it, and load config, weights and tokenizer."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedchat.dtypes import DTYPES
from pagedchat.errors import ContextOverLimit, ModelLoadError, SettingError
from pagedchat.model.checkpoint import target_of, target_rows
from pagedchat.model.families import SUPPORTED_ARCHITECTURES, family_for, text_part
from pagedchat.model.hf_config import read_config
from pagedchat.model.llama import ArchSpec
from pagedchat.model.tokenizer import load_fast_tokenizer



@dataclass
class LoadedModel:
    path: Path
    hf_config: object
    spec: ArchSpec
    model: torch.nn.Module      # LlamaFamilyModel or another family's model (model/families.py)
    tokenizer: object | None
    eos_token_ids: list[int]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SettingError("device", f"{{name}} {device} was asked for but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ModelLoadError(f"unknown device {device!r}: use cpu, cuda or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, DTYPES[dtype])


def find_model_dir(source: str, revision: str | None = None) -> Path:
    """A local folder, or a repo id in the local HF cache (downloaded only when the hub is reachable)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        from pagedchat.model.gguf.locate import looks_like_gguf

        if looks_like_gguf(path):
            return path   # a GGUF file is its own model (its tokenizer, config and weights inside)
        raise ModelLoadError(f"model path {source} is neither an HF model folder nor a GGUF file")
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {source!r} not found: no such folder, and it is not an HF repo id (org/name)")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(source, revision=revision, local_files_only=True, allow_patterns=patterns))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelLoadError(f"model {source!r} is not in the local HF cache and HF_HUB_OFFLINE=1")
    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=patterns))
    except Exception as e:
        raise ModelLoadError(f"model {source!r} is not a local folder, not in the HF cache, and could not be "
                             f"downloaded ({type(e).__name__})") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards, checked to exist (single file or an index with its shards); for a GGUF file,
    every part of its set."""
    if model_dir.is_file():
        from pagedchat.model.gguf.locate import resolve_gguf

        return resolve_gguf(str(model_dir)) or [model_dir]
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not an HF model folder")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is corrupt: {e}") from None
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing weight shards: {', '.join(missing)}")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pth")):
        raise ModelLoadError(f"{model_dir} has only .bin/.pth weights; pagedchat loads safetensors only")
    raise ModelLoadError(f"{model_dir} is missing model.safetensors (or model.safetensors.index.json)")


def load_config(model_dir: Path, trust_remote_code: bool = False):
    """config.json as attributes: read directly for the families checked against transformers, else AutoConfig
    (every family added since, e.g. Phi-3, MoE and Gemma, goes through AutoConfig)."""
    config = None if trust_remote_code else read_config(model_dir / "config.json")
    if config is None:
        config = _auto_config(model_dir, trust_remote_code)
    arch = architecture_of(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {model_dir}; supported: "
                             + ", ".join(SUPPORTED_ARCHITECTURES))
    return text_part(config)


def architecture_of(config) -> str | None:
    return (getattr(config, "architectures", None) or [None])[0]


def _auto_config(model_dir: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {str(e).splitlines()[0]}") from None
    return config


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False, chat_template: str | None = None):
    """The folder's tokenizer (None when it has none); chat_template replaces the folder's template. The
    `tokenizers`-only tokenizer where it is exact, else transformers' AutoTokenizer."""
    if model_dir.is_file():   # a GGUF file: the vocabulary and template in its metadata
        from pagedchat.model.gguf.load import read_tokenizer

        return read_tokenizer(model_dir, chat_template)[0]
    has_files = any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json",
                                                        "tokenizer_config.json"))
    if not has_files:
        return None
    tokenizer = None if trust_remote_code else load_fast_tokenizer(model_dir)
    if tokenizer is not None:
        if chat_template:
            tokenizer.chat_template = chat_template
        return tokenizer
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
    if not any((model_dir / f).exists() for f in vocab_files):
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: it has tokenizer_config.json but no "
                             f"vocabulary file (tokenizer.json, tokenizer.model or vocab.json); copy the "
                             f"tokenizer files from the original model")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:   # the whole message on one line: its first line alone can stop mid-sentence
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {' '.join(str(e).split())[:400]}") from None
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def eos_ids(model_dir: Path, config, tokenizer) -> list[int]:
    ids: list[int] = []

    def add(value):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except ValueError:
            raise ModelLoadError(f"{gen} is not valid JSON") from None
    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


def load_weights(model: torch.nn.Module, files: list[Path], show_progress: bool) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, int] = {}
    with _progress(files, show_progress) as advance:
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
                keys = list(handle.keys())
            except Exception as e:
                raise ModelLoadError(f"{file} is corrupt or truncated: {str(e).splitlines()[0]}") from None
            for key in keys:
                target = target_of(model, key)
                if target is None:
                    continue
                name, offset, rows = target
                if name not in params:
                    raise ModelLoadError(f"{file.name}: unexpected tensor {key!r} for this architecture")
                try:
                    tensor = handle.get_tensor(key)
                except Exception as e:
                    raise ModelLoadError(f"{file} is corrupt: {key}: {str(e).splitlines()[0]}") from None
                dest = target_rows(params[name], offset, rows)
                if dest.shape != tensor.shape:
                    raise ModelLoadError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, "
                                         f"config expects {tuple(dest.shape)}")
                dest.copy_(tensor)
                loaded[name] = loaded.get(name, 0) + dest.numel()
                advance(tensor.numel() * tensor.element_size())
    skip = {"lm_head.weight"} if model.spec.tie_embeddings else set()
    missing = [n for n, p in params.items() if n not in skip and loaded.get(n, 0) < p.numel()]
    if missing:
        raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


class _progress:
    """A rich progress bar over the bytes of the weight files (silent when not on a terminal)."""

    def __init__(self, files: list[Path], enabled: bool):
        self.total = sum(f.stat().st_size for f in files)
        self.enabled = enabled and self.total > 64 * 1024**2
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        self.bar = Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(),
                            console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task("load", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def load_model(source: str, device: str = "auto", dtype: str = "auto", max_model_len: int | None = None,
               revision: str | None = None, trust_remote_code: bool = False,
               show_progress: bool = True, chat_template: str | None = None,
               quantize: str | None = None) -> LoadedModel:
    from pagedchat.model.gguf.locate import resolve_gguf

    gguf_paths = resolve_gguf(source)
    if gguf_paths is not None:
        from pagedchat.model.gguf.load import load_gguf

        return load_gguf(gguf_paths, resolve_device(device), dtype, max_model_len, show_progress, chat_template,
                         quantize)
    model_dir = find_model_dir(source, revision)
    files = weight_files(model_dir)
    config = load_config(model_dir, trust_remote_code)
    tokenizer = load_tokenizer(model_dir, trust_remote_code, chat_template)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model, spec, limit = build_empty_model(config, dev, torch_dtype, max_model_len)
    load_weights(model, files, show_progress)
    finish_model(model, dev, torch_dtype, None if quantize == "none" else quantize)
    return LoadedModel(model_dir, config, spec, model, tokenizer, eos_ids(model_dir, config, tokenizer),
                       limit, torch_dtype, dev)


def build_empty_model(config, dev: torch.device, torch_dtype: torch.dtype, max_model_len: int | None):
    """(model with empty parameters, its ArchSpec, its context limit) for an HF-style config."""
    spec = ArchSpec.from_hf(config)
    family = family_for(architecture_of(config))
    limit = spec.max_positions
    window = getattr(config, "sliding_window", None)
    if window and not family.windowed and getattr(config, "use_sliding_window", True) and window < limit:
        limit = window  # full attention equals sliding-window attention up to the window
    if max_model_len is not None:
        if max_model_len > limit:
            raise ContextOverLimit(max_model_len, limit)
        limit = max_model_len
    model = family.build(config, spec, limit, dev, torch_dtype)
    model.tie_weights()
    return model, spec, limit


def finish_model(model: torch.nn.Module, dev: torch.device, torch_dtype: torch.dtype, quantize: str | None):
    """Weight-only quantization when asked for, else the packed fp32 copies where they pay; inference mode."""
    if quantize is not None:
        from pagedchat.model.quantize import quantize_model

        quantize_model(model, quantize)
    else:
        from pagedchat.model import packed

        if packed.can_pack(dev, torch_dtype):
            packed.pack_linears(model)
    model.eval().requires_grad_(False)
