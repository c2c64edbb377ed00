"""`pagedchat cache stats|clear [--model M]`: the disk KV tier ($XDG_CACHE_HOME/pagedchat/kv/<fingerprint>/)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import typer

from pagedchat.errors import UserError

cache_app = typer.Typer(help="The disk KV tier ($XDG_CACHE_HOME/pagedchat/kv): blocks kept across processes, "
                             "one folder per model fingerprint.", no_args_is_help=True)
MODEL = typer.Option(None, "-m", "--model", help="Only this model's fingerprints (models.toml name or folder).")


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")


def _fingerprint_dirs(model: str | None) -> list[Path]:
    from pagedchat.engine.kv.disk import read_meta
    from pagedchat.engine.kv.fingerprint import kv_cache_root

    root = kv_cache_root()
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if model is None:
        return folders
    digest = _model_digest(model)
    return [p for p in folders if read_meta(p).get("model_digest") == digest]


def _model_digest(model: str) -> str:
    from pagedchat.engine.kv.fingerprint import model_digest
    from pagedchat.model.loader import find_model_dir, weight_files
    from pagedchat.registry import Registry

    folder = find_model_dir(str(Registry().resolve(model).path))
    return model_digest(folder, weight_files(folder))


@cache_app.command("stats", help="Per model fingerprint: blocks, bytes and hits served from disk.")
def stats(model: Optional[str] = MODEL, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    from pagedchat.engine.kv.disk import folder_usage, read_meta, read_stats
    from pagedchat.engine.kv.fingerprint import kv_cache_root

    rows = []
    for folder in _fingerprint_dirs(model):
        usage, meta, hits = folder_usage(folder), read_meta(folder), read_stats(folder)
        rows.append({"fingerprint": folder.name, "model": meta.get("model_path"), "dtype": meta.get("dtype"),
                     "block_size": meta.get("block_size"), "device": meta.get("device"), "blocks": usage.blocks,
                     "bytes": usage.bytes, "hits": hits.get("hits", 0), "hit_tokens": hits.get("hit_tokens", 0)})
    if as_json:
        print(json.dumps({"folder": str(kv_cache_root()), "fingerprints": rows}))
        return
    if not rows:
        print(f"no cached KV blocks{' for ' + model if model else ''} in {kv_cache_root()}")
        return
    for r in rows:
        print(f"{r['fingerprint']}  {r['blocks']} blocks  {_size(r['bytes'])}  {r['hits']} hits "
              f"({r['hit_tokens']} tokens)  {r['model']}  {r['dtype']}  block {r['block_size']}  {r['device']}")
    print(f"{sum(r['blocks'] for r in rows)} blocks, {_size(sum(r['bytes'] for r in rows))} in {kv_cache_root()}")


@cache_app.command("clear", help="Delete the cached blocks (all, or one model's).")
def clear(model: Optional[str] = MODEL) -> None:
    from pagedchat.engine.kv.disk import folder_usage

    blocks = size = 0
    folders = _fingerprint_dirs(model)
    for folder in folders:
        usage = folder_usage(folder)
        try:
            shutil.rmtree(folder)
        except OSError as e:
            raise UserError(f"cannot remove {folder}: {e.strerror}") from None
        blocks, size = blocks + usage.blocks, size + usage.bytes
    print(f"removed {blocks} blocks ({_size(size)}) in {len(folders)} fingerprint folders")


def _size(n: int) -> str:
    value, units = float(n), ["B", "KiB", "MiB", "GiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]}"
