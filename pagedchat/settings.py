"""Settings shared by every front end (run, chat, serve): model and pool options, engine construction and
sampling resolution across layers. Below the CLI and the chat layer, so both import it without an upward
arrow. (Chat-template rendering is prompts.py.)"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from pagedchat.errors import SettingError, UserError

# Variants of one prompt (run -n, /fork N, the server's n). Every variant of a request runs in the same steps,
# so the engine refuses more than EngineConfig.max_num_seqs (256 by default) of them: TooManyVariants, the
# one hard limit, for `run -n`. Two front ends stop lower, for their own reasons:
MAX_FORK_VARIANTS = 16       # the REPL shows the variants side by side or stacked: more cannot be read
MAX_SERVER_VARIANTS = 128    # the OpenAI API's own bound for `n`: clients written for it never ask more


@dataclass
class ModelOptions:
    model: Optional[str] = None
    device: str = "auto"
    dtype: Optional[str] = None
    block_size: int = 16
    kv_memory: Optional[str] = None
    max_context: Optional[int] = None
    kv_allocation: str = "paged"    # serve only: "reserved" is the contiguous-cache peer of `bench serve`
    speculate: Optional[str] = None        # ngram | draft | off (None: models.toml, else off)
    num_draft_tokens: Optional[int] = None
    draft_model: Optional[str] = None
    quantize: Optional[str] = None         # int8 | none (None: models.toml, else none)
    server: Optional[str] = None    # chat/run: an OpenAI-compatible server generates (chat/remote_backend.py)
    kv_disk: Optional[str] = None   # None = DEFAULT_KV_DISK; "0" = no disk tier
    kv_ram: Optional[str] = None    # None = DEFAULT_KV_RAM; "0" = no RAM tier


# KV that outlives a block's eviction and the process (see pagedchat/engine/kv/tiers.py)
DEFAULT_KV_DISK = "2GiB"
DEFAULT_KV_RAM = "512MiB"


@dataclass
class SamplingOptions:
    """The sampling flags as given (None = not given): exactly SamplingParams' SETTING_KEYS (a test checks;
    not derived at import time because the CLI starts without importing the engine)."""
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[list[str]] = None

    def given(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, [])}


def load_engine(opts: ModelOptions, show_progress: bool = True):
    """Resolve the model through models.toml and build the engine (model, tokenizer, pool). Every setting is
    checked before torch loads (`engine_config`), so a bad flag fails at once."""
    entry = resolve_entry(opts)
    config = engine_config(opts, entry)
    from pagedchat.engine import Engine

    try:
        return Engine(config, show_progress=show_progress), entry
    except SettingError as e:
        raise UserError(cli_words(e)) from None


def resolve_entry(opts: ModelOptions):
    """The models.toml entry (or folder) -m names; one line when it names nothing or a remote model."""
    from pagedchat.registry import Registry

    entry = Registry().resolve(opts.model)
    if entry.table.get("kind") == "remote":
        raise UserError(f"model {entry.name} is a remote model (kind = \"remote\" in models.toml): `chat` and "
                        f"`run` reach it through its server; the local engine cannot load it")
    return entry


def engine_config(opts: ModelOptions, entry):
    """The EngineConfig of these flags over the model's models.toml entry, validated (torch-free: the
    config module imports nothing heavy)."""
    from pagedchat.engine.core.config import EngineConfig

    dtype = opts.dtype or entry.get("dtype", "auto").value
    max_context = opts.max_context if opts.max_context is not None else entry.get("max_context").value
    trust = bool(entry.table.get("trust_remote_code", False))  # per model only, never from [defaults]
    template = _read_template(entry.table["chat_template"], entry) if entry.table.get("chat_template") else None
    try:
        return EngineConfig(model=str(entry.path), device=opts.device, dtype=dtype, block_size=opts.block_size,
                            kv_memory=opts.kv_memory, max_model_len=max_context, trust_remote_code=trust,
                            kv_allocation=opts.kv_allocation, chat_template=template,
                            kv_disk=opts.kv_disk if opts.kv_disk is not None else DEFAULT_KV_DISK,
                            kv_ram=opts.kv_ram if opts.kv_ram is not None else DEFAULT_KV_RAM,
                            quantize=quantize_setting(opts, entry), **speculation_settings(opts, entry))
    except SettingError as e:
        raise UserError(cli_words(e)) from None


def check_before_load(opts: ModelOptions, sampling: SamplingOptions | None = None,
                      model_from_session: bool = False) -> None:
    """What the model, pool and sampling flags can be checked for without torch (the model named, sizes,
    block size, dtype, quantize, speculation; every sampling value), so these errors come in a fraction of
    a second instead of after torch has loaded. A server (--server, a remote entry) checks its own flags;
    model_from_session: no -m, and a saved session will name the model (checked when it is opened)."""
    if sampling is not None:
        check_sampling(sampling)
    if not model_from_session and not is_remote(opts):
        engine_config(opts, resolve_entry(opts))


def check_sampling(sampling: SamplingOptions) -> None:
    """The sampling flags as SamplingParams checks them (the one message, one line)."""
    from pagedchat.engine.core.sampling_params import SamplingParams

    SamplingParams(**sampling.given())


def is_remote(opts) -> bool:
    """--server given, or -m names a `kind = "remote"` models.toml entry."""
    if getattr(opts, "server", None):
        return True
    if not opts.model:
        return False
    from pagedchat.registry import Registry

    registry = Registry()
    key = registry._lookup(opts.model)
    return key is not None and registry.models[key].get("kind") == "remote"


def kv_report(pool) -> dict:
    """The `--json` "kv" object. prefix_hit_tokens counts every reused prompt token; ram_hit_tokens and
    disk_hit_tokens say how many of them were loaded back from the RAM and disk tiers."""
    return {"block_size": pool.block_size, "num_blocks": pool.num_blocks, "peak_blocks_used": pool.peak_used,
            "prefix_hit_tokens": pool.prefix_hit_tokens, "ram_hit_tokens": pool.ram_hit_tokens,
            "disk_hit_tokens": pool.disk_hit_tokens}


def quantize_setting(opts: ModelOptions, entry) -> str | None:
    """--quantize over the models.toml key ("none" turns off a quantize that [defaults] sets)."""
    return opts.quantize if opts.quantize is not None else entry.get("quantize", None).value


def speculation_settings(opts: ModelOptions, entry) -> dict:
    """--speculate / --num-draft-tokens / --draft-model over the models.toml keys of the same names. A draft
    model is named like -m: a models.toml entry or a folder."""
    from pagedchat.registry import Registry

    def pick(key, default):
        value = getattr(opts, key)
        return value if value is not None else entry.get(key, default).value

    draft = pick("draft_model", None)
    method = pick("speculate", None) or ("draft" if draft else "off")
    out = {"speculate": method, "num_draft_tokens": pick("num_draft_tokens", 6)}
    if method == "draft" and draft:
        out["draft_model"] = str(Registry().resolve(draft).path)
    return out


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
    """SamplingParams from: CLI flags > given layers (e.g. /set, session, a --file line) > model entry >
    [defaults] > generation_config.json, by `merge_sampling`'s rule. Returns (params, {key: source})."""
    model = {k: (s.value, s.source) for k, s in entry.sampling_defaults().items()}
    return merge_sampling(model, {**cli.given(), "__source__": "command-line flag"}, *layers)


def merge_sampling(model: dict[str, tuple], *layers: dict):
    """The one sampling rule of every front end (run, chat, serve). `model`: key -> (value, source) from the
    model's own settings; each layer: key -> value plus "__source__", the first layer that gives a key wins
    over the later ones and over the model. Stop strings are the exception: the model's stay in force and
    the winning layer's are added after them (a model's stop strings end its turns, so `--stop`, `/set stop`
    or a request's `stop` cannot switch them off by accident). Returns (SamplingParams, {key: source})."""
    from pagedchat.engine.core.sampling_params import SamplingParams

    merged = dict(model)
    for layer in reversed(layers):
        for key, value in layer.items():
            if value is not None and key != "__source__":
                merged[key] = (value, layer.get("__source__", "session"))
    values = {k: v for k, (v, _) in merged.items()}
    sources = {k: src for k, (_, src) in merged.items()}
    if "stop" in merged and merged["stop"] != model.get("stop"):
        model_stop, model_source = model.get("stop", ([], None))
        values["stop"] = list(dict.fromkeys(_strings(model_stop) + _strings(values["stop"])))
        if model_source and _strings(model_stop):
            sources["stop"] = f"{model_source} + {sources['stop']}"
    elif "stop" in values:
        values["stop"] = _strings(values["stop"])
    return SamplingParams(**values), sources


def _strings(stop) -> list:
    """A stop setting as a list (one string or a list of them; other values are left for SamplingParams'
    own check)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [stop]


# EngineConfig setting -> the flag that sets it (run, chat and serve share them: commands/common.py)
_FLAGS = {"block_size": "--block-size", "max_model_len": "--max-context", "kv_memory": "--kv-memory",
          "device": "--device", "dtype": "--dtype", "kv_allocation": "--kv-allocation", "speculate": "--speculate",
          "num_draft_tokens": "--num-draft-tokens", "quantize": "--quantize"}


OVERFLOW_POLICIES = ("stop", "drop-oldest")   # what a conversation that outgrows the context does


def check_overflow(value, where: str) -> str | None:
    """A context_overflow value (flag, /set, models.toml, request) checked once, named by where it came from."""
    if value is not None and value not in OVERFLOW_POLICIES:
        raise UserError(f"{where} must be one of {', '.join(OVERFLOW_POLICIES)}, got {value!r}")
    return value


def cli_words(error: Exception) -> str:
    """An engine error as the command line says it: the engine names its settings, the CLI its flags."""
    from pagedchat.errors import PoolTooSmall, SettingError

    if isinstance(error, PoolTooSmall):
        return error.advise("raise --kv-memory")
    if isinstance(error, SettingError):
        return error.named(_FLAGS.get(error.setting, error.setting))
    return str(error)
