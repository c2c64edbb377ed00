"""Batch-1 decode beside a busy neighbour: pagedchat's decode tok/s alone, then with one CPU-burning process
running beside it, for each OpenMP wait policy (the default PASSIVE that the CLI sets, and ACTIVE, OpenMP's
spinning default before it). Runs alternate; medians count.

    python scripts/busy_neighbour.py [--threads N] [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import json, sys, time
from pagedchat import threads
threads.apply_threads(int(sys.argv[2]))
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.native import build
build.load(wait=True)  # time the native decode step, not the torch path a first build would leave meanwhile
engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", num_blocks=256), show_progress=False)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
engine.generate([list(range(5, 21))], params.with_(max_tokens=4))
rid = engine.add_request(list(range(5, 69)), params)
engine.step()
start = time.perf_counter()
while engine.has_unfinished():
    engine.step()
print(json.dumps(63 / (time.perf_counter() - start)))
"""


def _burn(stop) -> None:
    while not stop.is_set():
        pass


def decode_rate(model: str, threads: int, policy: str) -> float:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-c", WORKER, model, str(threads)], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="HF folder (default: a random llama `small`)")
    args = parser.parse_args()
    from pagedchat.threads import resolve_threads

    threads = resolve_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from pagedchat.bench.models import build_random_model

            model = str(build_random_model("llama", Path(tmp) / "llama", "small", max_positions=1024))
        runs = {(p, busy): [] for p in ("PASSIVE", "ACTIVE") for busy in (False, True)}
        for _ in range(args.repeats):
            for policy, busy in runs:
                stop = multiprocessing.Event()
                burner = multiprocessing.Process(target=_burn, args=(stop,)) if busy else None
                if burner:
                    burner.start()
                try:
                    runs[(policy, busy)].append(decode_rate(model, threads, policy))
                finally:
                    if burner:
                        stop.set()
                        burner.join()
    print(f"| OMP_WAIT_POLICY | quiet tok/s | beside a busy process tok/s | kept ({threads} threads) |")
    print("|---|---|---|---|")
    for policy in ("PASSIVE", "ACTIVE"):
        quiet, busy = statistics.median(runs[(policy, False)]), statistics.median(runs[(policy, True)])
        print(f"| {policy} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.0%} |")


if __name__ == "__main__":
    main()
