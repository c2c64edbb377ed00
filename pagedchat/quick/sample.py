"""Picking a token from one row of logits with numpy: the engine's sampler (engine/decoding/sampler.py) for one
unseeded or greedy sequence, in its order: repetition penalty (transformers'), temperature, top-k, top-p,
min-p, then a draw by the exponential race.

Greedy picks what the engine picks (the first of equal maxima, as torch's argmax). A random draw uses numpy's
generator, so the quick path never takes a seeded request: a seed promises the engine's tokens.
"""

from __future__ import annotations

import numpy as np

from pagedchat.engine.core.sampling_params import SamplingParams


def pick(logits: np.ndarray, params: SamplingParams, history: list[int], rng: np.random.Generator) -> int:
    """The next token of a sequence whose tokens so far are `history` (prompt and output); logits [vocab] fp32
    (changed in place by the penalty)."""
    if params.repetition_penalty != 1.0:
        _penalize(logits, history, params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(logits))
    scores = logits / np.float32(params.temperature)
    probs = _filtered_probs(scores, params.top_k, params.top_p, params.min_p)
    return int(np.argmax(probs / rng.exponential(size=probs.shape)))


def _penalize(logits: np.ndarray, history: list[int], penalty: float) -> None:
    ids = np.unique(np.asarray(history, dtype=np.int64))
    scores = logits[ids]
    logits[ids] = np.where(scores < 0, scores * np.float32(penalty), scores / np.float32(penalty))


def _filtered_probs(scores: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """softmax(scores) over what top-k, then top-p, then min-p keep (the best token always stays)."""
    order = np.argsort(-scores, kind="stable")
    ranked = scores[order].astype(np.float64)
    keep = len(ranked) if top_k <= 0 else min(top_k, len(ranked))
    probs = _softmax(ranked[:keep])
    if top_p < 1.0:
        before = np.cumsum(probs) - probs   # the mass strictly before each token
        keep = max(1, int(np.count_nonzero(before < top_p)))
        probs = _softmax(ranked[:keep])
    if min_p > 0.0:
        keep = max(1, int(np.count_nonzero(probs >= min_p * probs[0])))
        probs = _softmax(ranked[:keep])
    out = np.zeros(len(scores))
    out[order[:keep]] = probs[:keep]
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[0])   # x is sorted: x[0] is its maximum
    return e / e.sum()
