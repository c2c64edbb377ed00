"""`pagedchat run` with and without `--speculate ngram` on the demo model's multiplication questions, where the
reply rarely repeats what came before (drafts are seldom accepted): one process per run, the two modes taking
turns, decode tokens/s as `run --json` reports it. Prints the medians and the median of the paired ratios.

    python scripts/spec_run_ab.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

QUESTIONS = ["What is 94 * 39?", "What is 57 * 86?", "What is 23 * 71?", "What is 68 * 45?"]


def decode_rate(question: str, speculate: bool, threads: int) -> tuple[float, float | None]:
    cmd = ["pagedchat", "run", "--threads", str(threads), "--temperature", "0", "--max-tokens", "256", "--json"]
    if speculate:
        cmd += ["--speculate", "ngram"]
    result = json.loads(subprocess.run(cmd + [question], capture_output=True, text=True, check=True).stdout)
    return result["timing"]["decode_tokens_per_s"], (result.get("spec") or {}).get("acceptance_rate")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    off, on, accepted = [], [], []
    for rep in range(a.repeats):
        for question in QUESTIONS:
            for speculate in ((False, True) if rep % 2 == 0 else (True, False)):
                rate, acceptance = decode_rate(question, speculate, a.threads)
                (on if speculate else off).append(rate)
                if speculate:
                    accepted.append(acceptance)
    ratios = [s / p for s, p in zip(on, off)]
    print(f"decode tok/s: off {statistics.median(off):.0f}, ngram {statistics.median(on):.0f}; ngram / off "
          f"median of {len(ratios)} pairs {statistics.median(ratios):.3f} (min {min(ratios):.2f}); drafts accepted "
          f"{statistics.median(accepted):.0%}")


if __name__ == "__main__":
    main()
