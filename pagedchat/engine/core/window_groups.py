"""Block tables of the sliding-window layer groups: blocks that fall behind every window are released.

Layers are split into groups of S layers over one pool (a block id always means S layers x block_size
tokens, whichever group holds it): group 0 is every global layer (S of them), the window layers fill
groups of S (Gemma 3, 5 window : 1 global: one global group, five window groups). Group 0's table is
`Sequence.block_table`,
managed by the scheduler as for any model. Each window group has a table in `Sequence.window_tables`,
indexed like block_table, where a released block is -1.

After a step has computed a sequence up to token c, the next query is at position >= c and sees keys
> position - window: block i is dead once (i + 1) * block_size <= c - window (one token of slack for a fork
that steps back one token), and goes back to the pool.
Why this stays correct:
  - forks (n variants, Engine.fork) continue from the parent's position: they never need what it released,
    and copy its -1 entries as they are;
  - a new turn forked from a pinned branch at an earlier point k (an edit, a regenerate) needs the blocks
    of keys k - window + 1 .. k - 1: `usable_prefix` gives k only when they are all live in the parent;
    else the scheduler walks the prefix cache instead (below), which may still hold them;
  - the chained-hash prefix cache keys each window group's blocks by (chain hash, group) in the one pool's
    table (block_pool.group_key); a released block that had become full stays cached, free, until it is
    reused. A hit of k tokens needs the global blocks of 0..k-1 and, in every window group, the blocks of
    keys k - window + 1 .. k - 1 (what the query at k sees): `attach_cached` shortens the global hit to the
    longest k for which they are all still cached, and gives the window tables -1 before them;
  - copy-on-write: the partial block of each window table is copied before a write when shared, like the
    global one; released entries are never written (writes happen at positions >= c);
  - preemption frees every table; the re-prefill recomputes from token 0.
"""

from __future__ import annotations

from pagedchat.engine.kv.block_pool import BlockPool
from pagedchat.engine.core.sequence import Sequence

RELEASED = -1


class WindowTables:
    def __init__(self, pool: BlockPool, num_groups: int, window: int):
        assert num_groups > 0 and window > 0
        self.pool, self.num_groups, self.window, self.block_size = pool, num_groups, window, pool.block_size

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _ensure(self, seq: Sequence) -> list[list[int]]:
        if not seq.window_tables:
            seq.window_tables = [[] for _ in range(self.num_groups)]
        return seq.window_tables

    def cost(self, seq: Sequence, n: int) -> int:
        """Blocks the window groups need to compute n more tokens (new blocks + copies of shared ones)."""
        end, first = self._blocks_for(seq.num_computed + n), seq.num_computed // self.block_size
        total = 0
        for table in self._ensure(seq):
            total += max(0, end - len(table))
            written = table[first:end]
            total += sum(1 for b in written if b != RELEASED and self.pool.ref_count[b] > 1)
        return total

    def reserve(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        end, first = self._blocks_for(seq.num_computed + n), seq.num_computed // self.block_size
        for table in self._ensure(seq):
            for index in range(first, min(len(table), end)):
                assert table[index] != RELEASED, "a write reached a released window block"
                copy = self.pool.copy_on_write(table, index)
                if copy:
                    copies.append(copy)
            while len(table) < end:
                table.append(self.pool.allocate())

    def release_behind(self, seq: Sequence) -> None:
        """Free the blocks no future query of this sequence can see, nor a fork of it: Engine.fork of a
        sequence whose KV is complete steps the child back one token (it recomputes its last token for its own
        logits), so what the query at num_computed - 1 sees stays too."""
        dead = self._first_needed(max(0, seq.num_computed - 1))
        for table in seq.window_tables:
            index = min(dead, len(table)) - 1
            # Released entries form a prefix: walk back from the frontier only over the newly dead ones.
            while index >= 0 and table[index] != RELEASED:
                self.pool.decref(table[index])
                table[index] = RELEASED
                index -= 1

    def free(self, seq: Sequence) -> None:
        for table in seq.window_tables:
            for block in reversed(table):
                if block != RELEASED:
                    self.pool.decref(block)
        seq.window_tables = []

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int | None = None) -> None:
        """The child shares the parent's live window blocks (the first num_blocks entries)."""
        child.window_tables = []
        for table in parent.window_tables:
            part = table[:num_blocks] if num_blocks is not None else list(table)
            for block in part:
                if block != RELEASED:
                    self.pool.incref(block)
            child.window_tables.append(list(part))

    def register(self, seq: Sequence, index: int, parent_hash: int | None, tokens: tuple[int, ...]) -> None:
        """Index block `index` of every window table (it has just become full and computed, like the
        global one), so that a later prompt with the same prefix can hit it even once released."""
        for group, table in enumerate(seq.window_tables, start=1):
            if index < len(table) and table[index] != RELEASED:
                self.pool.register(table[index], parent_hash, tokens, group)

    def attach_cached(self, seq: Sequence, hashes: list[int]) -> int:
        """After a prefix-cache hit of len(hashes) global blocks: the longest hit of j <= len(hashes)
        blocks whose window keys are cached in every window group. The window tables take those blocks
        (-1 before them, as if released); returns j (the caller drops the global blocks past it)."""
        bs, tokens = self.block_size, seq.token_ids
        found: list[list[int] | None] = []  # per block index: its block in every window group, or None
        for i in range(len(hashes)):
            parent, chunk = hashes[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs])
            blocks = [self.pool.lookup(parent, chunk, group) for group in range(1, self.num_groups + 1)]
            found.append(None if None in blocks else [b for b, _ in blocks])
        j = len(hashes)
        while j and any(found[i] is None for i in range(self._first_needed(j * bs), j)):
            j -= 1
        first = self._first_needed(j * bs)
        seq.window_tables = [[RELEASED] * first for _ in range(self.num_groups)]
        for i in range(first, j):
            for table, block in zip(seq.window_tables, found[i]):
                self.pool.incref(block)
                table.append(block)
        return j

    def _first_needed(self, k: int) -> int:
        """First block index a query at position k still sees (the keys k - window + 1 .. k)."""
        return max(0, k - self.window + 1) // self.block_size

    def usable_prefix(self, parent: Sequence, k: int) -> int:
        """The longest fork point <= k whose window blocks are all live in the parent (else 0)."""
        if not parent.window_tables or k == 0:
            return k
        table = parent.window_tables[0]
        first_live = next((i for i, b in enumerate(table) if b != RELEASED), len(table))
        return k if self._first_needed(k) >= first_live else 0

    def trim(self, seq: Sequence, keep: int) -> None:
        for table in seq.window_tables:
            for block in reversed(table[keep:]):
                if block != RELEASED:
                    self.pool.decref(block)
            del table[keep:]

    def held(self, seq: Sequence) -> int:
        return sum(1 for t in seq.window_tables for b in t if b != RELEASED and self.pool.ref_count[b] > 0)

    @staticmethod
    def live_tables(seq: Sequence) -> list[list[int]]:
        return [[b for b in t if b != RELEASED] for t in seq.window_tables]
