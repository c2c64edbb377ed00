"""`pagedchat bench memory --beams W`: the beam figures in --json, and what they must show: the prompt held
once (peak close to one sequence's), a contiguous cache W times over, at most W block copies a step."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pagedchat.bench.beams import measure_beam_memory
from pagedchat.cli import app


def test_bench_memory_beams_json():
    result = CliRunner().invoke(app, ["bench", "memory", "--json", "--beams", "4", "--requests", "20",
                                      "--max-len", "512", "--pool-tokens", "8192", "--no-sweep"])
    assert result.exit_code == 0, result.output
    beams = json.loads(result.stdout)["beams"]
    assert beams["width"] == 4 and [r["prompt_tokens"] for r in beams["runs"]] == [1024, 2048]
    for run in beams["runs"]:
        assert run["one_sequence_peak_blocks"] <= run["peak_blocks"] <= 1.3 * run["one_sequence_peak_blocks"]
        assert run["contiguous_peak_ratio_vs_one"] == 4.0
        assert run["max_copies_per_step"] <= 4
        # one sample per step while the search runs: the prefill step and the next 62 (the 64th ends it)
        assert len(run["blocks_over_time"]) == beams["new_tokens"] - 1


def test_beam_memory_counts_the_prompt_once_and_the_tails_per_beam():
    r = measure_beam_memory(prompt_len=256, width=8, new_tokens=32, block_size=16)
    assert r["one_sequence_peak_blocks"] == (256 + 32) // 16
    # the prompt's 16 blocks once, then at most 8 divergent tails of 32 tokens (3 blocks each, the partial one
    # included): never 8 copies of the whole history
    assert r["peak_blocks"] <= 16 + 8 * 3
    assert r["contiguous_peak_blocks"] == 8 * 18
