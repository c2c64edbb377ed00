"""Turn logits into tokens: repetition penalty, temperature, top-k, top-p, min-p (transformers' order).

Every seeded sequence draws from its own generator, so its tokens do not depend on which other requests
share the batch. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which equals
drawing from p and needs one random vector per row.

The sampler works on the device and its settings live there: each sequence gets a row of `SamplingState`
(temperature, top-k/p, min-p, repetition penalty, and the set of tokens it holds, for the penalty) when it
first samples. A step gathers its rows with one index tensor, built when the batch's sequences change and
reused while they do not (a decode run: no per-step tensors from Python lists); the penalty's token sets
are updated on the device with each step's sampled tokens, from the host only for tokens that came another
way (a prompt, a verified draft run). The step's token ids reach the host in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedchat.engine.core.sequence import Sequence
from pagedchat.engine.core.step_inputs import index_tensor, to_device

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads variant seeds apart


def variant_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """Variant 0 of seed s draws exactly like an n=1 request with seed s; variant i gets its own stream."""
    if seed is None:
        return None
    value = seed if index == 0 else (seed * 1_000_003 + index * _MIX) % (2**63)
    gen = torch.Generator(device=device)
    gen.manual_seed(value)
    return gen


def apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """transformers' repetition penalty, row by row from each sequence's token ids (the reference the
    device-resident SamplingState.penalize is tested against)."""
    for row, seq in enumerate(seqs):
        penalty = seq.request.params.repetition_penalty
        if penalty == 1.0:
            continue
        ids = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        scores = logits[row, ids]
        logits[row, ids] = torch.where(scores < 0, scores * penalty, scores / penalty)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p remove; every row keeps at least one token."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    remove = rank >= torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top-p: drop a token once the mass strictly before it already reaches top_p
    before = probs.cumsum(dim=-1) - probs
    remove |= (before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    remove |= (probs < min_p[:, None] * probs[:, :1]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@dataclass
class StepRows:
    """One batch's view of SamplingState: device index and settings of its rows, and what the host needs to
    know about them (kept while the batch's sequences stay the same)."""
    key: tuple[int, ...]
    slots: torch.Tensor            # [rows] int64: each row's slot in SamplingState
    random: torch.Tensor | None    # rows that sample (None: every row; empty: none)
    temperature: torch.Tensor      # [random rows]
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    filters: bool                  # some random row uses top-k, top-p or min-p
    penalties: bool                # some row has a repetition penalty
    seeded: list[int]              # random rows (positions among them) drawing from their own generator
    generators: list[torch.Generator]  # theirs, in that order
    unseeded: torch.Tensor | None  # the other random rows (None: all of them)


class SamplingState:
    """Per-sequence sampling settings as device tensors, one slot per live sequence (see the module doc)."""

    def __init__(self, device: torch.device, vocab: int, capacity: int = 64):
        self.device, self.vocab = device, vocab
        self.owner: list[Sequence | None] = [None] * capacity
        self.slot_of: dict[int, int] = {}          # seq_id -> slot
        self.known: list[int] = [0] * capacity     # leading tokens of the owner already in `seen`
        self.settings = torch.zeros((capacity, 5), device=device)   # temperature, top_k, top_p, min_p, penalty
        self.seen: torch.Tensor | None = None      # [capacity, vocab] bool, made with the first penalty
        self.rows: StepRows | None = None

    def step_rows(self, seqs: list[Sequence]) -> StepRows:
        key = tuple(seq.seq_id for seq in seqs)
        if self.rows is None or self.rows.key != key:
            self._release_finished()
            self.rows = self._build(key, seqs)
        return self.rows

    def _build(self, key: tuple[int, ...], seqs: list[Sequence]) -> StepRows:
        slots = [self._slot(seq) for seq in seqs]
        random_rows = [i for i, seq in enumerate(seqs) if not seq.request.params.greedy]
        params = [seqs[i].request.params for i in random_rows]
        index = index_tensor(slots, self.device)
        random = None if len(random_rows) == len(seqs) else index_tensor(random_rows, self.device)
        settings = self.settings[index if random is None else index[random]]
        seeded = [j for j, i in enumerate(random_rows) if seqs[i].generator is not None]
        unseeded = None if not seeded else index_tensor([j for j, i in enumerate(random_rows)
                                                         if seqs[i].generator is None], self.device)
        return StepRows(key, index, random, settings[:, 0], settings[:, 1].long(), settings[:, 2], settings[:, 3],
                        any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
                        any(seq.request.params.repetition_penalty != 1.0 for seq in seqs), seeded,
                        [seqs[random_rows[j]].generator for j in seeded], unseeded)

    def _slot(self, seq: Sequence) -> int:
        slot = self.slot_of.get(seq.seq_id)
        if slot is not None:
            return slot
        if None not in self.owner:
            self._grow()
        slot = self.owner.index(None)
        self.owner[slot], self.slot_of[seq.seq_id], self.known[slot] = seq, slot, 0
        p = seq.request.params
        self.settings[slot] = to_device(np.array([p.temperature if not p.greedy else 1.0, p.top_k, p.top_p,
                                                  p.min_p, p.repetition_penalty], dtype=np.float32), self.device)
        if p.repetition_penalty != 1.0:
            if self.seen is None:
                self.seen = torch.zeros((len(self.owner), self.vocab), dtype=torch.bool, device=self.device)
            self.seen[slot] = False
        return slot

    def _grow(self) -> None:
        old = len(self.owner)
        self.owner += [None] * old
        self.known += [0] * old
        self.settings = torch.cat([self.settings, torch.zeros_like(self.settings)])
        if self.seen is not None:
            self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])

    def _release_finished(self) -> None:
        for slot, seq in enumerate(self.owner):
            if seq is not None and seq.is_finished:
                self.owner[slot] = None
                del self.slot_of[seq.seq_id]

    def penalize(self, logits: torch.Tensor, seqs: list[Sequence], rows: StepRows) -> torch.Tensor:
        """transformers' repetition penalty from the device-resident token sets: seen tokens' scores are
        multiplied (negative) or divided (positive) by the penalty; rows without one are untouched (x 1)."""
        self._catch_up(seqs, rows)
        seen = self.seen[rows.slots]
        penalty = self.settings[rows.slots, 4][:, None]
        return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)

    def _catch_up(self, seqs: list[Sequence], rows: StepRows) -> None:
        """Add to the token sets what the device did not see sampled: a prompt, a verified draft run."""
        slots, tokens = [], []
        for seq in seqs:
            slot = self.slot_of[seq.seq_id]
            if seq.request.params.repetition_penalty != 1.0 and self.known[slot] < seq.num_tokens:
                new = seq.token_ids[self.known[slot]:]
                slots += [slot] * len(new)
                tokens += new
                self.known[slot] = seq.num_tokens
        if tokens:
            self.seen[index_tensor(slots, self.device), index_tensor(tokens, self.device)] = True

    def note_sampled(self, seqs: list[Sequence], rows: StepRows, tokens: torch.Tensor) -> None:
        """Each row's sampled token goes into its sequence's token set on the device (the engine appends it)."""
        if not rows.penalties:
            return
        self.seen[rows.slots, tokens] = True
        for seq in seqs:
            slot = self.slot_of[seq.seq_id]
            if self.known[slot] == seq.num_tokens:
                self.known[slot] += 1


class Sampler:
    def __init__(self):
        self.state: SamplingState | None = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self.pick(self.scores(logits, seqs), seqs)

    def _rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> StepRows:
        if self.state is None or self.state.device != logits.device or self.state.vocab != logits.shape[-1]:
            self.state = SamplingState(logits.device, logits.shape[-1])
        return self.state.step_rows(seqs)

    def scores(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The model's scores as the request sees them: fp32, repetition penalty applied (log-probabilities
        are taken from these, before temperature and truncation)."""
        assert logits.shape[0] == len(seqs)
        logits = logits.float()
        rows = self._rows(logits, seqs)
        return self.state.penalize(logits, seqs, rows) if rows.penalties else logits

    def pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Greedy rows take the argmax; the others sample after temperature, top-k, top-p and min-p."""
        return self.pick_on_device(logits, seqs).tolist()   # the step's one copy to the host

    def pick_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """`pick`, its tokens left on the device (an overlapped step copies them without waiting)."""
        rows = self._rows(logits, seqs)
        if rows.random is None:                    # every row samples
            tokens = self._sample(logits, rows)
        else:
            tokens = first_max(logits)
            if rows.random.numel():
                tokens[rows.random] = self._sample(logits[rows.random], rows)
        self.state.note_sampled(seqs, rows, tokens)
        return tokens

    @staticmethod
    def _sample(logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        logits = logits / rows.temperature[:, None]
        if rows.filters:
            logits = _filter(logits, rows.top_k, rows.top_p, rows.min_p)
        return _race(logits.softmax(dim=-1), rows.generators, rows.seeded, rows.unseeded)

    @staticmethod
    def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k / top-p / min-p (built from the
        sequences' settings: the verify path of speculative decoding)."""
        dev = logits.device
        params = [s.request.params for s in seqs]
        temp = torch.tensor([p.temperature for p in params], device=dev)
        logits = logits / temp[:, None]
        needs_filter = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        if needs_filter:
            logits = _filter(logits,
                             torch.tensor([p.top_k for p in params], device=dev),
                             torch.tensor([p.top_p for p in params], device=dev),
                             torch.tensor([p.min_p for p in params], device=dev))
        return logits.softmax(dim=-1)


def exponential_race(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One draw per row from (unnormalized) probs, each seeded row from its own sequence's generator."""
    seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
    unseeded = None if not seeded else torch.tensor([i for i, s in enumerate(seqs) if s.generator is None],
                                                    dtype=torch.long, device=probs.device)
    return _race(probs, [seqs[i].generator for i in seeded], seeded, unseeded)


def _race(probs: torch.Tensor, generators: list[torch.Generator], seeded: list[int],
          unseeded: torch.Tensor | None) -> torch.Tensor:
    """argmax(p / E): the unseeded rows' noise in one draw, each seeded row's from its own generator."""
    if not seeded:
        return first_max(probs / torch.empty_like(probs).exponential_())
    noise = torch.empty_like(probs)
    if unseeded.numel():
        noise[unseeded] = torch.empty((unseeded.numel(), probs.shape[1]), device=probs.device).exponential_()
    for i, gen in zip(seeded, generators):
        noise[i].exponential_(generator=gen)
    return first_max(probs / noise)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first maximum; a NaN wins, as in argmax). torch.max's indices: the same answer,
    faster than argmax on CPU (16 rows of Gemma 3's 262,144 logits, fp32, one thread: 6.2 ms against 8.8)."""
    return torch.max(x, dim=-1).indices
