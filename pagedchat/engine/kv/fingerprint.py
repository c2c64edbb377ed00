"""Model fingerprints: which stored KV blocks a loaded model may reuse.

A block key names a token prefix; the same prefix under another model, dtype or block size is different
KV. The fingerprint folds in everything that changes a block's bytes: the config (architecture, sizes, rope
settings), a content digest of the weight files, the weight and KV dtypes, the block size and the device
type (CPU and CUDA kernels round differently). The chat template and tokenizer are left out: blocks are
named by token ids, so a template change never makes a stored block wrong.

Hashing gigabytes of weights at every start would cost seconds, so a weight file's digest covers its size,
its safetensors header (every tensor's name, dtype, shape and offsets) and evenly spaced samples of its
bytes, and is cached per file (path, size, mtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from pagedchat import dirs

FORMAT_VERSION = 1          # bump when the key scheme or the stored layout changes
_SAMPLES, _SAMPLE_BYTES = 16, 4096
_HEADER_LIMIT = 100 * 1024**2  # a safetensors header is JSON: larger than this is not one


def kv_cache_root() -> Path:
    """$XDG_CACHE_HOME/pagedchat/kv (default ~/.cache/pagedchat/kv)."""
    return dirs.cache_dir("kv")


def file_digest(path: Path) -> str:
    """Size + safetensors header + sampled bytes of one weight file."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 0 < header_len <= min(size - 8, _HEADER_LIMIT):
            h.update(f.read(header_len))
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _SAMPLE_BYTES) * i // max(1, _SAMPLES - 1)))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def weights_digest(files: list[Path], root: Path | None = None) -> str:
    """Digest of every weight file, each cached under (path, size, mtime) in root/weight-digests.json
    (entries of files that are gone are dropped)."""
    cache_path = (root or kv_cache_root()) / "weight-digests.json"
    try:
        cache = json.loads(cache_path.read_text())
        assert isinstance(cache, dict)
    except (OSError, ValueError, AssertionError):
        cache = {}
    cache = {path: entry for path, entry in cache.items() if os.path.exists(path)}
    h, changed = hashlib.blake2b(digest_size=16), False
    for path in sorted(Path(f).resolve() for f in files):
        st = path.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        entry = cache.get(str(path))
        if not isinstance(entry, dict) or entry.get("stamp") != stamp:
            entry, changed = {"stamp": stamp, "digest": file_digest(path)}, True
            cache[str(path)] = entry
        h.update(path.name.encode() + b"\0" + str(entry["digest"]).encode() + b"\0")
    if changed:
        _write_quietly(cache_path, json.dumps(cache).encode())
    return h.hexdigest()


def config_digest(model_dir: Path) -> str:
    """config.json as parsed JSON, minus the writer's transformers version (it changes no number)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict):
        config.pop("transformers_version", None)
    return hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=16).hexdigest()


def model_digest(model_dir: Path, files: list[Path], root: Path | None = None) -> str:
    """What the model is, independent of how it is run: config + weights (`cache --model M` matches on it)."""
    return hashlib.blake2b(f"{config_digest(model_dir)}:{weights_digest(files, root)}".encode(),
                           digest_size=16).hexdigest()


def fingerprint(model: str, dtype: str, kv_dtype: str, block_size: int, device_type: str,
                extra: dict | None = None) -> str:
    """The folder name of one model's blocks: model digest + how its KV is computed and laid out."""
    parts = {"format": FORMAT_VERSION, "model": model, "dtype": dtype, "kv_dtype": kv_dtype,
             "block_size": block_size, "device": device_type, **(extra or {})}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def _write_quietly(path: Path, data: bytes) -> None:
    """A digest cache that cannot be written only costs the next start a re-hash."""
    from pagedchat.engine.kv.disk import atomic_write

    with contextlib.suppress(OSError):
        atomic_write(path, data)


def engine_fingerprint(model_dir: Path, weight_files: list[Path], dtype, block_size: int, device_type: str,
                       root: Path, extra: dict | None = None, kv_dtype: str | None = None) -> tuple[str, dict]:
    """(fingerprint, meta.json content) of a loaded model run with these settings. kv_dtype: what the pool
    stores (int8, fp8; None: the model's dtype), so a quantized block is never read as another dtype's."""
    digest = model_digest(model_dir, weight_files, root)
    dtype_name = str(dtype).removeprefix("torch.")
    kv_dtype = kv_dtype or dtype_name
    fp = fingerprint(digest, dtype_name, kv_dtype, block_size, device_type, extra)
    meta = {"model_path": str(model_dir), "model_digest": digest, "dtype": dtype_name, "kv_dtype": kv_dtype,
            "block_size": block_size, "device": device_type, **(extra or {})}
    return fp, meta
