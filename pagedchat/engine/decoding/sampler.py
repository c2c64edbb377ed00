"""Turn logits into tokens: repetition penalty, temperature, top-k, top-p, min-p (transformers' order).

Every seeded sequence draws from its own generator, so its tokens do not depend on which other requests
share the batch. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which equals
drawing from p and needs one random vector per row.
"""

from __future__ import annotations

import torch

from pagedchat.engine.core.sequence import Sequence

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


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self.pick(self.scores(logits, seqs), seqs)

    def scores(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The model's scores as the request sees them: fp32, repetition penalty applied (log-probabilities
        are taken from these, before temperature and truncation)."""
        assert logits.shape[0] == len(seqs)
        logits = logits.float()
        if any(s.request.params.repetition_penalty != 1.0 for s in seqs):
            logits = logits.clone()  # the runner's logits are inference tensors: no in-place update on them
            apply_repetition_penalty(logits, seqs)
        return logits

    def pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Greedy rows take the argmax; the others sample after temperature, top-k, top-p and min-p."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        return exponential_race(self.probabilities(logits, seqs), seqs)

    @staticmethod
    def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k / top-p / min-p."""
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
    dev = probs.device
    noise = torch.empty_like(probs)
    unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=dev).exponential_()
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[i].exponential_(generator=seq.generator)
    return (probs / noise).argmax(dim=-1)
