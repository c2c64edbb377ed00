"""A/B of the host work of one engine step (bench/host_step.py) between a git revision (A) and the working tree
(B), in one process, taking turns, 1 torch thread: the parts that differ between the two are swapped in, the
sampler (engine/decoding/sampler.py), the step's input building (ModelRunner._prepare and _group_meta in
engine/core/runner.py) and the scheduler (engine/core/scheduler.py). Steps not overlapped (both sides can run
them). Prints medians and B/A ratios, and writes the JSON given by --out.

    python scripts/host_step_ab.py REV [--repeats 5] [--max-tokens 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile

import torch


def module_at(rev: str, path: str, name: str):
    """The module `path` as it was at `rev`, importable beside today's."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def host_parts(rev: str | None) -> dict:
    """What a side swaps in: the sampler class and the runner's input building, at `rev` (None: today's)."""
    from pagedchat.engine import engine as engine_module
    from pagedchat.engine.core.runner import ModelRunner

    if rev is None:
        return {"Sampler": engine_module.Sampler, "_prepare": ModelRunner._prepare,
                "_group_meta": ModelRunner._group_meta, "Scheduler": engine_module.Scheduler}
    runner = module_at(rev, "pagedchat/engine/core/runner.py", "runner_at_rev").ModelRunner
    return {"Sampler": module_at(rev, "pagedchat/engine/decoding/sampler.py", "sampler_at_rev").Sampler,
            "_prepare": runner._prepare, "_group_meta": runner._group_meta,
            "Scheduler": module_at(rev, "pagedchat/engine/core/scheduler.py", "scheduler_at_rev").Scheduler}


def use(parts: dict) -> None:
    from pagedchat.bench import host_step
    from pagedchat.engine import engine as engine_module

    engine_module.Sampler, engine_module.Scheduler = parts["Sampler"], parts["Scheduler"]
    host_step.HostRunner._prepare, host_step.HostRunner._group_meta = parts["_prepare"], parts["_group_meta"]


def main() -> None:
    from pagedchat.bench import host_step
    from pagedchat.bench.common import machine_description

    parser = argparse.ArgumentParser()
    parser.add_argument("rev")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sides = {"A": host_parts(args.rev), "B": host_parts(None)}
    rows = []
    for batch in (1, 256):
        for workload in host_step.WORKLOADS:
            times = {"A": [], "B": []}
            for r in range(args.repeats):
                for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    use(sides[side])
                    times[side].append(statistics.median(host_step.time_steps(batch, workload, args.max_tokens, r)))
            a, b = (1000 * statistics.median(times[s]) for s in ("A", "B"))
            rows.append({"batch": batch, "workload": workload, "before_ms": round(a, 4), "after_ms": round(b, 4),
                         "after_over_before": round(b / a, 3)})
            print(f"batch {batch:3d} {workload:8s} before {a:8.3f} ms  after {b:8.3f} ms  ratio {b / a:.2f}",
                  flush=True)
    use(sides["B"])
    result = {"bench": "host_step_ab", "before": args.rev, "after": "working tree", "repeats": args.repeats,
              "parts": "the sampler, the step's input building and the scheduler",
              "max_tokens": args.max_tokens, "vocab": host_step.VOCAB, "threads": 1,
              "clock": "thread CPU time per decode step, median over steps, then over repeats",
              "command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "machine": machine_description(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
