"""The disk tier: KV blocks as files under $XDG_CACHE_HOME/pagedchat/kv/<fingerprint>/, shared by processes.

    <fingerprint>/meta.json              which model and settings the blocks belong to (for `pagedchat cache`)
    <fingerprint>/stats.json             cumulative hits (best effort: concurrent updates may lose a count)
    <fingerprint>/<ab>/<key hex>.kv      one block: a safetensors file (tensor "kv" + metadata)

A block file carries its key, fingerprint, token ids and a BLAKE2b checksum over all of them and the
tensor bytes. Reading one that is truncated, corrupt, foreign (another key, fingerprint, shape or dtype) is a
miss, and the file is removed: the caller recomputes, so a bad file never becomes a wrong token. Writes are
atomic (temp file in the same folder + rename), so a reader in another process sees a whole file or none.
Files are 0600 and folders 0700. The folder is kept under its byte budget by dropping the least recently
used files (a hit refreshes a file's mtime). A folder that cannot be written (full disk, read-only) gives
one warning and the tier stops writing; no turn fails because of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

FILE_SUFFIX = ".kv"
_TRIM_TO = 0.9          # trimming goes below the budget, so the next writes do not rescan at once
_STALE_TMP_S = 3600     # temp files this old are left over from a killed writer


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a 0600 temp file in the same folder and a rename."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _checksum(key: bytes, fingerprint: str, tokens: tuple[int, ...], payload: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(key + fingerprint.encode() + struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(payload.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


_last_stamp_ns = 0


def _stamp(path: Path) -> None:
    """Set the file's mtime to now, later than any stamp this process gave before: two blocks used within the
    file system's clock resolution still trim in the order they were used (ties made the order, and with it
    which block survives, depend on timing)."""
    global _last_stamp_ns
    _last_stamp_ns = max(time.time_ns(), _last_stamp_ns + 1)
    with contextlib.suppress(OSError):
        os.utime(path, ns=(_last_stamp_ns, _last_stamp_ns))


class BadBlockFile(Exception):
    """A block file that must not be used: its content does not prove it is the block asked for."""


@dataclass
class DiskUsage:
    blocks: int
    bytes: int


class DiskTier:
    def __init__(self, folder: Path, fingerprint: str, capacity: int, payload_shape: tuple[int, ...],
                 payload_dtype: torch.dtype, meta: dict | None = None, warn: Callable[[str], None] = print):
        assert capacity > 0
        self.folder, self.fingerprint, self.capacity = Path(folder), fingerprint, capacity
        self.payload_shape, self.payload_dtype = tuple(payload_shape), payload_dtype
        self.warn = warn
        self.writable = True
        self.hits = self.removed = 0
        self._used: int | None = None   # bytes on disk as last counted (plus our writes since)
        try:
            private_dir(self.folder)
            if meta is not None and read_meta(self.folder) != meta:   # missing, or damaged: write it again
                atomic_write(self.folder / "meta.json", json.dumps(meta, indent=1).encode())
        except OSError as e:
            self._stop_writing(e)

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.folder / name[:2] / f"{name}{FILE_SUFFIX}"

    def contains(self, key: bytes) -> bool:
        return self.path(key).is_file()

    # -- read -----------------------------------------------------------------------------------------------
    def get(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The block's tensor, or None (missing, or bad and removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            payload = self._parse(data, key, tokens)
        except Exception:  # noqa: BLE001  whatever is wrong with the file, it is a miss, never an error
            self._remove(path)
            return None
        _stamp(path)  # least recently used goes first when the folder is trimmed
        self.hits += 1
        return payload

    def _parse(self, data: bytes, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor:
        from safetensors.torch import load

        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        payload = load(data)["kv"]
        expected = {"key": key.hex(), "fingerprint": self.fingerprint, "tokens": _tokens_text(tokens)}
        if any(meta.get(k) != v for k, v in expected.items()):
            raise BadBlockFile("foreign block")
        if tuple(payload.shape) != self.payload_shape or payload.dtype != self.payload_dtype:
            raise BadBlockFile("wrong shape or dtype")
        if meta.get("checksum") != _checksum(key, self.fingerprint, tokens, payload):
            raise BadBlockFile("checksum mismatch")
        return payload

    def _remove(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
            self.removed += 1

    # -- write ----------------------------------------------------------------------------------------------
    def put(self, key: bytes, tokens: tuple[int, ...], payload: torch.Tensor) -> None:
        """Store a block unless it is there already; never raises (a failed write disables writing)."""
        from safetensors.torch import save

        if not self.writable:
            return
        path = self.path(key)
        if path.is_file():
            return
        payload = payload.contiguous()
        meta = {"key": key.hex(), "fingerprint": self.fingerprint, "tokens": _tokens_text(tokens),
                "checksum": _checksum(key, self.fingerprint, tokens, payload)}
        data = save({"kv": payload}, metadata=meta)
        if len(data) > self.capacity:
            return
        try:
            atomic_write(path, data)
        except OSError as e:
            self._stop_writing(e)
            return
        _stamp(path)
        self._account(len(data))

    def _stop_writing(self, error: OSError) -> None:
        if self.writable:
            self.writable = False
            self.warn(f"pagedchat: warning: KV disk cache {self.folder} cannot be written "
                      f"({error.strerror or error}); going on without saving KV blocks to disk")

    def _account(self, size: int) -> None:
        if self._used is None:
            self._used = self.usage().bytes
        else:
            self._used += size
        if self._used > self.capacity:
            self._trim()

    def _trim(self) -> None:
        """Drop least recently used files below the budget, counting what every process wrote."""
        files, now = [], time.time()
        for path in self._block_files(include_tmp=True):
            try:
                st = path.stat()
            except OSError:
                continue
            if path.name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_S:
                    self._remove(path)
                continue
            files.append((st.st_mtime_ns, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.capacity * _TRIM_TO:
                break
            self._remove(path)
            total -= size
        self._used = total

    # -- inventory ------------------------------------------------------------------------------------------
    def _block_files(self, include_tmp: bool = False):
        return block_files(self.folder, include_tmp)

    def usage(self) -> DiskUsage:
        return folder_usage(self.folder)

    def save_stats(self, hit_tokens: int) -> None:
        """Add this process's hits to stats.json (read, add, atomic replace)."""
        if not self.writable or not self.hits:
            return
        stats = read_stats(self.folder)
        stats["hits"] = stats.get("hits", 0) + self.hits
        stats["hit_tokens"] = stats.get("hit_tokens", 0) + hit_tokens
        with contextlib.suppress(OSError):
            atomic_write(self.folder / "stats.json", json.dumps(stats).encode())
        self.hits = 0


def _tokens_text(tokens: tuple[int, ...]) -> str:
    return ",".join(map(str, tokens))


def private_dir(path: Path) -> None:
    """mkdir -p with every folder it creates 0700 (`parents=True` would make the missing parents 0755)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)


def block_files(folder: Path, include_tmp: bool = False):
    """Every block file under one fingerprint folder (and leftover temp files when asked)."""
    if not folder.is_dir():
        return
    for sub in os.scandir(folder):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(sub.path):
            if entry.name.endswith(FILE_SUFFIX) or include_tmp and entry.name.endswith(".tmp"):
                yield Path(entry.path)


def folder_usage(folder: Path) -> DiskUsage:
    blocks = size = 0
    for path in block_files(folder):
        with contextlib.suppress(OSError):
            size += path.stat().st_size
            blocks += 1
    return DiskUsage(blocks, size)


def read_stats(folder: Path) -> dict:
    return _read_dict(folder / "stats.json")


def read_meta(folder: Path) -> dict:
    return _read_dict(folder / "meta.json")


def _read_dict(path: Path) -> dict:
    """A JSON object from a file, or {} when it is missing or damaged (another process may have left it so)."""
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}
