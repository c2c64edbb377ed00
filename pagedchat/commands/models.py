"""`pagedchat models list|show NAME`: the models.toml registry and every resolved setting with its source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

models_app = typer.Typer(help="The model registry (models.toml: bundled copy, user copy layered over it).",
                         no_args_is_help=False, invoke_without_command=True)

ENTRY_SETTINGS = ("source", "revision", "aliases", "dtype", "kv_dtype", "max_context", "chat_template",
                  "chat_template_kwargs", "system_prompt", "stop", "trust_remote_code", "description")


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


@models_app.callback()
def _default(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        list_models(as_json=False)


@models_app.command("list", help="Models in models.toml with their aliases, source and whether they are present, "
                                  "then the GGUF files found in Ollama's store, the HF cache and LM Studio's folder.")
def list_models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from pagedchat.model.gguf.locate import list_local_ggufs
    from pagedchat.registry import Registry

    registry = Registry()
    default = registry.defaults.get("model")
    rows = []
    for name in registry.names():
        table = registry.models[name]
        try:
            entry = registry.resolve(name)
            status = _status(entry.path, entry.source, table)
        except Exception as e:  # one bad entry must not hide the others
            status = f"error: {e}"
        rows.append({"name": name, "default": name == default, "aliases": table.get("aliases") or [],
                     "source": table.get("path") or table.get("source") or "", "status": status,
                     "description": table.get("description", ""), "defined_in": registry.where(name)})
    ggufs = list_local_ggufs()
    if as_json:
        print(json.dumps({"models": rows, "config": _config_files(registry),
                          "ggufs": [{"name": g.name, "path": str(g.path), "size": g.size, "where": g.where}
                                    for g in ggufs]}))
        return
    console = Console(highlight=False)
    view = Table(box=None, padding=(0, 1), header_style="bold")
    columns = ["", "name", "aliases", "source", "status"] + (["description"] if any(r["description"] for r in rows)
                                                           else [])
    for column in columns:   # words wrap at spaces; a path at its slashes (_wrap_path), never mid-word
        view.add_column(column, no_wrap=column in ("", "name"), ratio=2 if column == "description" else None)
    for row in rows:
        cells = ["*" if row["default"] else "", row["name"], ", ".join(row["aliases"]),
                 _wrap_path(row["source"], PATH_WIDTH), row["status"], row["description"]]
        view.add_row(*(Text(c) for c in cells[:len(columns)]))
    console.print(view)
    _print_ggufs(console, ggufs)
    for label, path, exists in _config_files(registry):
        console.print(Text(f"{label}: {path}{'' if exists else ' (not present)'}", style="dim"), soft_wrap=True)
    console.print(Text("* default model · any local HF folder or GGUF file also works with -m PATH", style="dim"))


def _print_ggufs(console, ggufs) -> None:
    """The GGUF files found, one a line: where, size, then the name that opens it last and never wrapped
    (a long path stays one piece to copy)."""
    from rich.text import Text

    from pagedchat.model.gguf.locate import gguf_stores

    if not ggufs:
        looked = ", ".join(str(folder) for _, folder in gguf_stores())
        console.print(Text(f"no GGUF files found (looked in {looked})", style="dim"), soft_wrap=True)
        return
    console.print()
    console.print(Text("GGUF files found (open one with -m NAME)", style="bold"))
    width = max(len(g.where) for g in ggufs)
    for g in ggufs:
        console.print(Text(f" {g.where:<{width}}  {_size_text(g.size):>8}  {g.name}"), soft_wrap=True)


def _size_text(size: int) -> str:
    """Bytes in decimal units, as `ollama list` and the HF hub show a file's size."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


@models_app.command("show", help="Every resolved setting of a model and where it came from.")
def show_model(name: str = typer.Argument(..., help="models.toml name or alias, or a model folder."),
               as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from pagedchat.engine.core.sampling_params import SETTING_KEYS, SamplingParams
    from pagedchat.registry import Registry

    registry = Registry()
    entry = registry.resolve(name)
    here = "command line (a GGUF file)" if _is_gguf(entry.source) else "command line (a folder)"
    rows = [("model", entry.name, registry.where(entry.name) if entry.table else here),
            ("path", str(entry.path), _status(entry.path, entry.source, entry.table))]
    gguf = _gguf_summary(entry.path)
    family = gguf["family"] if gguf else _family(entry.path)
    described_by = "the GGUF file's metadata" if gguf else "the model's config.json"
    if family is not None:
        rows.append(("family", family, described_by))
    if gguf:
        rows.append(("weights", gguf["formats"], described_by))
    for key in ENTRY_SETTINGS:
        setting = entry.get(key)
        if key == "source" or setting.value is None and key not in ("dtype", "kv_dtype", "max_context"):
            continue
        value, source = setting.value, _where(registry, entry, key, setting.source)
        if key == "dtype" and value is None:
            value, source = "auto", "built-in default (bf16 on CUDA, fp32 on CPU)"
        if key == "kv_dtype" and value is None:
            value, source = "auto", "built-in default (the KV pool stores the model's dtype)"
        if key == "max_context" and value is None:
            value, source = (gguf["max_context"] if gguf else _max_positions(entry.path)), described_by
        rows.append((key, value, source))
    resolved = entry.sampling_defaults()
    defaults = SamplingParams()
    for key in SETTING_KEYS:
        if key in resolved:
            s = resolved[key]
            rows.append((f"sampling.{key}", s.value, _where(registry, entry, f"sampling.{key}", s.source)))
        else:
            rows.append((f"sampling.{key}", getattr(defaults, key), "built-in default"))
    if as_json:
        print(json.dumps({"name": entry.name, "settings": [{"key": k, "value": _jsonable(v), "from": src}
                                                           for k, v, src in rows]}))
        return
    console = Console(highlight=False)
    view = Table(box=None, padding=(0, 1), header_style="bold", title=f"model {entry.name}", title_justify="left")
    width = max(PATH_WIDTH, min(2 * PATH_WIDTH, console.width - 2 * PATH_WIDTH))   # 30 columns of 80, 60 of 120
    view.add_column("setting", no_wrap=True)
    view.add_column("value", width=width)     # words wrap at spaces, a path at its slashes
    view.add_column("from")
    for key, value, source in rows:
        view.add_row(key, Text(_wrap_path(_show(value), width)), Text(_short(source, registry)))
    console.print(view)
    for label, path, exists in _config_files(registry):
        console.print(Text(f"{label}: {path}{'' if exists else ' (not present)'}", style="dim"), soft_wrap=True)
    console.print(Text("precedence: command-line flag > /set > session > model entry > [defaults] > "
                       "generation_config.json > built-in", style="dim"))


def _where(registry, entry, key: str, source: str) -> str:
    """Turn a Setting.source into 'file:line [table]' when it came from a models.toml."""
    if "[defaults]" in source:
        return f"{registry.where('defaults', key)} [defaults]"
    if f"[models.{entry.name}]" in source:
        if key.startswith("sampling.") and key not in registry.origins.get(entry.name, {}):
            key = "stop"  # a top-level `stop` of the model entry feeds sampling.stop
        return f"{registry.where(entry.name, key)} [models.{entry.name}]"
    if source == "generation_config.json":
        return str(Path(entry.path) / "generation_config.json")
    return source


def _status(path: Path, source: str, table: dict | None = None) -> str:
    if (table or {}).get("kind") == "remote":   # generated by a server; the folder (if any) is the tokenizer's
        return f"remote: {table.get('server')}"
    path, source = Path(path), str(source)
    if path.is_file() and _is_gguf(source):
        return "ready (GGUF)"
    if path.is_dir():
        return "ready" if (path / "config.json").is_file() else "folder without config.json"
    if source.startswith("hf:") or (source.count("/") == 1 and not source.startswith(("pkg:", ".", "/", "~"))):
        return "HF repo id (loaded from the local HF cache)"
    return "missing"


def _is_gguf(reference: str) -> bool:
    from pagedchat.model.gguf.locate import is_gguf_reference

    return is_gguf_reference(str(reference))


def _gguf_summary(path: Path) -> Optional[dict]:
    """Family, context and weight formats of a GGUF file (its header only), or None for a folder."""
    from pagedchat.model.gguf.locate import resolve_gguf

    parts = resolve_gguf(str(path)) if Path(path).is_file() else None
    if not parts:
        return None
    from pagedchat.errors import ModelLoadError
    from pagedchat.model.gguf.arch import summary
    from pagedchat.model.gguf.reader import open_gguf

    try:
        return summary(open_gguf(parts))
    except ModelLoadError as e:   # show the settings anyway; loading it would fail with this line
        return {"family": f"unreadable: {e}", "max_context": None, "formats": "?", "name": None}


def _family(path: Path) -> Optional[str]:
    """The model family its config.json's `architectures` names (or that it is unsupported)."""
    from pagedchat.model.families import family_for

    try:
        arch = (json.loads((Path(path) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None
    family = family_for(arch)
    return f"{family.name}: {family.label}" if family else f"unsupported architecture {arch!r}"


def _max_positions(path: Path) -> Optional[int]:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def _short(source: str, registry) -> str:
    """File paths of the two models.toml copies as short labels (their full paths are printed below); a
    folder's file by its name alone (the path row shows the folder)."""
    for label, path, _ in _config_files(registry):
        source = source.replace(path + ":", label.split()[0] + " models.toml:")
    return Path(source).name if source.endswith("generation_config.json") else source


PATH_WIDTH = 30     # a path in a table is cut into lines this long at its slashes (80 columns hold the rest)


def _wrap_path(text: str, width: int) -> str:
    """A path longer than `width` as lines broken after a slash (a table would otherwise break it mid-name,
    wherever the column ends). Text with spaces is left alone: it wraps at them."""
    if len(text) <= width or " " in text or "/" not in text:
        return text
    lines, line = [], ""
    for part in text.replace("/", "/\0").split("\0"):
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
    return "\n".join(lines + [line] if line else lines)


def _config_files(registry) -> list:
    return [("bundled models.toml", str(registry.bundled_path), registry.bundled_path.is_file()),
            ("user models.toml", str(registry.user_path), registry.user_path.is_file())]


def _show(value) -> str:
    if isinstance(value, str):
        return repr(value) if value == "" or value != value.strip() or "\n" in value else value
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def _jsonable(value):
    return value if isinstance(value, (str, int, float, bool, list, dict)) or value is None else str(value)
