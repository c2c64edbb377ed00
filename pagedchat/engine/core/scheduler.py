"""Continuous batching with chunked prefill, prefix reuse at admission, recompute preemption and pins.

Every step: running sequences first (oldest first, so decodes never stall behind a long prompt), then
waiting ones join while the per-step token budget and the pool allow. Prompts larger than the remaining
budget are prefilled in chunks across steps. When a step needs a block and none is free, pins of the least
recently used conversation branches are dropped first, then the newest running sequence is preempted (its
blocks freed but still hashed, so its re-prefill mostly hits the cache).

With `reserve_upfront` (the engine's `kv_allocation="reserved"`), admission takes the blocks for the whole
prompt + max_tokens at once, as a contiguous per-request cache must: the same engine without paging's
allocate-as-you-grow, the peer that `pagedchat bench serve` measures against.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from pagedchat.engine.kv.block_pool import BlockPool, chain_hash
from pagedchat.engine.kv.tiers import KVTiers
from pagedchat.engine.core.sequence import Sequence, SeqStatus
from pagedchat.engine.core.window_groups import WindowTables


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, new tokens this step)
    copies: list[tuple[int, int]] = field(default_factory=list)       # copy-on-write (src, dst) blocks
    failed: list[Sequence] = field(default_factory=list)              # cannot fit even alone
    preempted: list[Sequence] = field(default_factory=list)
    # The tokens of the step still in flight (overlapped steps): a sequence's PENDING last token is
    # prior_tokens[seq.pending_row], read by the runner on the device.
    prior_tokens: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.items)

    def token_ids(self, seq: Sequence) -> list[int]:
        """seq's tokens with a PENDING last token read from prior_tokens (a host copy: model-free runners)."""
        if seq.pending_row is None:
            return seq.token_ids
        return seq.token_ids[:-1] + [int(self.prior_tokens[seq.pending_row])]


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 reserve_upfront: bool = False, max_model_len: int | None = None,
                 windows: WindowTables | None = None, tiers: KVTiers | None = None):
        assert not reserve_upfront or max_model_len, "up-front reservation needs the context length"
        self.pool = pool
        self.windows = windows      # the sliding-window layer groups' tables, for models that have them
        self.reserve_upfront = reserve_upfront
        self.max_model_len = max_model_len
        self.tiers = tiers  # RAM/disk below the pool: prefix lookups go on there after a pool miss
        assert not (tiers and windows), "no KV tiers under sliding-window groups (their blocks are not stored)"
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = int(0.01 * pool.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pins: OrderedDict[int, Sequence] = OrderedDict()  # least recently used first
        self.num_preemptions = 0
        self._reserved_ahead = False  # reserve_for_drafts took blocks this step: schedule gives back the unused

    # -- queues ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        _insert_by_arrival(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        _insert_by_arrival(self.running, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the step -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = self._schedule()
        if self._reserved_ahead:
            self._give_back_unverified(batch)
        return batch

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if _waits_for_siblings(seq) or seq.ends_when_settled:  # nothing to compute this step
                i += 1
                continue
            n = self._fit_drafts(seq, budget)
            in_place = self._decodes_in_place(seq, n)
            if in_place or self._make_room(seq, n, reserve=0):
                if not in_place:
                    self._reserve(seq, n, batch.copies)
                batch.items.append((seq, n))
                budget -= n
                i += 1
                continue
            if seq.draft_ids:
                seq.draft_ids = []             # drafts are worth no one's preemption
                continue
            # A beam that already has its logits goes first: parked, it loses no work (see _preempt).
            victim = next((s for s in reversed(self.running) if _waits_for_siblings(s)), self.running[-1])
            if victim is seq and len(self.running) == 1:
                batch.failed.append(seq)       # alone in an empty pool and still too big
                self._release(seq)
                self.running.remove(seq)
                break
            self._preempt(victim)
            batch.preempted.append(victim)
        for seq in self.running[i:]:
            seq.draft_ids = []                 # not scheduled this step: nothing to verify
        if batch.preempted:
            return batch
        pending = self._blocks_computed_by(batch.items) if self.waiting else set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self._match_prefix(seq)
            if pending and seq.reuses_prefix and self._next_block_hash(seq) in pending:
                self._release(seq)  # its next block is being computed right now: share it next step
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            hold = self._tokens_to_hold(seq, n)
            if not self._make_room(seq, hold, reserve=self.watermark if self.running else 0):
                if self.running and all(_waits_for_siblings(s) for s in self.running):
                    self._preempt(self.running[-1])  # only beams waiting for their siblings hold memory
                    continue
                if not self.running and self.pool.num_used == self._held_by(seq):
                    self.waiting.popleft()      # nothing else holds memory: it can never fit
                    batch.failed.append(seq)
                    self._release(seq)
                    continue
                self._release(seq)              # do not sit on cached blocks while waiting
                break
            self.waiting.popleft()
            self.pool.record_lookup(seq.num_tokens, seq.num_computed, *seq.tier_hits)
            if seq.request.prefix_hit_tokens is None:
                seq.request.prefix_hit_tokens = seq.num_computed
                seq.request.ram_hit_tokens, seq.request.disk_hit_tokens = seq.tier_hits
            self._reserve(seq, hold, batch.copies)
            seq.status = SeqStatus.RUNNING
            _insert_by_arrival(self.running, seq)
            batch.items.append((seq, n))
            pending |= self._blocks_computed_by([(seq, n)])
            budget -= n
        return batch

    def commit(self, batch: ScheduledBatch) -> None:
        """After the forward pass: advance computed counts and index blocks that became full. A sequence that
        the previous step's tokens finished while this one ran (overlapped steps) is skipped: finished or pinned
        as it would be without the overlap, its last token not computed (the KV this step wrote for it lies
        past its computed tokens, in a block it no longer holds or never reads)."""
        for seq, n in batch.items:
            if seq.is_finished:
                continue
            seq.num_computed += n - len(seq.draft_ids)  # drafted slots count once verified (Engine)
            if seq.num_computed // self.block_size > len(seq.block_hashes):   # a block became full
                self._register_full_blocks(seq)
            if self.windows:  # drafts are not counted yet: what they would free goes at a later commit
                self.windows.release_behind(seq)

    def _fit_drafts(self, seq: Sequence, budget: int) -> int:
        """Tokens to schedule for a running sequence: its uncomputed tokens, plus its drafts as far as the
        budget allows (a draft cut short is still a draft; a chunk cut short is not verified)."""
        n = seq.num_tokens - seq.num_computed
        if seq.draft_ids:
            del seq.draft_ids[max(0, budget - n):]
        return min(n + len(seq.draft_ids), budget)

    def reserve_for_drafts(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Before a draft model writes KV for k drafts of each sequence (engine/decoding/draft.py), in blocks of the
        sequence's own table: the table is made to cover the verify step's 1 + k positions, and its blocks from
        the computed frontier on private (copy-on-write now; the copies are returned, for the caller to make on
        the device before the draft's forward). Drafts take only blocks that no running sequence's own next
        tokens need, and evict no pin: a sequence they do not fit drafts nothing (k = 0). Blocks of drafts
        that `schedule` then does not verify are given back there."""
        spare = self.pool.num_free - sum(
            self._blocks_needed(s, min(s.num_tokens - s.num_computed, self.max_num_batched_tokens))
            for s in self.running if not _waits_for_siblings(s))
        fitted, copies = [], []
        for seq, k in zip(seqs, ks):
            extra = self._blocks_needed(seq, 1 + k) - self._blocks_needed(seq, 1) if k else 0
            if k and extra > spare:
                k = 0
            if k:
                self._reserve(seq, 1 + k, copies)
                spare -= extra
                self._reserved_ahead = True
            fitted.append(k)
        return fitted, copies

    def _give_back_unverified(self, batch: ScheduledBatch) -> None:
        """After reserve_for_drafts: tail blocks past what this step computes (drafts cut by the token budget
        or dropped, a sequence not scheduled) go back; they hold only the draft's KV of unverified proposals."""
        self._reserved_ahead = False
        if self.reserve_upfront:  # a reserved table keeps its whole reply's blocks
            return
        scheduled = {seq.seq_id: n for seq, n in batch.items}
        for seq in self.running:
            keep = self.blocks_for(seq.num_computed + scheduled.get(seq.seq_id, 0))
            if len(seq.block_table) > keep:
                self._free_tail(seq, keep)

    def roll_back(self, seq: Sequence) -> None:
        """After verification: give back the tail blocks that hold only rejected draft slots (they were
        never counted as computed, so never hashed), and index blocks that accepted drafts completed."""
        if not self.reserve_upfront:  # a reserved table keeps its whole reply's blocks
            self._free_tail(seq, self.blocks_for(seq.num_computed))
        self._register_full_blocks(seq)

    # -- blocks ---------------------------------------------------------------------------------------------
    def _tokens_to_hold(self, seq: Sequence, n: int) -> int:
        """Tokens past the computed ones that admission must hold blocks for: this step's chunk (paged), or
        the rest of the prompt and the whole reply up to max_tokens within the context (reserved)."""
        if not self.reserve_upfront:
            return n
        full = min(seq.num_prompt_tokens + seq.request.params.max_tokens, self.max_model_len)
        return max(n, full - seq.num_computed)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """New blocks plus copies of shared ones about to be written (paged: at most the partial block;
        a fork of a reserved table shares its empty reserved blocks too)."""
        end = self.blocks_for(seq.num_computed + n)
        new = max(0, end - len(seq.block_table))
        written = seq.block_table[seq.num_computed // self.block_size:end]
        shared = sum(1 for b in written if self.pool.ref_count[b] > 1)
        return new + shared + (self.windows.cost(seq, n) if self.windows else 0)

    def _decodes_in_place(self, seq: Sequence, n: int) -> bool:
        """A one-token step whose slot is in a block the sequence already owns alone and that indexes nothing:
        no block to take or copy (15 of 16 decode steps at block size 16), so _make_room and _reserve are
        skipped (they would do nothing: the step's host time at 256 sequences is what a GPU waits for)."""
        c = seq.num_computed
        if n != 1 or not c % self.block_size or self.windows:
            return False
        block = seq.block_table[c // self.block_size]   # the block of token c - 1, computed
        return self.pool.ref_count[block] == 1 and self.pool.block_hash[block] is None

    def _make_room(self, seq: Sequence, n: int, reserve: int) -> bool:
        needed = self._blocks_needed(seq, n) + reserve
        while self.pool.num_free < needed and self.pins:
            self.evict_pin(next(iter(self.pins.values())))
            needed = self._blocks_needed(seq, n) + reserve  # an evicted pin may have ended a sharing
        return self.pool.num_free >= needed

    def _reserve(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for index in range(seq.num_computed // bs, min(len(seq.block_table), self.blocks_for(seq.num_computed + n))):
            copy = self.pool.copy_on_write(seq.block_table, index)
            if copy:
                copies.append(copy)
        while len(seq.block_table) < self.blocks_for(seq.num_computed + n):
            seq.block_table.append(self.pool.allocate(after=seq.block_table[-1] if seq.block_table else None))
        if self.windows:
            self.windows.reserve(seq, n, copies)

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse computed KV at admission: fork a pinned parent, else walk the prefix cache (the pool, then
        the tiers below it)."""
        tokens = seq.token_ids
        limit = seq.num_tokens - 1  # the last token is always computed: its logits are sampled
        parent = seq.parent
        seq.tier_hits = (0, 0)
        if not seq.reuses_prefix:
            seq.num_computed = 0
        elif parent is not None and parent.status == SeqStatus.PINNED:
            k = _common_prefix(tokens, parent.token_ids, min(parent.num_computed, limit))
            self.touch_pin(parent)
            if self.windows and self.windows.usable_prefix(parent, k) < k:
                # A fork at an earlier point whose window blocks the parent has released: the prefix
                # cache may still hold them (released blocks stay cached until reused).
                self._match_cached(seq, limit)
            else:
                self.fork_into(parent, seq, k)
        else:
            self._match_cached(seq, limit)

    def _match_cached(self, seq: Sequence, limit: int) -> None:
        """Walk the prefix cache over the full blocks of the first `limit` tokens: the pool, then the tiers."""
        bs, tokens = self.block_size, seq.token_ids
        loads: list[tuple[int, torch.Tensor]] = []
        hits = {"ram": 0, "disk": 0}
        for i in range(limit // bs):
            h = seq.block_hashes[-1] if seq.block_hashes else None
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            found = self.pool.lookup(h, block_tokens)
            if found is not None:
                block, key = found
                self.pool.incref(block)
            else:
                loaded = self._load_from_tiers(h, block_tokens)
                if loaded is None:
                    break
                (block, key, payload), tier = loaded
                loads.append((block, payload))
                hits[tier] += bs
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        if self.windows and seq.block_table:
            self._free_tail(seq, self.windows.attach_cached(seq, seq.block_hashes))
            del seq.block_hashes[len(seq.block_table):]
        if loads:
            self.tiers.load([b for b, _ in loads], [p for _, p in loads])
        seq.num_computed = len(seq.block_table) * bs
        seq.tier_hits = (hits["ram"], hits["disk"])

    def _load_from_tiers(self, parent: bytes | None, block_tokens: tuple[int, ...]):
        """((fresh pool block, key, payload), tier) for a block a lower tier holds, indexed in the pool
        already (its KV is copied in, batched, before anything can read it); None on a miss."""
        if self.tiers is None or not self.pool.enable_prefix_cache or self.pool.num_free == 0:
            return None
        key = chain_hash(parent, block_tokens)
        found = self.tiers.fetch(key, block_tokens)
        if found is None:
            return None
        tier, payload = found
        block = self.pool.allocate()
        self.pool.register(block, parent, block_tokens)
        return (block, key, payload), tier

    def fork_into(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """The child shares the parent's blocks: of its first num_tokens tokens, or its whole tables (None:
        a reserved table's blocks beyond the computed tokens included)."""
        k = parent.num_computed if num_tokens is None else num_tokens
        blocks = None if num_tokens is None else self.blocks_for(k)
        child.block_table = self.pool.fork_table(parent.block_table[:blocks])
        child.block_hashes = parent.block_hashes[: k // self.block_size]
        child.num_computed = k
        if self.windows:
            self.windows.fork(parent, child, blocks)

    def _blocks_computed_by(self, items: list[tuple[Sequence, int]]) -> set[bytes]:
        """Chain hashes of the full blocks these scheduled chunks complete (indexed only after the step)."""
        if not self.pool.enable_prefix_cache:
            return set()
        bs, hashes = self.block_size, set()
        for seq, n in items:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            end = (seq.num_computed + n - len(seq.draft_ids)) // bs
            if seq.pending_row is not None:  # a block with a PENDING token has no hash yet (none shares it)
                end = min(end, (seq.num_tokens - 1) // bs)
            for i in range(len(seq.block_hashes), end):
                parent = chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                hashes.add(parent)
        return hashes

    def _next_block_hash(self, seq: Sequence) -> bytes | None:
        """Hash of the first full prompt block this sequence would have to compute itself."""
        bs, i = self.block_size, len(seq.block_hashes)
        if len(seq.block_table) != i or (i + 1) * bs > seq.num_tokens - 1:
            return None
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        return chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < min(seq.num_computed // bs, len(seq.block_table)):
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(self.pool.register(seq.block_table[i], parent, tokens))
            if self.windows:
                self.windows.register(seq, i, parent, tokens)

    def _drop_unused_tail(self, seq: Sequence) -> None:
        """A pin keeps the blocks of its computed tokens only: reserved blocks a reply ended before using go
        back, and so does the block an overlapped step took for the last token's slot."""
        self._free_tail(seq, self.blocks_for(seq.num_computed))

    def _free_tail(self, seq: Sequence, keep: int) -> None:
        for block in reversed(seq.block_table[keep:]):
            self.pool.decref(block)
        del seq.block_table[keep:]
        if self.windows:
            self.windows.trim(seq, keep)

    def _held_by(self, seq: Sequence) -> int:
        held = sum(1 for b in seq.block_table if self.pool.ref_count[b] > 0)
        return held + (self.windows.held(seq) if self.windows else 0)

    def _release(self, seq: Sequence) -> None:
        seq.draft_ids = []
        seq.kv_resets += 1
        self.pool.free_table(seq.block_table)
        if self.windows:
            self.windows.free(seq)
        seq.block_hashes.clear()
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        """A beam that already has its logits (fully computed) is parked instead of queued: it needs no KV
        until its search picks it (engine/decoding/beam.py queues it then)."""
        parked = _waits_for_siblings(seq)
        self._release(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        if not parked:
            _insert_by_arrival(self.waiting, seq)
        self.num_preemptions += 1

    # -- finishing, aborting, pins --------------------------------------------------------------------------
    def finish(self, seq: Sequence, keep: bool) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if keep and seq.block_table:
            self._drop_unused_tail(seq)
            seq.status = SeqStatus.PINNED
            self.pins[seq.seq_id] = seq
        else:
            seq.status = SeqStatus.FINISHED
            self._release(seq)

    def touch_pin(self, seq: Sequence) -> None:
        if seq.seq_id in self.pins:
            self.pins.move_to_end(seq.seq_id)

    def evict_pin(self, seq: Sequence) -> None:
        """Drop a pin's blocks (its tokens stay; a later turn re-prefills, mostly from the prefix cache)."""
        if self.pins.pop(seq.seq_id, None) is not None:
            self._release(seq)
            seq.status = SeqStatus.FINISHED

    def all_tables(self) -> list[list[int]]:
        seqs = list(self.running) + list(self.waiting) + list(self.pins.values())
        return [s.block_table for s in seqs] + [t for s in seqs for t in WindowTables.live_tables(s)]


def _insert_by_arrival(queue, seq: Sequence) -> None:
    """Keep a queue in request arrival order (first come, first served; equal ones in insertion order).
    Running and waiting are ordered by request, not by sequence: a beam search forks new sequences every
    step, and they must not make the oldest request the newest one, the one preemption picks."""
    arrival, at = seq.request.arrival_time, len(queue)
    while at > 0 and queue[at - 1].request.arrival_time > arrival:
        at -= 1
    queue.insert(at, seq)


def _waits_for_siblings(seq: Sequence) -> bool:
    """A beam whose next-token logits are taken, waiting for its siblings' before its search steps."""
    return seq.request.beam is not None and seq.num_computed == seq.num_tokens


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    k = 0
    while k < limit and a[k] == b[k]:
        k += 1
    return k
