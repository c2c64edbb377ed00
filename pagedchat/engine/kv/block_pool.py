"""The paged KV pool's bookkeeping: fixed blocks, refcounts, a chained-hash prefix cache, LRU reuse.

Only ids and counters live here; the K/V tensors belong to the runner. Invariants (checked by
`check_invariants`, used by the property tests):
  - a block is free  <=> its refcount is 0;
  - every hashed block is the one the hash table maps its hash to;
  - free blocks keep their hash until reused, so a freed prefix can still be hit (lazy eviction).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

KEY_BYTES = 32
ROOT_KEY = bytes(KEY_BYTES)   # the "parent" of a sequence's first block
_PERSON = b"pagedchat-kv-v1"  # BLAKE2b personalization: these digests name KV blocks and nothing else


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """Key of a full block: BLAKE2b-256 over the parent block's key and the block's token ids (uint32,
    little-endian). Cryptographic, so no crafted prompt can make its chain collide with another user's (a
    64-bit `hash()` can be), and free of per-process hash seeds, so the same key names the same block in the
    pool, in the RAM tier and on disk in every process."""
    data = (parent or ROOT_KEY) + struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.blake2b(data, digest_size=KEY_BYTES, person=_PERSON).digest()


def group_key(h: bytes, group: int) -> bytes:
    """Cache key of a block of layer group `group` (sliding-window groups, engine/core/window_groups.py): the same
    tokens' KV of different layers lives in different blocks. Group 0 (every model's only group, or the
    global layers) keys by the chain hash itself; the others by a digest of it and the group."""
    if group == 0:
        return h
    return hashlib.blake2b(h + struct.pack("<I", group), digest_size=KEY_BYTES, person=_PERSON).digest()


@dataclass
class PoolStats:
    num_blocks: int
    block_size: int
    used: int          # refcount > 0
    free: int          # refcount == 0 (reusable)
    cached: int        # free but still holding a hashed prefix that can be hit
    shared: int        # refcount > 1
    peak_used: int
    prefix_hit_tokens: int    # cumulative tokens whose KV was reused instead of computed (every tier)
    prefix_query_tokens: int  # cumulative prompt tokens looked up
    cow_copies: int           # cumulative copy-on-write block copies
    ram_hit_tokens: int = 0   # of prefix_hit_tokens: loaded back from the host-RAM tier
    disk_hit_tokens: int = 0  # of prefix_hit_tokens: loaded back from the disk tier
    kv_dtype: str = ""        # what a block stores: the model's dtype (float32, bfloat16, ...), int8 or fp8

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class OutOfBlocks(Exception):
    """No free block is left; the scheduler reacts by evicting pins or preempting."""


EvictHook = Callable[[int, bytes, tuple[int, ...]], None]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True, kv_dtype: str = ""):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_dtype = kv_dtype  # a label for stats (engine/kv/caches.py kv_dtype_name)
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Oldest first: blocks freed long ago (and tail blocks of a freed sequence) are reused first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.peak_used = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.ram_hit_tokens = self.disk_hit_tokens = 0
        self.cow_copies = 0
        # Called with (block, key, tokens) just before a cached block is reused, while it still holds that
        # KV: the tiers below the pool keep a copy.
        self.on_evict: EvictHook | None = None

    # -- counts -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def stats(self) -> PoolStats:
        cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        shared = sum(1 for r in self.ref_count if r > 1)
        return PoolStats(self.num_blocks, self.block_size, self.num_used, self.num_free, cached, shared,
                         self.peak_used, self.prefix_hit_tokens, self.prefix_query_tokens, self.cow_copies,
                         self.ram_hit_tokens, self.disk_hit_tokens, self.kv_dtype)

    # -- allocation -----------------------------------------------------------------------------------------
    def allocate(self, after: int | None = None) -> int:
        """A free block, oldest first. after: the block the new one follows in a table. Its successor is
        taken instead when it is free and caches nothing, so a sequence's blocks tend to be consecutive and
        the CPU decode attention reads a batch-1 context in place instead of gathering it (kernels/reference.py)."""
        if not self.free_queue:
            raise OutOfBlocks
        successor = None if after is None else after + 1
        if successor in self.free_queue and self.block_hash[successor] is None:
            del self.free_queue[successor]
            self.ref_count[successor] = 1
            self.peak_used = max(self.peak_used, self.num_used)
            return successor
        block, _ = self.free_queue.popitem(last=False)
        if self.on_evict is not None and self.block_hash[block] is not None:
            self.on_evict(block, self.block_hash[block], self.block_tokens[block])
        self._forget_hash(block)
        self.ref_count[block] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return block

    def incref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_queue[block]
            self.peak_used = max(self.peak_used, self.num_used)
        self.ref_count[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.block_hash[block] is None or not self.enable_prefix_cache:
                self._forget_hash(block)
                # Blocks with nothing worth keeping go to the front: they are reused before cached ones.
                self.free_queue[block] = None
                self.free_queue.move_to_end(block, last=False)
            else:
                self.free_queue[block] = None

    def free_table(self, table: list[int]) -> None:
        """Release a block table, tail first: a sequence's last blocks are the least likely to be hit again."""
        for block in reversed(table):
            self.decref(block)
        table.clear()

    def fork_table(self, table: list[int]) -> list[int]:
        for block in table:
            self.incref(block)
        return list(table)

    def copy_on_write(self, table: list[int], index: int) -> tuple[int, int] | None:
        """Make table[index] private before a write. Returns the (src, dst) copy to perform, if any."""
        block = table[index]
        if self.ref_count[block] == 1:
            # We own it alone: write in place. A full, hashed block is written into again only by a fork
            # from an earlier point of a branch whose pin was dropped since (its other owner): the block
            # stops holding the tokens it is indexed under, so it leaves the index.
            self._forget_hash(block)
            return None
        new = self.allocate()
        self.decref(block)
        table[index] = new
        self.cow_copies += 1
        return block, new

    # -- prefix cache ---------------------------------------------------------------------------------------
    def lookup(self, parent_hash: bytes | None, tokens: tuple[int, ...], group: int = 0) -> tuple[int, bytes] | None:
        """(block, hash) of a cached full block of layer group `group` holding exactly `tokens` after the
        prefix `parent_hash`. The token comparison stays even with a cryptographic key: it costs little and
        guards the invariant."""
        if not self.enable_prefix_cache:
            return None
        h = chain_hash(parent_hash, tokens)
        block = self.hash_to_block.get(group_key(h, group))
        if block is None or self.block_tokens[block] != tokens:
            return None
        return block, h

    def register(self, block: int, parent_hash: bytes | None, tokens: tuple[int, ...], group: int = 0) -> bytes:
        """Index a block (of layer group `group`) that has just become full and computed. Returns its chain
        hash."""
        assert len(tokens) == self.block_size and self.ref_count[block] > 0
        h = chain_hash(parent_hash, tokens)
        if not self.enable_prefix_cache:
            return h
        key = group_key(h, group)
        if self.block_hash[block] == key:
            return h
        if key not in self.hash_to_block:  # a duplicate keeps the first copy indexed; this one stays private
            self._forget_hash(block)
            self.block_hash[block], self.block_tokens[block] = key, tokens
            self.hash_to_block[key] = block
        return h

    def record_lookup(self, query_tokens: int, hit_tokens: int, ram_tokens: int = 0, disk_tokens: int = 0) -> None:
        self.prefix_query_tokens += query_tokens
        self.prefix_hit_tokens += hit_tokens
        self.ram_hit_tokens += ram_tokens
        self.disk_hit_tokens += disk_tokens

    def cached_blocks(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """(block, key, tokens) of every indexed block: in use first, then free ones, most recently freed
        first (the order their KV is worth keeping)."""
        free = [b for b in reversed(self.free_queue) if self.block_hash[b] is not None]
        used = [b for b in self.hash_to_block.values() if self.ref_count[b] > 0]
        return [(b, self.block_hash[b], self.block_tokens[b]) for b in used + free]

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = self.block_tokens[block] = None

    # -- invariants -----------------------------------------------------------------------------------------
    def check_invariants(self, tables: list[list[int]] | None = None) -> None:
        for b in range(self.num_blocks):
            assert (self.ref_count[b] == 0) == (b in self.free_queue), f"block {b}: free-queue/refcount mismatch"
            assert self.ref_count[b] >= 0
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash table points at block {b} that no longer holds that hash"
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in tables:
                for b in table:
                    counts[b] += 1
            assert counts == self.ref_count, "refcounts differ from the number of tables holding each block"
