#!/usr/bin/env python3
"""One conversation, turn by turn, on the local engine and over `--server` (a `pagedchat serve` subprocess
on the same model and machine): per-turn wall time of each, the remote overhead (HTTP, SSE, JSON), and the
server's cached_tokens per turn in the first round (its prefix cache at work: turn N+1's prompt starts
with turn N's; later rounds also hit what earlier rounds left).

    python scripts/bench_remote.py [--model PATH] [--turns 6] [--tokens 32] [--rounds 3]

Local and remote turns alternate inside each round (same prompts, temperature 0, so the same tokens); the
medians over rounds are reported. Both sides run on this machine: the overhead includes the server's
process competing for the same cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "pagedchat" / "assets" / "demo-chat"
PROMPTS = ["What is 12 + 30?", "And what is that plus 10?", "What is the capital of France?",
           "Spell garden backwards.", "How many letters does it have?", "What is 7 * 8?", "Hello!", "Thanks."]


def start_server(model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "pagedchat.cli", "serve", "-m", str(model), "--port", "0", "--device", "cpu",
            "--threads", str(threads)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    assert line.startswith("pagedchat serve: http://"), line
    return proc, line.split()[2]


def controller(model: Path, store_dir: Path, tokens: int, server: str | None, threads: int):
    from pagedchat.chat.app import start
    from pagedchat.chat.store import SessionStore
    from pagedchat.settings import ModelOptions, SamplingOptions

    opts = ModelOptions(model=str(model), device="cpu", server=server)
    ctl, _ = start(opts, SamplingOptions(temperature=0, max_tokens=tokens), None, False, None,
                   show_progress=False, store=SessionStore(store_dir), overflow_default="stop")
    return ctl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    proc, url = start_server(args.model, args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local_s, remote_s, cached, same = [], [], [], True
            for r in range(args.rounds):
                local = controller(args.model, Path(tmp) / f"l{r}", args.tokens, None, args.threads)
                remote = controller(args.model, Path(tmp) / f"r{r}", args.tokens, url, args.threads)
                row_l, row_r, row_c = [], [], []
                for prompt in PROMPTS[:args.turns]:
                    for ctl, row in ((local, row_l), (remote, row_r)):
                        start = time.perf_counter()
                        result = ctl.send(prompt)
                        row.append(time.perf_counter() - start)
                    row_c.append((remote.last_stats["prompt_tokens"], remote.last_stats["remote"]["cached_tokens"]))
                    same &= result.replies[0].token_ids == local.session.head_node().token_ids
                local_s.append(row_l)
                remote_s.append(row_r)
                cached.append(row_c)
            turns = []
            for t in range(args.turns):
                loc = statistics.median(row[t] for row in local_s)
                rem = statistics.median(row[t] for row in remote_s)
                turns.append({"turn": t + 1, "local_s": round(loc, 4), "remote_s": round(rem, 4),
                              "overhead_s": round(rem - loc, 4), "prompt_tokens": cached[0][t][0],
                              "cached_tokens_first_round": cached[0][t][1]})
            print(json.dumps({"model": str(args.model), "tokens_per_turn": args.tokens, "rounds": args.rounds,
                              "threads": args.threads, "same_tokens": same, "turns": turns}, indent=1))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
