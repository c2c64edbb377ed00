"""docs/benchmarks.md is generated from result files: goal status is computed, commands are carried over."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pagedchat.bench.memory import TraceParams, run_memory_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))  # the docs generator is a script
from bench_report import goals, load_results, render  # noqa: E402


def _stamped(result: dict, command: str) -> dict:
    return {**result, "command": command, "date": "2026-11-21", "machine": "test machine"}


def _throughput(speedup_generate: float, speedup_cb: float) -> dict:
    system = {"output_tok_per_s": 100.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "peak_memory_mib": 10.0}
    return _stamped({"model": "random llama (small)", "requests": 16, "max_tokens": 64, "prompt_tokens": [10, 20],
                     "kv_blocks": 99, "block_size": 16, "threads": 1, "repeats": 1,
                     "systems": {"pagedchat": system, "hf-generate": system, "hf-cb": system},
                     "speedup": {"hf-generate": speedup_generate, "hf-cb": speedup_cb},
                     "greedy_agreement": {"hf-generate": {"identical": 16, "of": 16},
                                          "hf-cb": {"identical": 15, "of": 16}}},
                    "pagedchat bench throughput --json")


def test_goal_status_is_computed_from_the_numbers(tmp_path):
    memory = run_memory_bench(TraceParams(requests=80, max_len=1024, mean_prompt=150, mean_output=100,
                                          pool_tokens=16384), sweep=False)
    (tmp_path / "memory.json").write_text(json.dumps(_stamped(memory, "pagedchat bench memory --json")))
    (tmp_path / "throughput-cpu-small.json").write_text(json.dumps(_throughput(2.0, 1.2)))
    res = load_results(tmp_path)
    status = {g.claim.split(" (")[0]: g.met for g in goals(res)}
    assert status["CPU throughput vs transformers padded `generate`, 16 mixed prompts"] is True
    assert status["CPU throughput vs transformers continuous batching, 16 mixed prompts"] is False
    assert status["KV utilization at block 16"] == (memory["kv_utilization"] >= 0.98)
    page = render(res)
    assert "pagedchat bench memory --json" in page and "pagedchat bench throughput --json" in page
    assert "**missed** (30% of the goal" in page          # 1.2x against 4x
    assert "GPU numbers are pending" in page
    assert f"{100 * memory['kv_utilization']:.1f}%" in page
