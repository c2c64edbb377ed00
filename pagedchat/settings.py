"""Settings shared by every front end (run, chat, serve): model and pool options, engine construction,
sampling resolution across layers, and chat-template rendering. Below the CLI and the chat layer, so both
import it without an upward arrow."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from pagedchat.errors import UserError


@dataclass
class ModelOptions:
    model: Optional[str] = None
    device: str = "auto"
    dtype: Optional[str] = None
    block_size: int = 16
    kv_memory: Optional[str] = None
    max_context: Optional[int] = None
    kv_allocation: str = "paged"    # serve only: "reserved" is the contiguous-cache peer of `bench serve`
    kv_disk: Optional[str] = None   # None = DEFAULT_KV_DISK; "0" = no disk tier
    kv_ram: Optional[str] = None    # None = DEFAULT_KV_RAM; "0" = no RAM tier


# KV that outlives a block's eviction and the process (see pagedchat/engine/kv_tiers.py)
DEFAULT_KV_DISK = "2GiB"
DEFAULT_KV_RAM = "512MiB"


@dataclass
class SamplingOptions:
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = None

    def given(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, [])}


def load_engine(opts: ModelOptions, show_progress: bool = True):
    """Resolve the model through models.toml and build the engine (model, tokenizer, pool)."""
    from pagedchat.engine import Engine, EngineConfig
    from pagedchat.registry import Registry

    entry = Registry().resolve(opts.model)
    dtype = opts.dtype or entry.get("dtype", "auto").value
    max_context = opts.max_context if opts.max_context is not None else entry.get("max_context").value
    trust = bool(entry.table.get("trust_remote_code", False))  # per model only, never from [defaults]
    config = EngineConfig(model=str(entry.path), device=opts.device, dtype=dtype, block_size=opts.block_size,
                          kv_memory=opts.kv_memory, max_model_len=max_context, trust_remote_code=trust,
                          kv_allocation=opts.kv_allocation,
                          kv_disk=opts.kv_disk if opts.kv_disk is not None else DEFAULT_KV_DISK,
                          kv_ram=opts.kv_ram if opts.kv_ram is not None else DEFAULT_KV_RAM)
    engine = Engine(config, show_progress=show_progress)
    if entry.table.get("chat_template") and engine.tokenizer is not None:
        engine.tokenizer.chat_template = _read_template(entry.table["chat_template"], entry)
    return engine, entry


def kv_report(pool) -> dict:
    """The `--json` "kv" object. prefix_hit_tokens counts every reused prompt token; ram_hit_tokens and
    disk_hit_tokens say how many of them were loaded back from the RAM and disk tiers."""
    return {"block_size": pool.block_size, "num_blocks": pool.num_blocks, "peak_blocks_used": pool.peak_used,
            "prefix_hit_tokens": pool.prefix_hit_tokens, "ram_hit_tokens": pool.ram_hit_tokens,
            "disk_hit_tokens": pool.disk_hit_tokens}


def _read_template(value: str, entry) -> str:
    from pathlib import Path

    path = Path(value).expanduser()
    if path.suffix in (".jinja", ".j2", ".txt") or path.is_file():
        try:
            return path.read_text()
        except OSError as e:
            raise UserError(f"chat_template file {path} for model {entry.name}: {e.strerror}") from None
    return value


def resolve_sampling(entry, cli: SamplingOptions, *layers: dict):
    """SamplingParams from: CLI flags > given layers (e.g. /set, session) > model entry > [defaults] >
    generation_config.json. Returns (params, {key: source})."""
    from pagedchat.engine import SamplingParams

    merged = {k: (s.value, s.source) for k, s in entry.sampling_defaults().items()}
    for layer in reversed(layers):
        for key, value in layer.items():
            if value is not None and key != "__source__":
                merged[key] = (value, layer.get("__source__", "session"))
    for key, value in cli.given().items():
        merged[key] = (value, "command-line flag")
    values = {k: v for k, (v, _) in merged.items()}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    return SamplingParams(**values), {k: src for k, (_, src) in merged.items()}


def chat_prompt_ids(engine, user: str, system: str | None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of [system?, user] rendered by the model's chat template, ready for the reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render_chat(engine, messages, template_kwargs)


def render_chat(engine, messages: list[dict], template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    tok = engine.tokenizer
    if tok is None:
        raise UserError(f"model {engine.loaded.path} has no tokenizer")
    if not getattr(tok, "chat_template", None):
        raise UserError(f"model {engine.loaded.path} has no chat template; use --raw or set chat_template "
                        f"in models.toml")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      **(template_kwargs or {}))
    except Exception as e:  # jinja errors: a broken template, or one that refuses these messages
        raise UserError(f"the chat template of {engine.loaded.path} failed: {str(e).splitlines()[0]} "
                        f"(fix it, or use --raw)") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
