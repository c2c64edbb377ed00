"""Parsed GGUF headers kept between processes, under $XDG_CACHE_HOME/pagedchat/gguf-headers.

Why: a header is mostly the vocabulary, and Python reads its strings one at a time (reader.py `_Cursor.strings`):
Gemma 3's 262k tokens take ~0.3 s to parse and SmolLM2's 49k tokens and merges ~0.1 s, a large part of a
one-shot `run`'s start (llama.cpp, in C, reads them in milliseconds). Reading the parsed values back takes a
tenth of that. Only headers with a vocabulary (MIN_STRINGS strings or more) are kept.

An entry is named by the file's resolved path, size, modification time and inode, and the Python version (marshal's
format is Python's own): a changed or replaced file is parsed again, never read from a stale entry. marshal holds
only plain values (no code runs when it is read); an entry that does not read back as one is ignored, and a
cache folder that cannot be written only costs the parse.
"""

from __future__ import annotations

import contextlib
import hashlib
import marshal
import os
import sys
import tempfile
from pathlib import Path

from pagedchat import dirs

MIN_STRINGS = 10_000
FORMAT = 1   # bump when what an entry holds changes


def cache_dir() -> Path:
    return dirs.cache_dir("gguf-headers")


def _entry(path: Path) -> Path | None:
    try:
        st = path.stat()
        resolved = path.resolve()
    except OSError:
        return None
    key = f"{resolved}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{sys.version_info[:2]}|{marshal.version}|{FORMAT}"
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.marshal"


def load(path: Path):
    """The parsed header stored for this very file, or None."""
    entry = _entry(path)
    if entry is None or not entry.is_file():
        return None
    try:
        header = marshal.loads(entry.read_bytes())
    except (OSError, EOFError, ValueError, TypeError):
        return None
    shape = (dict, list, int)   # reader._header's (metadata, tensor infos, end of the header)
    ok = isinstance(header, tuple) and len(header) == 3 and all(isinstance(v, t) for v, t in zip(header, shape))
    return header if ok else None


def store(path: Path, header, strings: int) -> None:
    """Keep a parsed header (plain values only) if it holds a vocabulary; written whole or not at all."""
    entry = _entry(path)
    if entry is None or strings < MIN_STRINGS:
        return
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".partial")
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(header))
        os.replace(tmp, entry)
    except (OSError, ValueError):
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
