"""Where pagedchat keeps what it can rebuild: $XDG_CACHE_HOME/pagedchat (default ~/.cache/pagedchat). Read at
each call, as the environment may change within a process (the tests give each session a cache of its own)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def cache_dir(name: str) -> Path:
    """pagedchat's cache folder `name` (native builds, the KV disk tier, parsed GGUF headers)."""
    return cache_home() / "pagedchat" / name
