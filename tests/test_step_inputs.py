"""The step's index arrays built with numpy against the per-position Python they replace: uneven tables (and a
window group's released -1 entries), mixed decode rows, prefill chunks and drafted tokens."""

from __future__ import annotations

import random

import numpy as np

from pagedchat.engine.core.step_inputs import padded_tables, token_positions, token_slots


def test_index_arrays_equal_the_per_position_loop():
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        seqs = []
        for _ in range(rng.randint(1, 9)):
            count = rng.choice([1, 1, rng.randint(1, 40)])
            start = rng.randint(0, 60)
            blocks = -(-(start + count) // bs)
            table = [rng.choice([-1, rng.randrange(500)]) if i < start // bs else rng.randrange(500)
                     for i in range(blocks)]
            seqs.append((start, count, table))
        start = np.array([s for s, _, _ in seqs], dtype=np.int64)
        count = np.array([c for _, c, _ in seqs], dtype=np.int64)
        rows = np.repeat(np.arange(len(seqs)), count)
        tables = padded_tables([t for _, _, t in seqs])
        positions = token_positions(start, count, rows)
        width = max(len(t) for _, _, t in seqs)
        assert tables.dtype == np.int32 and tables.tolist() == [t + [0] * (width - len(t)) for _, _, t in seqs]
        assert positions.tolist() == [p for s, c, _ in seqs for p in range(s, s + c)]
        assert token_slots(tables, rows, positions, bs).tolist() == \
            [t[p // bs] * bs + p % bs for s, c, t in seqs for p in range(s, s + c)]
