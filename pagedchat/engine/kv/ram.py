"""The host-RAM tier: copies of blocks the pool evicted, least recently used first out, bounded in bytes.

Blocks leave this tier either back into the pool (a prefix hit at admission: the entry moves up, so one
block never sits in both) or, when the tier is full, down to the disk tier (the caller writes what `put`
returns).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Entry = tuple[bytes, tuple[int, ...], torch.Tensor]   # key, token ids, payload


class RamTier:
    def __init__(self, capacity: int):
        assert capacity > 0
        self.capacity, self.used = capacity, 0
        self.entries: OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def put(self, key: bytes, tokens: tuple[int, ...], payload: torch.Tensor) -> list[Entry]:
        """Keep a block; returns the entries pushed out to make room (oldest first), maybe this one."""
        if payload.nbytes > self.capacity:
            return [(key, tokens, payload)]
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        self.entries[key] = (tokens, payload)
        self.used += payload.nbytes
        evicted = []
        while self.used > self.capacity:
            old_key, (old_tokens, old_payload) = self.entries.popitem(last=False)
            self.used -= old_payload.nbytes
            evicted.append((old_key, old_tokens, old_payload))
        return evicted

    def pop(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """Take a block out (it is going back into the pool); None unless key and tokens both match."""
        entry = self.entries.get(key)
        if entry is None or entry[0] != tokens:
            return None
        del self.entries[key]
        self.used -= entry[1].nbytes
        return entry[1]

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0

    def items(self) -> list[Entry]:
        """Every entry, most recently used first."""
        return [(k, t, p) for k, (t, p) in reversed(self.entries.items())]

    def check_invariants(self) -> None:
        assert self.used == sum(p.nbytes for _, p in self.entries.values()) and self.used <= self.capacity
