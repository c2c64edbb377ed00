"""Random-weight models for benchmarks, saved as real HF folders so pagedchat and transformers load the same
files. Sizes: `tiny` (the tests' config), `small` (a few tens of millions of parameters: CPU runs) and `1b`
(Llama-3.2-1B's shape: GPU runs, bf16).

A larger init std than the usual 0.02 keeps the logits peaked, so greedy decoding rarely meets a near-tie and
the outputs of two implementations can be compared token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedchat.dtypes import DTYPE_HINT, DTYPES
from pagedchat.errors import UserError

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

SIZES = {
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, initializer_range=0.1),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, initializer_range=0.02),
}


def random_config(arch: str, size: str = "small", max_positions: int = 4096, **overrides):
    """An HF config of the given family and size (random weights come from its initializer)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch not in ARCHS:
        raise UserError(f"--random wants one of {', '.join(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise UserError(f"--random-size wants one of {', '.join(SIZES)}, got {size!r}")
    common = dict(SIZES[size], max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                  tie_word_embeddings=size == "1b", eos_token_id=2, bos_token_id=None, pad_token_id=0)
    common.update(overrides)
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=500000.0)   # rope_parameters= would be unknown to transformers 4
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(**common, head_dim=head_dim)


def build_random_model(arch: str, path: Path, size: str = "small", max_positions: int = 4096, seed: int = 0,
                       dtype: str = "float32", **overrides) -> Path:
    """Save a random `arch` model of `size` to `path` (config + safetensors, no tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedchat.bench.common import quiet_transformers

    quiet_transformers()
    config = random_config(arch, size, max_positions, **overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def resolve_model(model: str | None, random_arch: str | None, random_size: str, workdir: Path,
                  max_positions: int = 4096, dtype: str = "float32") -> tuple[Path, str]:
    """(HF folder, display name) for `-m MODEL` (registry name or folder) or `--random ARCH`."""
    if model and random_arch:
        raise UserError("give -m MODEL or --random ARCH, not both")
    if random_arch:
        path = build_random_model(random_arch, workdir / f"{random_arch}-{size_tag(random_size)}", random_size,
                                  max_positions, dtype=dtype)
        return path, f"random {random_arch} ({random_size})"
    from pagedchat.registry import Registry

    entry = Registry().resolve(model or None)    # no -m: the registry's default model (the shipped demo)
    if Path(entry.path).is_dir() or Path(entry.path).is_file():   # a folder, or a GGUF file
        return Path(entry.path), entry.name
    raise UserError(f"model {model!r} resolves to {entry.path}, which is not a local folder or GGUF file")


DEMO_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_chat_bench_model(arch: str, path: Path, size: str = "tiny", max_positions: int = 4096) -> Path:
    """A random model a server can chat with: random weights over the shipped demo model's tokenizer and
    chat template, so requests can be chat messages and replies stream as text."""
    import shutil
    from importlib import resources

    demo = Path(str(resources.files("pagedchat") / "assets" / "demo-chat"))
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    build_random_model(arch, path, size, max_positions, vocab_size=vocab)
    for name in DEMO_TOKENIZER_FILES:
        if (demo / name).exists():
            shutil.copy(demo / name, Path(path) / name)
    return Path(path)


def size_tag(size: str) -> str:
    return size.replace(".", "_")


def torch_dtype(name: str, device: str):
    import torch

    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: {DTYPE_HINT}")
    return getattr(torch, DTYPES[name])


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available")
    return device
