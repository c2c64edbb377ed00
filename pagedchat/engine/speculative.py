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
each token is distributed exactly as the target's p.

Adaptive k: each sequence keeps a running estimate `alpha` of the chance that a draft token is accepted and
drafts only as deep as alpha^i stays above TAU (down to 0 = plain decode). While at 0 the n-gram proposer
keeps guessing in the shadow (free), so a sequence that starts repeating text gets drafts again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedchat.engine.sampler import Sampler, exponential_race
from pagedchat.engine.sequence import Sequence, SeqStatus

MAX_N = 4            # longest n-gram looked up (then shorter ones)
MAX_MATCH = 64       # how far back two matches are compared to pick the better stream
ALPHA_START = 0.7    # a new sequence starts optimistic: its first drafts decide
ALPHA_RATE = 0.15    # weight of each new accept/reject event in the running estimate
TAU = 0.3            # draft position i is worth verifying while alpha ** i >= TAU
PROBE_EVERY = 16     # steps between one-token probes of a proposer that cannot guess in the shadow


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

    def depth(self, limit: int) -> int:
        k, p = 0, self.alpha
        while k < limit and p >= TAU:
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
        tokens, state = seq.token_ids, seq.spec
        state.own.extend(tokens, len(tokens))
        streams = [(tokens, state.own)] + state.context
        for n in range(min(MAX_N, len(tokens)), 0, -1):
            key = tuple(tokens[-n:])
            best, best_len = None, 0
            for stream, index in streams:
                c = index.find(key)
                if c is not None:
                    length = _match_length(tokens, stream, c)
                    if length > best_len:
                        best, best_len = stream[c:c + k], length
            if best:
                return list(best)
        return []


def _match_length(tokens: list[int], stream: list[int], c: int) -> int:
    """How many tokens before stream[c] equal the end of `tokens` (capped at MAX_MATCH)."""
    n, limit = 0, min(MAX_MATCH, c, len(tokens))
    while n < limit and stream[c - 1 - n] == tokens[-1 - n]:
        n += 1
    return n


class Speculator:
    """Chooses how many tokens each sequence drafts, asks the proposer, verifies the target's logits."""

    def __init__(self, method: str, num_draft_tokens: int, proposer, max_model_len: int):
        self.proposer = proposer
        self.max_k = num_draft_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats(method)

    # -- before the step ------------------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        seqs, ks = [], []
        for seq in running:
            seq.draft_ids = []
            if not self._ready(seq):
                continue
            if seq.spec is None:
                seq.spec = SpecState(seq)
            self._check_shadow(seq)
            seqs.append(seq)
            ks.append(self._depth(seq))
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
        params = seq.request.params
        # the bonus token must fit too: a draft past max_tokens or the context would only be thrown away
        room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        k = seq.spec.depth(min(self.max_k, max(room, 0)))
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
    def verify(self, seq: Sequence, logits: torch.Tensor) -> tuple[list[int], int]:
        """(tokens to append, how many of them are accepted drafts); logits has 1 + len(drafts) rows."""
        drafts = seq.draft_ids
        assert logits.shape[0] == len(drafts) + 1
        if seq.request.params.greedy:
            tokens, accepted = _accept_greedy(logits, drafts)
        else:
            tokens, accepted = _accept_sampled(Sampler.probabilities(logits.float(), [seq] * logits.shape[0]),
                                               drafts, seq)
        self.record(seq, len(drafts), accepted, len(tokens))
        return tokens, accepted

    def record(self, seq: Sequence, proposed: int, accepted: int, emitted: int) -> None:
        stats = self.stats
        stats.proposed_tokens += proposed
        stats.accepted_tokens += accepted
        stats.decode_steps += 1
        stats.decode_tokens += emitted
        if seq.spec is not None:
            for i in range(min(proposed, accepted + 1)):
                seq.spec.observe(i < accepted)


def _accept_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    target = logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return drafts[:a] + [target[a]], a


def _accept_sampled(probs: torch.Tensor, drafts: list[int], seq: Sequence) -> tuple[list[int], int]:
    """Rejection sampling for a point-mass proposal: keep x with probability p(x); on rejection draw from p
    without x. The uniforms and the draws come from the sequence's own generator when it is seeded."""
    uniforms = torch.rand(len(drafts), generator=seq.generator, device=probs.device).tolist() if drafts else []
    for a, (x, u) in enumerate(zip(drafts, uniforms)):
        if u >= probs[a, x].item():
            residual = probs[a:a + 1].clone()
            residual[0, x] = 0.0
            return drafts[:a] + [int(exponential_race(residual, [seq])[0])], a
    return drafts + [int(exponential_race(probs[-1:], [seq])[0])], len(drafts)
