"""The draft model's KV in the target's pool against a pool of its own (issue 13, fourth round), A/B in one
process: the same engine with the current DraftProposer (no allocator, the target's tables) and with the one
before it (its own BlockPool and block tables; its source read from git, `--before REF`).

    python scripts/bench_draft_pool.py [--model demo] [--draft demo] [--before 258b199] [--batches 1 16]
                                       [--tokens 64] [--repeats 5] [--k 4]

Both sides draft k tokens for every sequence at every step (the depth pinned, the measured budget off), so they
propose the same tokens and verify the same positions: what differs is only where the draft's KV lives. Each
repeat runs both sides in turn (alternating which goes first); decode tokens per CPU second of the process
(1 torch thread: every op runs on this thread, which a shared machine disturbs far less than the wall clock),
medians over repeats. Blocks: the peak of the one pool against the two pools' peaks added.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedchat.bench.models import resolve_model
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.decoding.speculative import Speculator


def old_proposer_class(ref: str):
    """The DraftProposer of commit `ref` (its own BlockPool), loaded from git as a module."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{ref}:pagedchat/engine/decoding/draft.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "draft_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("draft_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DraftProposer


def build_engine(model: Path, draft: Path, k: int, num_blocks: int, old_class=None) -> Engine:
    engine = Engine(EngineConfig(model=str(model), draft_model=str(draft), num_draft_tokens=k,
                                 num_blocks=num_blocks), show_progress=False)
    if old_class is not None:
        proposer = old_class(engine.draft, engine.config, engine.runner.num_blocks, engine.loaded.spec.vocab_size)
        engine.speculator = Speculator("draft", k, proposer, engine.max_model_len)
        engine.runner.block_sharers.clear()  # the current proposer's caches, unused on this side
    speculator = engine.speculator
    speculator.budget = None  # every step drafts k: both sides do the same work
    speculator._depth = lambda seq: min(k, seq.request.params.max_tokens - seq.num_output_tokens - 1)
    return engine


def run_once(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, list, int]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    proposer = engine.speculator.proposer
    own_pool = getattr(proposer, "pool", None)
    engine.pool.peak_used = 0
    if own_pool is not None:
        own_pool.peak_used = 0
    start = time.process_time()
    outs = engine.generate(prompts, params)
    seconds = time.process_time() - start
    peak = engine.pool.peak_used + (own_pool.peak_used if own_pool is not None else 0)
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return decoded / seconds, [o.outputs[0].token_ids for o in outs], peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default="demo")
    ap.add_argument("--before", default="258b199")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp())
    model, model_name = resolve_model(args.model, None, "small", workdir)
    draft, draft_name = resolve_model(args.draft, None, "small", workdir)
    sides = {"shared pool": build_engine(model, draft, args.k, args.num_blocks),
             "own pool (before)": build_engine(model, draft, args.k, args.num_blocks, old_proposer_class(args.before))}
    vocab = sides["shared pool"].loaded.spec.vocab_size
    rows = []
    for batch in args.batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(batch)]
        rates = {name: [] for name in sides}
        peaks, outputs = {}, {}
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                rate, tokens, peak = run_once(sides[name], prompts, args.tokens)
                rates[name].append(rate)
                peaks[name], outputs[name] = peak, tokens
        new, old = (statistics.median(rates[n]) for n in sides)
        rows.append({"batch": batch, "tok_per_cpu_s": {n: statistics.median(v) for n, v in rates.items()},
                     "runs": rates, "ratio_shared_over_own": new / old, "peak_blocks": peaks,
                     "identical_tokens": outputs["shared pool"] == outputs["own pool (before)"]})
    stats = sides["shared pool"].speculator.stats.as_dict()
    print(json.dumps({"model": model_name, "draft": draft_name, "k": args.k, "tokens": args.tokens,
                      "repeats": args.repeats, "before": args.before, "threads": torch.get_num_threads(),
                      "acceptance_rate": stats["acceptance_rate"], "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
