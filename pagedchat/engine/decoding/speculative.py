"""Speculative decoding: cheap proposals, verified k + 1 positions at a time in the normal engine step.

Before a step, every running sequence that is ready to decode gets up to k draft tokens (`seq.draft_ids`)
from a proposer. The scheduler schedules them with the sequence's last token (1 + k positions, inside the
token budget; drafts are dropped rather than preempting anyone), the runner scores them through the paged
prefill path and returns one logits row per position, and `verify` keeps the longest correct run plus one
token of the target's own. The engine then rolls the pool back to the accepted tokens (see
Engine._apply_verified): rejected slots are never counted as computed, so they are never hashed into the
prefix cache, never visible to a fork, and whole blocks holding only rejected slots go back to the pool.

Exactness: greedy keeps a draft only while it equals the target's argmax, so the tokens are the plain greedy
tokens. Sampling uses speculative rejection sampling for a deterministic proposal (every proposer here
proposes greedily): accept draft x with probability p(x), else draw from p with x removed (renormalized), so
each token is distributed exactly as the target's p. It is done by drawing the token from p exactly as a
plain step does and keeping the draft while they agree, so a seeded request's tokens do not depend on how
many drafts a step verified (the budget below depends on timings).

Adaptive k: each sequence keeps a running estimate `alpha` of the chance that a draft token is accepted and
drafts only as deep as alpha^i stays above what a draft costs (TAU at least; down to 0 = plain decode). While at 0 the n-gram proposer
keeps guessing in the shadow (free), so a sequence that starts repeating text gets drafts again.

Batch-aware budget: whether drafts pay depends on the hardware, the batch and the text. At batch 1 a forward
costs about the same for 1 or 8 positions (memory- or overhead-bound); at batch 16 on a CPU it is
compute-bound and every verified position costs real time. `DraftBudget` measures what a draft costs instead of
guessing: per batch-size class, the seconds of a plain step per sequence (one token's cost) and the extra
seconds per draft token of steps with drafts, timed end to end with proposing and verifying. A draft is worth
asking for while its chance of being accepted is at least the share of a token it costs. Costs are steady from
step to step, so a few steps measure them; the chance is each sequence's own acceptance estimate, which follows
its text (drafts that pay in bursts, as a regenerated reply re-aligning with its sibling now and then, are not
judged by a window of steps that happened to miss). So batch 16 on a CPU drafts only where acceptance is
high, and batch 1 keeps long drafts. And when nothing waits to be admitted, the batch lasts as long as its
sequence with the most tokens left: a sequence more than one step's drafts ahead of it decodes plainly (its
drafts would shorten nothing and cost the step), so the batch stays full to the end instead of thinning into
small, costly steps. And when several sequences share that most, a step shortens the run by more than one
token only if every one of them accepts a draft: while that chance (their acceptance estimates multiplied) is
under what a draft costs, the step runs plain, so a batch of equal sequences (16 replies of one length, as a
benchmark runs them) does not draft at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedchat.engine.decoding.sampler import Sampler, exponential_race, first_max
from pagedchat.engine.core.sequence import Sequence, SeqStatus

MAX_N = 4            # longest n-gram looked up (then shorter ones)
MAX_MATCH = 64       # how far back two matches are compared to pick the better stream
ALPHA_START = 0.7    # a new sequence starts optimistic: its first drafts decide
ALPHA_RATE = 0.15    # weight of each new accept/reject event in the running estimate
TAU = 0.1            # draft position i is worth asking for while alpha ** i >= TAU (or what a draft costs)
PROBE_EVERY = 16     # steps between one-token probes of a proposer that cannot guess in the shadow
BUDGET_DECAY = 0.99  # per step of a batch-size class, the weight of its earlier measurements falls by this
PLAIN_WEIGHT = 0.5   # a class whose plain steps' decayed weight fell under this runs one (every ~110 steps)


@dataclass
class SpecStats:
    """Cumulative over the engine's life; `tokens_per_step` counts every decode step of a sequence that had
    speculation on, including steps where it drafted nothing."""
    method: str
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0

    def as_dict(self) -> dict:
        return {"method": self.method, "proposed_tokens": self.proposed_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0,
                "tokens_per_step": self.decode_tokens / self.decode_steps if self.decode_steps else 0.0}


class NgramIndex:
    """Where each n-gram (n <= MAX_N) of a token stream last occurred: maps the n-gram to the position
    right after it (where its continuation starts). Built incrementally as the stream grows."""

    def __init__(self):
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_N + 1)]
        self.done = 1  # continuation positions below this are indexed

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index every continuation position c < upto (so an n-gram ending at the stream's end is skipped
        when upto = len(tokens): a sequence must not match its own suffix)."""
        for c in range(self.done, upto):
            for n in range(1, min(MAX_N, c) + 1):
                self.tables[n][tuple(tokens[c - n:c])] = c
        self.done = max(self.done, upto)

    def find(self, key: tuple[int, ...]) -> int | None:
        return self.tables[len(key)].get(key)


class SpecState:
    """Per sequence: acceptance estimate, n-gram indexes, a pending shadow guess."""

    def __init__(self, seq: Sequence):
        self.alpha = ALPHA_START
        self.own = NgramIndex()
        self.context = [(stream, NgramIndex()) for stream in seq.request.context if len(stream) > 1]
        for stream, index in self.context:
            index.extend(stream, len(stream))
        self.shadow: tuple[int, int] | None = None   # (position, guessed token) while drafting nothing
        self.idle_steps = 0

    def observe(self, accepted: bool) -> None:
        self.alpha += ALPHA_RATE * (float(accepted) - self.alpha)

    def depth(self, limit: int, threshold: float = TAU) -> int:
        k, p = 0, self.alpha
        while k < limit and p >= threshold:
            k, p = k + 1, p * self.alpha
        return k


class NgramProposer:
    """Drafts what followed the latest earlier occurrence of the sequence's last n tokens (n = 4..1), in its
    own prompt + output or in a related stream (chat siblings, the conversation); the stream whose match
    extends furthest back wins."""
    can_shadow = True

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self._propose_one(seq, k) for seq, k in zip(seqs, ks)]

    def _propose_one(self, seq: Sequence, k: int) -> list[int]:
        """Chained: each draft token is looked up again with the drafts before it as part of the key, so a
        short (n = 1) match that led somewhere is replaced by a longer one as soon as one exists, and a copy
        that ran into the end of a stream or a change goes on from the text's latest like place (a looping
        reply repeats its period; a regenerated reply re-aligns with its sibling after each difference)."""
        tokens, state = seq.token_ids, seq.spec
        state.own.extend(tokens, len(tokens))
        streams = [(tokens, state.own)] + state.context
        tail = tokens[-MAX_MATCH:]
        start = len(tail)
        for _ in range(k):
            # the first token picks among streams by how far back they match; the later ones mostly go on
            # copying, so a short comparison tells streams apart there (this runs per sequence per step)
            token = _next_token(tail, streams, MAX_MATCH if len(tail) == start else 2 * MAX_N)
            if token is None:
                break
            tail.append(token)
        return tail[start:]


def _next_token(tail: list[int], streams: list, compare: int) -> int | None:
    """What followed the latest earlier occurrence of tail's last n tokens (n = 4..1, longest first); among
    streams holding it, the one whose match extends furthest back (up to `compare` tokens) wins."""
    for n in range(min(MAX_N, len(tail)), 0, -1):
        key = tuple(tail[-n:])
        hits = [(stream, c) for stream, index in streams if (c := index.find(key)) is not None]
        if len(hits) == 1:
            return hits[0][0][hits[0][1]]
        if hits:
            best, best_len = None, -1
            for stream, c in hits:
                length = _match_length(tail, stream, c, compare)
                if length > best_len:
                    best, best_len = stream[c], length
            return best
    return None


def _tokens_left(seq: Sequence, max_model_len: int) -> int:
    """Most tokens the sequence may still add (max_tokens, the context)."""
    return min(seq.request.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)


def _match_length(tokens: list[int], stream: list[int], c: int, compare: int = MAX_MATCH) -> int:
    """How many tokens before stream[c] equal the end of `tokens` (capped at `compare`)."""
    n, limit = 0, min(compare, c, len(tokens))
    while n < limit and stream[c - 1 - n] == tokens[-1 - n]:
        n += 1
    return n


@dataclass(frozen=True)
class StepShape:
    """What a scheduled step holds, for the budget's measurements."""
    decodes: int      # sequences adding one token of their own (drafting or not)
    drafts: int       # draft tokens verified
    other: int        # every other scheduled token (prefill chunks)


def step_shape(batch) -> StepShape:
    """The StepShape of a scheduled batch (taken before the step: drafts are cleared once verified)."""
    decodes = drafts = other = 0
    for seq, n in batch.items:
        k = len(seq.draft_ids)
        if n - k == 1 and seq.num_computed == seq.num_tokens - 1:
            decodes, drafts = decodes + 1, drafts + k
        else:
            other += n
    return StepShape(decodes, drafts, other)


class DraftBudget:
    """What a draft costs, measured. Per batch-size class (the number of decoding sequences, by powers of two),
    exponentially weighted: the seconds of a plain step per decoding sequence (one token's cost) and, over
    steps with drafts, the seconds beyond that per draft token verified. A draft at position i of a sequence
    yields alpha ** i tokens on average: worth asking for while that is at least its cost in tokens
    (`threshold`, never below TAU). A class whose plain cost was not measured lately runs a plain step (costs
    drift as contexts grow); until both costs are known, drafts count as cheap. The clock is the engine's
    (CPU time on a CPU)."""

    def __init__(self):
        # class -> [plain steps' weight, their seconds per sequence, draft tokens' weight, their extra seconds]
        self.sums: dict[int, list[float]] = {}

    def _sums(self, decodes: int) -> list[float]:
        return self.sums.setdefault(decodes.bit_length(), [0.0, 0.0, 0.0, 0.0])

    def wants_plain(self, decodes: int) -> bool:
        return self._sums(decodes)[0] < PLAIN_WEIGHT

    def threshold(self, decodes: int) -> float:
        """The least acceptance chance a draft position must have to pay at this batch size."""
        plain_weight, plain, draft_weight, extra = self._sums(decodes)
        if not plain_weight or not draft_weight or plain <= 0:
            return TAU
        return max(TAU, (extra / draft_weight) / (plain / plain_weight))

    def observe(self, decodes: int, drafts: int, seconds: float) -> None:
        sums = self._sums(decodes)
        sums[:] = [x * BUDGET_DECAY for x in sums]
        if not drafts:
            sums[0], sums[1] = sums[0] + 1.0, sums[1] + seconds / decodes
        elif sums[0]:
            token = sums[1] / sums[0]
            sums[2], sums[3] = sums[2] + drafts, sums[3] + max(seconds - token * decodes, 0.0)


class Speculator:
    """Chooses how many tokens each sequence drafts, asks the proposer, verifies the target's logits."""

    def __init__(self, method: str, num_draft_tokens: int, proposer, max_model_len: int):
        self.proposer = proposer
        self.max_k = num_draft_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats(method)
        self.budget: DraftBudget | None = DraftBudget()  # None: drafts as deep as TAU says (tests)
        self._cap = num_draft_tokens  # this step's draft cap
        self._threshold = TAU  # this step's least acceptance chance worth a draft
        self._untimed = False  # this step did one-off work: its time would mislead the budget

    # -- before the step ------------------------------------------------------------------------------------
    def propose(self, running: list[Sequence], closed: bool = False) -> None:
        """Drafts for this step. closed: no request is waiting, so the run lasts as long as its sequence with
        the most tokens left, and only the sequences within one step's drafts of it draft."""
        decodes = sum(seq.num_computed == seq.num_tokens - 1 for seq in running)
        most_left = max((_tokens_left(s, self.max_model_len) for s in running), default=0) if closed else 0
        self._cap, self._threshold = self.max_k, TAU
        if self.budget is not None and decodes:
            self._threshold = self.budget.threshold(decodes)
            hopeless = closed and self._shortening_chance(running, most_left) < self._threshold
            self._cap = 0 if hopeless or self.budget.wants_plain(decodes) else self.max_k
        if self._cap == 0:
            # a plain step for the whole batch: no lookups, no shadow guesses (their per-sequence Python
            # would be most of what speculation still costs here; alpha waits until drafts pay again)
            for seq in running:
                seq.draft_ids = []
            return
        seqs, ks = [], []
        for seq in running:
            seq.draft_ids = []
            if not self._ready(seq):
                continue
            if seq.spec is None:
                seq.spec = SpecState(seq)
                self._untimed = True  # indexing its context streams is a one-off, no step's usual cost
            self._check_shadow(seq)
            seqs.append(seq)
            lagging = _tokens_left(seq, self.max_model_len) + self._cap >= most_left
            ks.append(self._depth(seq) if lagging or self.budget is None else 0)
        if not seqs:
            return
        shadow = self.proposer.can_shadow
        asked = [(s, k if k else 1) for s, k in zip(seqs, ks) if k or shadow]
        drafts = self.proposer.propose([s for s, _ in asked], [k for _, k in asked]) if asked else []
        guessed = {s.seq_id: d for (s, _), d in zip(asked, drafts)}
        for seq, k in zip(seqs, ks):
            draft = guessed.get(seq.seq_id, [])
            if k:
                seq.draft_ids = draft[:k]
            elif draft:
                seq.spec.shadow = (seq.num_tokens, draft[0])

    def _shortening_chance(self, running: list[Sequence], most_left: int) -> float:
        """A closed run ends when its sequences with the most tokens left end: a step brings that closer by
        more than one token only if every one of them accepts a draft. The chance of that, from their
        acceptance estimates (a batch of equal sequences, as a benchmark runs, has none worth a drafted step).
        One such sequence alone: its own depth rule decides (and keeps guessing in the shadow at depth 0)."""
        last = [seq for seq in running if _tokens_left(seq, self.max_model_len) == most_left]
        chance = 1.0
        for seq in last if len(last) > 1 else []:
            chance *= seq.spec.alpha if seq.spec is not None else ALPHA_START
        return chance

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """A step ran in `seconds`. Only steps of decodes alone measure what tokens and drafts cost."""
        if self.budget is not None and not self._untimed and not shape.other and shape.decodes:
            self.budget.observe(shape.decodes, shape.drafts, seconds)
        self._untimed = False

    def _ready(self, seq: Sequence) -> bool:
        """Decoding (its whole context computed but the last token), and nothing that depends on the
        tokens before each position (a repetition penalty would differ per drafted position)."""
        params = seq.request.params
        return (seq.status == SeqStatus.RUNNING and seq.num_computed == seq.num_tokens - 1
                and seq.request.forked and params.repetition_penalty == 1.0
                and seq.request.beam is None   # a beam search picks every next token from all beams' logits
                # logprobs are reduced for one sampled row per step, not for drafts (grammar masks are
                # walked over the drafts: Grammars.mask_drafted)
                and params.logprobs is None)

    def _depth(self, seq: Sequence) -> int:
        # the bonus token must fit too: a draft past max_tokens or the context would only be thrown away
        room = _tokens_left(seq, self.max_model_len) - 1
        k = seq.spec.depth(min(self.max_k, max(room, 0)), self._threshold)
        if k == 0 and room > 0 and not self.proposer.can_shadow:
            seq.spec.idle_steps += 1
            if seq.spec.idle_steps >= PROBE_EVERY:  # one real draft token now and then, to notice a change
                seq.spec.idle_steps, k = 0, 1
        return k

    def _check_shadow(self, seq: Sequence) -> None:
        shadow, seq.spec.shadow = seq.spec.shadow, None
        if shadow is not None and shadow[0] < seq.num_tokens:
            seq.spec.observe(seq.token_ids[shadow[0]] == shadow[1])

    # -- after the forward ----------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, verified: list[tuple[Sequence, int, int]]) -> list[tuple[list[int], int]]:
        """Per (sequence, first row, rows) with rows == 1 + len(drafts) in `logits`: (tokens to append, how
        many of them are accepted drafts). One argmax for every greedy row and one distribution for every
        sampled row of the step, not one per sequence."""
        assert all(n == len(seq.draft_ids) + 1 for seq, _, n in verified)
        greedy = [v for v in verified if v[0].request.params.greedy]
        sampled = [v for v in verified if not v[0].request.params.greedy]
        results = {}
        if greedy:
            targets = first_max(logits[_rows(greedy, logits.device)]).tolist()
            r = 0
            for seq, _, n in greedy:
                results[seq.seq_id] = _accept_greedy(targets[r:r + n], seq.draft_ids)
                r += n
        if sampled:
            seqs = [seq for seq, _, n in sampled for _ in range(n)]
            probs = Sampler.probabilities(logits[_rows(sampled, logits.device)].float(), seqs)
            r = 0
            for seq, _, n in sampled:
                results[seq.seq_id] = _accept_sampled(probs[r:r + n], seq.draft_ids, seq)
                r += n
        out = []
        for seq, _, _ in verified:
            tokens, accepted = results[seq.seq_id]
            self.record(seq, len(seq.draft_ids), accepted, len(tokens))
            out.append((tokens, accepted))
        return out

    def record(self, seq: Sequence, proposed: int, accepted: int, emitted: int) -> None:
        stats = self.stats
        stats.proposed_tokens += proposed
        stats.accepted_tokens += accepted
        stats.decode_steps += 1
        stats.decode_tokens += emitted
        if seq.spec is not None:
            for i in range(min(proposed, accepted + 1)):
                seq.spec.observe(i < accepted)


def _rows(verified: list[tuple[Sequence, int, int]], device) -> torch.Tensor:
    return torch.tensor([r for _, first, n in verified for r in range(first, first + n)], device=device)


def _accept_greedy(target: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """Keep drafts while they equal the target's argmax, then the target's own next token."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return drafts[:a] + [target[a]], a


def _accept_sampled(probs: torch.Tensor, drafts: list[int], seq: Sequence) -> tuple[list[int], int]:
    """Each position draws its token y from p as a plain step would (the exponential race: one noise vector
    per emitted token, from the sequence's own generator when it is seeded) and keeps the draft x while y == x.
    So x is kept with probability p(x), and a rejection yields y ~ p without x (renormalized): speculative
    rejection sampling for a point-mass proposal. And because the noise is drawn per emitted token, a seeded
    sequence gets the very tokens plain decoding draws, whichever drafts the step budget kept."""
    for a, x in enumerate(drafts):
        y = int(exponential_race(probs[a:a + 1], [seq])[0])
        if y != x:
            return drafts[:a] + [y], a
    return drafts + [int(exponential_race(probs[-1:], [seq])[0])], len(drafts)
