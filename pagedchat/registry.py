"""models.toml: named models, their sources and default settings, bundled copy layered under the user's.

Settings resolve: CLI flag > /set > session > model entry > [defaults] > generation_config.json. Every
resolved value remembers where it came from, so `pagedchat models show` can say.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from pagedchat.dtypes import DTYPE_CHOICES, kv_dtype_problem
from pagedchat.errors import UserError

# Keys other tools' configs have that pagedchat does not read: refused with their line, never silently ignored.
_NOT_READ = {"kv": "the KV pool is sized per run: --kv-memory and --block-size",
             "keep_alive": "the model stays loaded exactly as long as the chat, run or serve process"}
ENTRY_KEYS = {"source", "path", "revision", "aliases", "dtype", "max_context", "chat_template",
              "chat_template_kwargs", "system_prompt", "stop", "sampling", "trust_remote_code", "description",
              "context_overflow", "speculate", "num_draft_tokens", "draft_model", "quantize", "kv_dtype", *_NOT_READ}
# kind = "remote": an OpenAI-compatible server generates (chat/remote_backend.py); `model` is the id it
# serves, `tokenizer` (a folder or models.toml name) or `path` the local tokenizer and template
REMOTE_KEYS = {"kind", "server", "api_key", "model", "tokenizer"}
DEFAULT_KEYS = (ENTRY_KEYS - {"trust_remote_code"}) | {"model"}  # remote code: per model only
ENTRY_KEYS = ENTRY_KEYS | REMOTE_KEYS


def user_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "pagedchat" / "models.toml"


def bundled_config_path() -> Path:
    return Path(str(resources.files("pagedchat") / "models.toml"))


@dataclass
class Setting:
    value: object
    source: str          # "cli", "model entry", "[defaults]", "generation_config.json", ...


@dataclass
class ModelEntry:
    name: str                               # registry name, or the path as given
    path: Path                              # resolved local folder or an HF repo id (as a Path-like string)
    source: str
    table: dict = field(default_factory=dict)      # the [models.NAME] table (may be empty for bare paths)
    defaults: dict = field(default_factory=dict)   # the [defaults] table

    def get(self, key: str, default=None) -> Setting:
        if key in self.table:
            return Setting(self.table[key], f"models.toml [models.{self.name}]")
        if key in self.defaults:
            return Setting(self.defaults[key], "models.toml [defaults]")
        return Setting(default, "built-in default")

    def sampling_defaults(self) -> dict[str, Setting]:
        """Sampling settings from generation_config.json, then [defaults], then the model entry."""
        out = {k: Setting(v, "generation_config.json") for k, v in _generation_config(self.path).items()}
        for key, value in (self.defaults.get("sampling") or {}).items():
            out[key] = Setting(value, "models.toml [defaults]")
        if "stop" in self.table:
            out["stop"] = Setting(self.table["stop"], f"models.toml [models.{self.name}]")
        for key, value in (self.table.get("sampling") or {}).items():
            out[key] = Setting(value, f"models.toml [models.{self.name}]")
        return out


class Registry:
    def __init__(self, bundled: Path | None = None, user: Path | None = None):
        self.bundled_path = bundled or bundled_config_path()
        self.user_path = user or user_config_path()
        base = _read_toml(self.bundled_path)
        over = _read_toml(self.user_path) if self.user_path.is_file() else {}
        for path, doc in ((self.bundled_path, base), (self.user_path, over)):
            _validate_top(path, doc)
        # Where each setting was read: "defaults" / model name -> key (or "sampling.KEY") -> file.
        self.origins: dict[str, dict[str, Path]] = {}
        self.defaults: dict = {}
        for path, doc in ((self.bundled_path, base), (self.user_path, over)):
            if "defaults" in doc:
                _validate_entry(path, "defaults", doc["defaults"], DEFAULT_KEYS)
                self.defaults = _layer(self.defaults, doc["defaults"], path, self.origins.setdefault("defaults", {}))
        self.models: dict[str, dict] = {}
        self.origin: dict[str, Path] = {}
        for path, doc in ((self.bundled_path, base), (self.user_path, over)):
            for name, table in (doc.get("models") or {}).items():
                _validate_entry(path, f"models.{name}", table, ENTRY_KEYS)
                self.models[name] = _layer(self.models.get(name, {}), table, path, self.origins.setdefault(name, {}))
                self.origin[name] = path
        _check_aliases(self)

    def where(self, table: str, key: str | None = None) -> str:
        """'file:line' of a setting (table = "defaults" or a model name; key may be "sampling.temperature")."""
        path = self.origins.get(table, {}).get(key) if key else self.origin.get(table)
        if path is None and table == "defaults" and key is None:
            path = next(iter(self.origins.get("defaults", {}).values()), None)
        if path is None:
            return ""
        header = "defaults" if table == "defaults" else f"models.{table}"
        line = locate(path, header, key)
        return f"{path}:{line}" if line else str(path)

    def names(self) -> list[str]:
        return sorted(self.models)

    def _lookup(self, name: str) -> str | None:
        if name in self.models:
            return name
        for key, table in self.models.items():
            if name in (table.get("aliases") or []):
                return key
        return None

    def resolve(self, name_or_path: str | None) -> ModelEntry:
        """A registry name or alias, a local HF folder, an HF repo id in the cache, or a GGUF reference (a .gguf
        file, ollama:NAME[:TAG], org/repo:QUANT): its entry's path is the GGUF's first file."""
        name = name_or_path or self.defaults.get("model")
        if not name:
            raise UserError("no model given (-m) and models.toml has no [defaults] model")
        key = self._lookup(name)
        if key is not None:
            table = self.models[key]
            source = table.get("path") or table.get("source")
            if not source and table.get("kind") == "remote":   # no local folder: the server's id names it
                return ModelEntry(key, Path(table.get("model") or key), table.get("model") or key, table,
                                  self.defaults)
            if not source:
                raise UserError(f"{self.origin[key]}: [models.{key}] needs a `source` (path or HF repo id)")
            origin = self.origins[key].get("path") or self.origins[key].get("source") or self.origin[key]
            gguf = _gguf_files(source if source.startswith("ollama:") else str(_source_path(source, origin)))
            return ModelEntry(key, gguf[0] if gguf else _source_path(source, origin), source, table, self.defaults)
        gguf = _gguf_files(name)
        if gguf:
            return ModelEntry(name, gguf[0], name, {}, self.defaults)
        path = Path(name).expanduser()
        if path.exists() or "/" in name or name.startswith("."):
            return ModelEntry(name, path if path.exists() else Path(name), name, {}, self.defaults)
        known = self.names() + [a for t in self.models.values() for a in t.get("aliases") or []]
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known models: {', '.join(self.names())}"
        hint = f"; did you mean {ollama}?" if (ollama := _ollama_hint(name)) else hint
        raise UserError(f"unknown model {name!r} (not in models.toml and not a folder){hint}")


def _gguf_files(reference: str) -> list[Path] | None:
    """The GGUF file(s) a reference names; None for anything else (registry names, HF folders and ids)."""
    from pagedchat.model.gguf.locate import resolve_gguf

    return resolve_gguf(reference)


def _ollama_hint(name: str) -> str | None:
    """`ollama:NAME` when a bare name is an Ollama model (`ollama run` takes it without the prefix)."""
    from pagedchat.model.gguf.locate import ollama_reference_for

    return ollama_reference_for(name)


def _source_path(source: str, origin: Path) -> Path:
    if source.startswith("pkg:"):
        return Path(str(resources.files("pagedchat") / source[4:]))
    if source.startswith("hf:"):
        return Path(source[3:])
    path = Path(source).expanduser()
    if not path.is_absolute() and (origin.parent / path).exists():
        return origin.parent / path
    return path


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: invalid TOML: not UTF-8 text (byte 0x{e.object[e.start]:02x})") from None
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)", message)
        if m:
            message = f"{message[:m.start()]}{message[m.end():]}"
            raise UserError(f"{path}:{m.group(1)}:{m.group(2)}: invalid TOML: {message}") from None
        raise UserError(f"{path}: invalid TOML: {message}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


_SUBTABLES = ("sampling", "chat_template_kwargs")


def _layer(base: dict, over: dict, path: Path, origins: dict) -> dict:
    """`over` on top of `base`; sub-tables such as sampling merge key by key. Records each key's file."""
    out = dict(base)
    for key, value in over.items():
        if key in _SUBTABLES and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
        origins[key] = path
        if key in _SUBTABLES and isinstance(value, dict):
            for sub in value:
                origins[f"{key}.{sub}"] = path
    return out


def locate(path: Path, header: str, key: str | None = None) -> int | None:
    """Line number of `key` ("name" or "sampling.name") in table [header] of a TOML file; the header's line
    when the key is not written there; None when the table is not in the file either."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    first, _, rest = (key or "").partition(".")
    current, header_line = None, None
    for number, line in enumerate(lines, 1):
        m = re.match(r"^\s*\[\s*([^\[\]]+?)\s*\]", line)
        if m:
            current = re.sub(r"[\s\"']", "", m.group(1))
            if current == header and header_line is None:
                header_line = number
                if key is None:
                    return number
            continue
        if key is None:
            continue
        name = r"^\s*[\"']?{}[\"']?\s*"
        if current == header and re.match(name.format(re.escape(first)) + (r"[=.]" if rest else "="), line):
            return number
        if rest and current == f"{header}.{first}" and re.match(name.format(re.escape(rest)) + "=", line):
            return number
    return header_line


def _validate_top(path: Path, doc: dict) -> None:
    unknown = sorted(set(doc) - {"defaults", "models"})
    if unknown:
        raise UserError(f"{path}:{locate(path, unknown[0]) or 1}: unknown top-level table [{unknown[0]}] "
                        f"(models.toml has [defaults] and [models.NAME])")
    if not isinstance(doc.get("models", {}), dict):
        raise UserError(f"{path}: `models` must be a table of [models.NAME] tables")


def _check_aliases(registry: "Registry") -> None:
    seen: dict[str, str] = {}
    for name, table in registry.models.items():
        for alias in table.get("aliases") or []:
            other = seen.get(alias) or (alias if alias in registry.models and alias != name else None)
            if other:
                raise UserError(f"{registry.where(name, 'aliases')}: alias {alias!r} of [models.{name}] is "
                                f"already the name or an alias of [models.{other}]")
            seen[alias] = name


_TYPES = {"source": str, "path": str, "revision": str, "dtype": str, "chat_template": str, "system_prompt": str,
          "description": str, "model": str, "trust_remote_code": bool, "max_context": int,
          "sampling": dict, "chat_template_kwargs": dict, "speculate": str, "num_draft_tokens": int,
          "draft_model": str, "kind": str, "server": str, "api_key": str, "tokenizer": str, "quantize": str,
          "kv_dtype": str}


def _validate_entry(path: Path, where: str, table: dict, allowed: set[str]) -> None:
    def fail(message: str, key: str | None = None):
        line = locate(path, where, key)
        if isinstance(table, dict) and isinstance(table.get(key), dict):   # written as its own [where.key] table?
            line = locate(path, f"{where}.{key}") or line
        raise UserError(f"{path}:{line}: [{where}] {message}" if line else f"{path}: [{where}] {message}")

    if not isinstance(table, dict):
        fail("must be a table")
    if where == "defaults" and "trust_remote_code" in table:
        fail("trust_remote_code is allowed only in a model's own [models.NAME] table: it lets that model's "
             "folder run code on this machine", "trust_remote_code")
    for key in sorted(set(table) & set(_NOT_READ)):
        fail(f"{key} is not a setting pagedchat reads ({_NOT_READ[key]}): remove it", key)
    unknown = sorted(set(table) - allowed)
    if unknown:
        fail(f"has unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})", unknown[0])
    for key, kind in _TYPES.items():
        if key in table and (not isinstance(table[key], kind) or kind is int and isinstance(table[key], bool)):
            fail(f"{key} must be {_KIND_NAMES[kind]}, got {table[key]!r}", key)
    if "kind" in table and table["kind"] not in ("local", "remote"):
        fail(f"kind must be \"local\" or \"remote\", got {table['kind']!r}", "kind")
    if where != "defaults":
        remote_only = sorted(set(table) & (REMOTE_KEYS - {"kind"}))
        if table.get("kind") == "remote" and "server" not in table:
            fail("a kind = \"remote\" entry needs `server` (the URL of an OpenAI-compatible server)", "kind")
        if table.get("kind") != "remote" and remote_only:
            fail(f"{remote_only[0]} is for kind = \"remote\" entries (a model an OpenAI-compatible server runs)",
                 remote_only[0])
    if "dtype" in table and table["dtype"] not in DTYPE_CHOICES:
        fail(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {table['dtype']!r}", "dtype")
    if "speculate" in table and table["speculate"] not in ("ngram", "draft", "off"):
        fail(f"speculate must be ngram, draft or off, got {table['speculate']!r}", "speculate")
    if "quantize" in table and table["quantize"] not in ("int8", "int4", "none"):
        fail(f"quantize must be int8, int4 or none, got {table['quantize']!r}", "quantize")
    if "kv_dtype" in table and kv_dtype_problem(table["kv_dtype"]):
        fail(kv_dtype_problem(table["kv_dtype"]).format(name="kv_dtype"), "kv_dtype")
    if "max_context" in table and table["max_context"] < 1:
        fail(f"max_context must be a positive number of tokens, got {table['max_context']}", "max_context")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        fail("aliases must be a list of strings", "aliases")
    stop = table.get("stop", [])
    if not isinstance(stop, (str, list)) or isinstance(stop, list) and not all(isinstance(x, str) for x in stop):
        fail("stop must be a string or a list of strings", "stop")
    sampling = table.get("sampling") or {}
    if sampling:
        from pagedchat.engine.core.sampling_params import SETTING_KEYS, SamplingParams

        bad = sorted(set(sampling) - set(SETTING_KEYS))
        if bad:
            fail(f"sampling has unknown key {bad[0]!r} (allowed: {', '.join(SETTING_KEYS)})", f"sampling.{bad[0]}")

        try:
            SamplingParams(**sampling)
        except UserError as e:
            fail(f"sampling: {e}", f"sampling.{next(iter(sampling))}")
        except TypeError as e:
            fail(f"sampling: {e}", "sampling")


_KIND_NAMES = {str: "a string", bool: "true or false", int: "an integer", dict: "a table"}


def _generation_config(path: Path) -> dict:
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except ValueError:
        raise UserError(f"{file} is not valid JSON") from None
    out = {k: data[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in data}
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    if "max_new_tokens" in data:
        out["max_tokens"] = data["max_new_tokens"]
    return out
