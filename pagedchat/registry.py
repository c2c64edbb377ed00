"""models.toml: named models, their sources and default settings, bundled copy layered under the user's.

Settings resolve: CLI flag > /set > session > model entry > [defaults] > generation_config.json. Every
resolved value remembers where it came from, so `pagedchat models show` can say.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from pagedchat.errors import UserError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed", "stop")
ENTRY_KEYS = {"source", "path", "revision", "aliases", "dtype", "max_context", "chat_template",
              "chat_template_kwargs", "system_prompt", "stop", "sampling", "trust_remote_code", "kv", "description"}
DEFAULT_KEYS = ENTRY_KEYS | {"model", "keep_alive"}


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
        self.defaults = {**base.get("defaults", {}), **over.get("defaults", {})}
        self.models: dict[str, dict] = {}
        self.origin: dict[str, Path] = {}
        for path, doc in ((self.bundled_path, base), (self.user_path, over)):
            for name, table in (doc.get("models") or {}).items():
                self.models[name] = {**self.models.get(name, {}), **table}
                self.origin[name] = path
        for name, table in self.models.items():
            _validate_entry(self.origin[name], f"models.{name}", table, ENTRY_KEYS)
        _validate_entry(self.user_path if over.get("defaults") else self.bundled_path, "defaults", self.defaults,
                        DEFAULT_KEYS)

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
        """A registry name or alias, a local HF folder, or an HF repo id in the cache."""
        name = name_or_path or self.defaults.get("model")
        if not name:
            raise UserError("no model given (-m) and models.toml has no [defaults] model")
        key = self._lookup(name)
        if key is not None:
            table = self.models[key]
            source = table.get("path") or table.get("source")
            if not source:
                raise UserError(f"{self.origin[key]}: [models.{key}] needs a `source` (path or HF repo id)")
            return ModelEntry(key, _source_path(source, self.origin[key]), source, table, self.defaults)
        path = Path(name).expanduser()
        if path.exists() or "/" in name or name.startswith("."):
            return ModelEntry(name, path if path.exists() else Path(name), name, {}, self.defaults)
        known = self.names() + [a for t in self.models.values() for a in t.get("aliases") or []]
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known models: {', '.join(self.names())}"
        raise UserError(f"unknown model {name!r} (not in models.toml and not a folder){hint}")


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
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"invalid models.toml {path}: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


def _validate_entry(path: Path, where: str, table: dict, allowed: set[str]) -> None:
    if not isinstance(table, dict):
        raise UserError(f"invalid models.toml {path}: [{where}] must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise UserError(f"invalid models.toml {path}: [{where}] has unknown key {unknown[0]!r} "
                        f"(allowed: {', '.join(sorted(allowed))})")
    sampling = table.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise UserError(f"invalid models.toml {path}: [{where}] sampling must be a table")
    bad = sorted(set(sampling) - set(SAMPLING_KEYS))
    if bad:
        raise UserError(f"invalid models.toml {path}: [{where}] sampling has unknown key {bad[0]!r} "
                        f"(allowed: {', '.join(SAMPLING_KEYS)})")
    if "aliases" in table and not isinstance(table["aliases"], list):
        raise UserError(f"invalid models.toml {path}: [{where}] aliases must be a list of strings")


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
