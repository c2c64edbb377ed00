"""The pool's lower tiers: host RAM, then disk. Keys are the pool's chain keys, so a block found in any tier
is the same prefix's KV.

Blocks move down when the pool evicts them (pool -> RAM; RAM overflow -> disk), are written through to disk
when a session is saved and when the engine closes (so the next process finds them), and move back up at
admission: the scheduler walks each prompt block pool -> RAM -> disk and loads the hits into fresh pool
blocks in one batched copy. Disk writes run on a background thread; the tensors they write are private
copies, so the pool block they came from may be reused at once.
"""

from __future__ import annotations

import queue
import sys
import threading
from pathlib import Path
from typing import Protocol

import torch

from pagedchat.engine.kv.disk import DiskTier
from pagedchat.engine.kv.ram import RamTier

_CHUNK_BLOCKS = 64


class BlockIO(Protocol):
    """What the tiers need from whoever owns the K/V tensors (the model runner)."""

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A CPU copy of these blocks, one row per block."""

    def write_blocks(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        """Put these payloads (rows as `read_blocks` returns them) into these blocks."""


class _DiskWriter:
    """One thread writing blocks to the disk tier in order; `flush` waits until everything queued is written."""

    def __init__(self, disk: DiskTier, max_queued: int = 1024):
        self.disk = disk
        self.queue: queue.Queue = queue.Queue(max_queued)
        self.pending: set[bytes] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="pagedchat-kv-disk", daemon=True)
        self.thread.start()

    def submit(self, key: bytes, tokens: tuple[int, ...], payload: torch.Tensor, wait: bool) -> None:
        """Queue a write; with wait=False a full queue drops it (a cache may forget; the step must not stall)."""
        with self.lock:
            if key in self.pending:
                return
            self.pending.add(key)
        try:
            self.queue.put((key, tokens, payload), block=wait)
        except queue.Full:
            with self.lock:
                self.pending.discard(key)

    def is_pending(self, key: bytes) -> bool:
        with self.lock:
            return key in self.pending

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                key, tokens, payload = item
                self.disk.put(key, tokens, payload)
                with self.lock:
                    self.pending.discard(key)
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        self.queue.join()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


class KVTiers:
    def __init__(self, io: BlockIO, ram: RamTier | None = None, disk: DiskTier | None = None):
        self.io, self.ram, self.disk = io, ram, disk
        self.writer = _DiskWriter(disk) if disk is not None else None
        self.disk_hit_tokens = 0
        self._saved_hit_tokens = 0      # of disk_hit_tokens, already added to the folder's stats.json

    # -- down: eviction and write-through -----------------------------------------------------------------
    def spill(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """The pool is about to reuse a cached block: keep a copy in RAM, or on disk without a RAM tier."""
        if self.ram is None and not self._wants(key):
            return
        payload = self.io.read_blocks([block])[0]
        overflow = self.ram.put(key, tokens, payload) if self.ram is not None else [(key, tokens, payload)]
        for k, t, p in overflow:
            if self._wants(k):
                self.writer.submit(k, t, p, wait=False)

    def write_through(self, blocks: list[tuple[int, bytes, tuple[int, ...]]], wait: bool = True) -> None:
        """Write these pool blocks (block, key, tokens) to disk unless they are there already. Copied out in
        chunks: a whole pool at once would double its memory. wait=False drops what does not fit the writer's
        queue (a later call offers it again) instead of stalling the caller."""
        todo = [(b, k, t) for b, k, t in blocks if self._wants(k)]
        for start in range(0, len(todo), _CHUNK_BLOCKS):
            chunk = todo[start:start + _CHUNK_BLOCKS]
            payloads = self.io.read_blocks([b for b, _, _ in chunk])
            for (_, key, tokens), payload in zip(chunk, payloads):
                self.writer.submit(key, tokens, payload, wait=wait)

    def _wants(self, key: bytes) -> bool:
        return self.writer is not None and self.disk.writable and not self.writer.is_pending(key) \
            and not self.disk.contains(key)

    # -- up: admission --------------------------------------------------------------------------------------
    def fetch(self, key: bytes, tokens: tuple[int, ...]) -> tuple[str, torch.Tensor] | None:
        """("ram" | "disk", payload) of a block below the pool, or None."""
        if self.ram is not None:
            payload = self.ram.pop(key, tokens)
            if payload is not None:
                return "ram", payload
        if self.disk is not None:
            payload = self.disk.get(key, tokens)
            if payload is not None:
                self.disk_hit_tokens += len(tokens)
                return "disk", payload
        return None

    def load(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        if blocks:
            self.io.write_blocks(blocks, payloads)

    # -- lifetime -------------------------------------------------------------------------------------------
    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def checkpoint(self, pool_blocks: list[tuple[int, bytes, tuple[int, ...]]], wait: bool = False) -> None:
        """Queue for disk what the pool and RAM hold and disk lacks (most recent first), and record the hits
        so far. A long-running process calls this now and then, so being killed (no close) loses little."""
        if self.writer is None:
            return
        self.write_through(pool_blocks, wait)
        for key, tokens, payload in self.ram.items() if self.ram is not None else []:
            if self._wants(key):
                self.writer.submit(key, tokens, payload, wait=wait)
        self.disk.save_stats(self.disk_hit_tokens - self._saved_hit_tokens)
        self._saved_hit_tokens = self.disk_hit_tokens

    def close(self, pool_blocks: list[tuple[int, bytes, tuple[int, ...]]]) -> None:
        """Before the process ends: everything worth keeping goes to disk, and the writes finish."""
        if self.writer is None:
            return
        self.checkpoint(pool_blocks, wait=True)
        self.writer.close()
        self.writer = None


def build_tiers(io: BlockIO, payload_shape: tuple[int, ...], payload_dtype: torch.dtype, fingerprint: str,
                ram_bytes: int, disk_bytes: int, root: Path, meta: dict) -> KVTiers | None:
    """The tiers the config asks for (None when both are off)."""
    if not ram_bytes and not disk_bytes:
        return None
    ram = RamTier(ram_bytes) if ram_bytes else None
    disk = None
    if disk_bytes:
        disk = DiskTier(root / fingerprint, fingerprint, disk_bytes, payload_shape, payload_dtype, meta,
                        warn=lambda line: print(line, file=sys.stderr))
    return KVTiers(io, ram, disk)
