"""Launch configurations of the v2 attention kernels, one per shape class: measured on the GPU and cached.

A shape class is what changes the best tiling: the kernel, the padded head dim, the GQA group (rounded up to a
power of two), the page size, the KV dtype and a size class (decode: the batch; prefill: the new tokens per
sequence). `pagedchat bench kernels --tune` times a few candidates per class on the GPU in use and writes the
winners to a small JSON file, keyed by GPU name and Triton version (a new driver stack re-measures):

    $XDG_CACHE_HOME/pagedchat/kernel-configs.json      (or PAGEDCHAT_KERNEL_CONFIGS=path)

Classes without a measured entry use the defaults below, chosen from the tile sizes' shared-memory footprint
(two to three pipeline stages of K and V per program). Lookups are memoized: a call pays one dict lookup.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

CONFIGS_ENV = "PAGEDCHAT_KERNEL_CONFIGS"
# What one program's pipeline stages of K and V may hold (bytes): two programs per SM keep their stages in
# shared memory on an A100 (164 KiB) and an H100 (227 KiB).
_STAGE_BYTES = 32 << 10


@dataclass(frozen=True)
class DecodeConfig:
    tile: int             # keys per KV tile (whole pages when pages are smaller, else part of one)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # the split plan cuts the work into about this many programs per SM
    min_tiles: int        # the fewest KV tiles worth a split of their own


@dataclass(frozen=True)
class PrefillConfig:
    rows: int             # query rows per program: query tokens x (padded) heads of a GQA group
    tile: int             # keys per KV tile
    num_warps: int
    num_stages: int


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_size_class(batch: int) -> str:
    return "batch1" if batch <= 1 else "batch8" if batch <= 8 else "batch64" if batch <= 64 else "batch256"


def prefill_size_class(total_q: int, batch: int) -> str:
    """Short extends (multi-turn messages, speculative verify), chunks, or whole long prompts."""
    per_seq = total_q / max(1, batch)
    return "extend64" if per_seq <= 64 else "chunk1k" if per_seq <= 1024 else "long"


# One prompt length of each prefill size class: what a start-up warm-up runs to compile every class's kernels.
PREFILL_CLASS_LENGTHS = (64, 1024, 1025)


def _with_q(size_class: str, q_dtype: torch.dtype | None) -> str:
    """A quantized pool's class also names the queries' dtype (its dots run in it)."""
    return size_class if q_dtype is None else f"{size_class}|q-{_dtype_name(q_dtype)}"


def shape_class(kernel: str, head_dim: int, group: int, block_size: int, dtype: torch.dtype, size: str) -> str:
    return f"{kernel}|d{_pow2(max(16, head_dim))}|g{min(_pow2(group), 32)}|b{block_size}|{_dtype_name(dtype)}|{size}"


# ---------------------------------------------------------------------------------------------------
# Defaults: what the tile sizes need in shared memory, not measurements
# ---------------------------------------------------------------------------------------------------

def default_decode(head_dim: int, dtype: torch.dtype, q_dtype: torch.dtype | None = None) -> DecodeConfig:
    """K and V tiles of ~32 KiB per stage: 64 keys at D=128 in bf16, 32 at D=256. A quantized pool (dtype
    int8 / fp8, q_dtype the queries') keeps the tile its values take in q's dtype in registers (128 int8 keys
    would take every register) and prefetches two tiles instead of one."""
    elt = torch.empty((), dtype=q_dtype or dtype).element_size()
    tile = max(16, min(128, _pow2(_STAGE_BYTES // (2 * _pow2(max(16, head_dim)) * elt) + 1) // 2))
    # 4 stages: the block-table read takes one, so K and V of the next tile are in flight during this one.
    return DecodeConfig(tile=tile, num_warps=4, num_stages=4 if q_dtype is None else 5, programs_per_sm=4,
                        min_tiles=4)


def default_prefill(head_dim: int, dtype: torch.dtype, size: str, q_dtype: torch.dtype | None = None) -> PrefillConfig:
    """dtype: the KV pool's; q_dtype: the queries' where it differs (a quantized pool computes in it)."""
    block_d = _pow2(max(16, head_dim))
    if torch.float32 in (dtype, q_dtype):
        # IEEE fp32 dots run on the FMA units, each thread holding whole rows of its operands: larger tiles spill
        # on sm_90 (docs/kernels.md). fp32 serves exactness checks, not speed.
        return PrefillConfig(rows=32 if block_d <= 32 else 16, tile=16, num_warps=4, num_stages=2)
    if block_d > 128:
        return PrefillConfig(rows=64, tile=32, num_warps=8, num_stages=2)
    rows = 64 if size == "extend64" else 128
    return PrefillConfig(rows=rows, tile=64, num_warps=8 if block_d == 128 else 4, num_stages=3)


def decode_candidates(head_dim: int, dtype: torch.dtype, q_dtype: torch.dtype | None = None) -> list[DecodeConfig]:
    """What `bench kernels --tune` tries for a decode class (the default first): tile sizes, the depth of the
    K/V prefetch (num_stages 5 keeps two tiles in flight), then how finely the split plan cuts the work."""
    base = default_decode(head_dim, dtype, q_dtype)
    out = [base]
    for tile in sorted({max(16, base.tile // 2), base.tile, min(256, base.tile * 2)}):
        for warps, stages in ((4, 4), (4, 5), (8, 4)):
            out.append(DecodeConfig(tile, warps, stages, base.programs_per_sm, base.min_tiles))
    out += [DecodeConfig(base.tile, base.num_warps, base.num_stages, p, m)
            for p, m in ((1, 4), (2, 4), (8, 4), (4, 2), (4, 8), (8, 2))]
    return list(dict.fromkeys(out))


def prefill_candidates(head_dim: int, dtype: torch.dtype, size: str,
                       q_dtype: torch.dtype | None = None) -> list[PrefillConfig]:
    """What `bench kernels --tune` tries for a prefill class (the default first). Shapes that spill registers
    on sm_90 are left out (128 rows need 8 warps at head dim 128: docs/kernels.md)."""
    base = default_prefill(head_dim, dtype, size, q_dtype)
    if torch.float32 in (dtype, q_dtype):
        grid = [PrefillConfig(16, 16, 4, 2), PrefillConfig(16, 16, 4, 3)]
        if _pow2(max(16, head_dim)) <= 32:
            grid += [PrefillConfig(32, 16, 4, 2), PrefillConfig(32, 16, 4, 3)]
    elif _pow2(max(16, head_dim)) > 128:
        grid = [PrefillConfig(64, 32, 8, 2), PrefillConfig(64, 32, 8, 3), PrefillConfig(64, 64, 8, 2),
                PrefillConfig(128, 32, 8, 2), PrefillConfig(64, 32, 4, 2)]
    else:
        grid = [PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 8, 4), PrefillConfig(128, 128, 8, 3),
                PrefillConfig(128, 128, 8, 2), PrefillConfig(128, 32, 8, 3), PrefillConfig(64, 64, 4, 3),
                PrefillConfig(64, 128, 4, 3), PrefillConfig(64, 64, 4, 4)]
    return list(dict.fromkeys([base] + [c for c in grid if _prefill_smem(c, head_dim, dtype) <= 200 << 10]))


def _prefill_smem(cfg: PrefillConfig, head_dim: int, dtype: torch.dtype) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    block_d = _pow2(max(16, head_dim))
    return (cfg.rows + 2 * cfg.tile * cfg.num_stages) * block_d * elt


# ---------------------------------------------------------------------------------------------------
# The measured cache
# ---------------------------------------------------------------------------------------------------

def cache_path() -> Path:
    override = os.environ.get(CONFIGS_ENV)
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedchat" / "kernel-configs.json"


def device_key(device: torch.device) -> str | None:
    """GPU name + Triton version: measurements hold for that pair only. None off CUDA (defaults only)."""
    if device.type != "cuda":
        return None
    import triton

    return f"{_cuda_name(device.index if device.index is not None else torch.cuda.current_device())}" \
           f"|triton {triton.__version__}"


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _measured(path: str, key: str) -> dict:
    try:
        return json.loads(Path(path).read_text()).get(key, {})
    except (OSError, ValueError, AttributeError):
        return {}  # no cache yet, or an unreadable one: defaults


def _lookup(cls, device: torch.device, name: str, default):
    key = device_key(device)
    entry = _measured(str(cache_path()), key).get(name) if key else None
    if entry:
        try:
            return cls(**{f.name: int(entry[f.name]) for f in fields(cls)})
        except (KeyError, TypeError, ValueError):
            pass  # a stale entry from another layout of the dataclass: defaults
    return default


@functools.lru_cache(maxsize=4096)
def decode_config(head_dim: int, group: int, block_size: int, dtype: torch.dtype, batch_class: str,
                  device: torch.device, q_dtype: torch.dtype | None = None) -> DecodeConfig:
    """dtype: the KV pool's; q_dtype: the queries' when the pool is quantized (its dots run in q's dtype)."""
    name = shape_class("decode", head_dim, group, block_size, dtype, _with_q(batch_class, q_dtype))
    return _lookup(DecodeConfig, device, name, default_decode(head_dim, dtype, q_dtype))


@functools.lru_cache(maxsize=4096)
def prefill_config(head_dim: int, group: int, block_size: int, dtype: torch.dtype, size_class: str,
                   device: torch.device, q_dtype: torch.dtype | None = None) -> PrefillConfig:
    """dtype: the KV pool's; q_dtype: the queries' when the pool is quantized (its dots run in q's dtype)."""
    name = shape_class("prefill", head_dim, group, block_size, dtype, _with_q(size_class, q_dtype))
    return _lookup(PrefillConfig, device, name, default_prefill(head_dim, dtype, size_class, q_dtype))


def save_measured(device: torch.device, winners: dict[str, DecodeConfig | PrefillConfig]) -> Path:
    """Merge measured winners {shape class: config} into the cache file (atomic replace); lookups see them."""
    path, key = cache_path(), device_key(device)
    assert key is not None, "configurations are measured on a CUDA device"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault(key, {}).update({name: asdict(cfg) for name, cfg in winners.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(f.name, path)
    forget_measured()
    return path


def forget_measured() -> None:
    """Drop the memoized lookups (after the cache file changed, or a test pointed it elsewhere)."""
    _measured.cache_clear()
    decode_config.cache_clear()
    prefill_config.cache_clear()
