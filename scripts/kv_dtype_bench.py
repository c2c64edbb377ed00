#!/usr/bin/env python3
"""What `--kv-dtype int8` buys in memory against the model's own dtype, in one run (CPU): real engines at the
same --kv-memory. Tokens the pool holds; 4k-token chats the budget fits (pool blocks / blocks of one 4k-token
chat); and, on the demo model, chats at its full 512-token context actually held at once (every one pinned in
the pool, none evicted). fp8 allocates on CUDA only: its rows are the runner's formula (engine/kv/caches.py
kv_bytes_per_token), marked "computed". What a quantized pool costs in accuracy is measured beside the other
quantized modes by `pagedchat bench accuracy --modes fp,kv-int8,...`.

    python scripts/kv_dtype_bench.py [--json out.json | --json -]
"""

from __future__ import annotations

import argparse
import builtins
import functools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedchat.bench.common import machine_description
from pagedchat.bench.models import build_random_model
from pagedchat.demo.evaluate import DEFAULT_MODEL as DEMO
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.kv.caches import kv_bytes_per_token
from pagedchat.kernels.kv_quant import KV_DTYPES

BUDGET = "256MiB"
CHAT_TOKENS = 4096


def engine(path, kv_dtype: str, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", kv_dtype=kv_dtype, **kw), show_progress=False)


# -- memory -----------------------------------------------------------------------------------------------------
def pool_rows(models: dict[str, Path]) -> list[dict]:
    rows = []
    for name, path in models.items():
        held = {}
        for kv in ("auto", "int8"):
            e = engine(path, kv, kv_memory=BUDGET)
            held[kv] = e.capacity_tokens
            rows.append({"model": name, "kv_dtype": e.pool.kv_dtype, "bytes_per_token": e.runner.bytes_per_block // 16,
                         "pool_tokens": e.capacity_tokens, "chats_4k": e.runner.num_blocks // (CHAT_TOKENS // 16),
                         "vs_auto": e.capacity_tokens / held["auto"]})
        spec = e.loaded.spec
        bf16, fp8 = (kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, dt)
                     for dt in (torch.bfloat16, KV_DTYPES["fp8"]))
        rows.append({"model": name, "kv_dtype": "fp8 vs bfloat16 (computed)", "bytes_per_token": fp8,
                     "vs_auto": bf16 / fp8})
    return rows


def demo_chats_held(kv_dtype: str, budget: str = "32MiB") -> dict:
    """As many full-context chats as the pool offers, all pinned: how many stay resident together."""
    e = engine(DEMO, kv_dtype, kv_memory=budget)
    length = e.max_model_len - 16
    rng = random.Random(0)
    offered = e.runner.num_blocks // (e.max_model_len // 16) + 4
    prompts = [[rng.randrange(3, 800) for _ in range(length)] for _ in range(offered)]
    outs = e.generate(prompts, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True), keep=True)
    resident = sum(o.outputs[0].handle is not None and o.outputs[0].handle.is_pinned for o in outs)
    return {"kv_dtype": e.pool.kv_dtype, "budget": budget, "chat_tokens": e.max_model_len, "offered": offered,
            "resident": resident}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the result as JSON to this file (-: to stdout, the report "
                                                "to stderr)")
    args = p.parse_args()
    result = {"command": " ".join(["python scripts/kv_dtype_bench.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "machine": machine_description(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        small = build_random_model("llama", Path(tmp) / "llama-small", "small", max_positions=4096)
        result["pool"] = pool_rows({"demo": DEMO, "llama small": small})
        result["demo_chats_held"] = [demo_chats_held(kv) for kv in ("auto", "int8")]
    if args.json == "-":
        report(result, sys.stderr)
        print(json.dumps(result, indent=1))
        return 0
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def report(r: dict, out=sys.stdout) -> None:
    print = functools.partial(builtins.print, file=out)  # noqa: A001  (the report goes where it is asked)
    print(f"{r['date']}  {r['machine']}  torch {r['torch']}\n")
    print(f"| model | KV dtype | bytes/token | tokens in {BUDGET} | 4k-token chats | vs auto |")
    print("|---|---|---|---|---|---|")
    for row in r["pool"]:
        print(f"| {row['model']} | {row['kv_dtype']} | {row['bytes_per_token']} | {row.get('pool_tokens', '')} | "
              f"{row.get('chats_4k', '')} | {row['vs_auto']:.2f}x |")
    print("\ndemo model, full-context chats pinned at once:")
    for row in r["demo_chats_held"]:
        print(f"  {row['kv_dtype']}: {row['resident']} of {row['offered']} {row['chat_tokens']}-token chats "
              f"resident in {row['budget']}")


if __name__ == "__main__":
    sys.exit(main())
