#!/usr/bin/env python3
"""What `--kv-dtype int8` buys in memory and costs in accuracy, against the model's own dtype, in one run (CPU).

Memory (real engines, the same --kv-memory): tokens the pool holds; 4k-token chats the budget fits (pool blocks
/ blocks of one 4k-token chat); and, on the demo model, chats at its full 512-token context actually held at
once (every one pinned in the pool, none evicted). fp8 allocates on CUDA only: its rows are the runner's
formula (engine/kv/caches.py kv_bytes_per_token), marked "computed".
Accuracy: greedy agreement over 256 tokens on the random Llama `small` (pagedchat/bench/int8_accuracy.py:
first divergence per prompt, whether it was a near-tie of the fp32 logits), at the benchmark sizes' init std
(0.1: peaked logits, but a deep random net that amplifies any perturbation, the worst case for a quantizer) and
at 0.02 (what trained checkpoints look like); the demo model's score on its
held-out questions (scripts/eval_demo_model.py's set and judge) and its perplexity on the reference answers of
those questions (teacher-forced through the pool, the answers scored).

    python scripts/kv_dtype_bench.py [--json out.json | --json -] [--threads 2]
"""

from __future__ import annotations

import argparse
import builtins
import functools
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_demo_model as E  # noqa: E402  (the demo model's held-out questions and their judge)

from pagedchat.bench.common import machine_description  # noqa: E402
from pagedchat.bench.int8_accuracy import measure  # noqa: E402
from pagedchat.bench.models import SIZES, build_random_model  # noqa: E402
from pagedchat.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pagedchat.engine.kv.caches import kv_bytes_per_token  # noqa: E402
from pagedchat.kernels.kv_quant import KV_DTYPES  # noqa: E402

DEMO = E.DEFAULT_MODEL
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


# -- accuracy ---------------------------------------------------------------------------------------------------
def small_agreement(tmp: Path, std: float, prompts: int, tokens: int) -> dict:
    path = build_random_model("llama", tmp / f"llama-small-{std}", "small", max_positions=1024, initializer_range=std)
    rng = random.Random(0)
    vocab = SIZES["small"]["vocab_size"]
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(prompts)]
    blocks = sum(-(-(len(p) + tokens) // 16) for p in batch)
    return {"init_std": std, **measure(str(path), batch, tokens, {"kv_dtype": "int8"}, num_blocks=blocks)}


def demo_eval(kv_dtype: str, items, tokenizer) -> dict:
    e = engine(DEMO, kv_dtype, kv_memory=BUDGET)
    stops = E.stop_ids(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=E.MAX_NEW_TOKENS, stop_token_ids=stops)
    outs = [E.strip_stop(list(r.outputs[0].token_ids), stops)
            for r in e.generate([ids for _, _, ids, _ in items], params)]
    right = [E.judge(expected, tokenizer.decode(ids, skip_special_tokens=True))
             for (_, _, _, expected), ids in zip(items, outs)]
    return {"kv_dtype": e.pool.kv_dtype, "right": sum(right), "questions": len(items), "replies": outs,
            "perplexity": answer_perplexity(e, items, tokenizer)}


def answer_perplexity(e: Engine, items, tokenizer) -> float:
    """exp(mean NLL) of each question's reference answer (and its end-of-turn token) after its prompt."""
    windows = []
    for _, msgs, ids, expected in items:
        full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": expected}], tokenize=True)
        full = full if isinstance(full, list) else full["input_ids"]
        assert full[:len(ids)] == ids, "the template renders the answer after the generation prompt"
        windows.append((full, len(ids)))
    outs = e.generate([w for w, _ in windows], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    nll = count = 0
    for out, (full, start) in zip(outs, windows):
        scored = out.prompt_logprobs[start - 1:]       # prompt_logprobs[i] scores token i + 1
        nll -= sum(s.logprob for s in scored)
        count += len(scored)
    return math.exp(nll / count)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="random-model prompts for greedy agreement")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--per-family", type=int, default=30, help="demo questions per family (the eval script's)")
    p.add_argument("--json", default=None, help="write the result as JSON to this file (-: to stdout, the report "
                                                "to stderr)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    result = {"command": " ".join(["python scripts/kv_dtype_bench.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "machine": machine_description(), "threads": args.threads,
              "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small = build_random_model("llama", tmp / "llama-small", "small", max_positions=4096)
        result["pool"] = pool_rows({"demo": DEMO, "llama small": small})
        result["demo_chats_held"] = [demo_chats_held(kv) for kv in ("auto", "int8")]
        result["small_greedy"] = [small_agreement(tmp, std, args.prompts, args.tokens)
                                  for std in (SIZES["small"]["initializer_range"], 0.02)]
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    items = E.build_prompts(tokenizer, args.per_family)
    evals = [demo_eval(kv, items, tokenizer) for kv in ("auto", "int8")]
    identical = sum(a == b for a, b in zip(evals[0].pop("replies"), evals[1].pop("replies")))
    result["demo_eval"] = {"runs": evals, "identical_replies": identical}
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
    print(f"{r['date']}  {r['machine']}  {r['threads']} threads  torch {r['torch']}\n")
    print(f"| model | KV dtype | bytes/token | tokens in {BUDGET} | 4k-token chats | vs auto |")
    print("|---|---|---|---|---|---|")
    for row in r["pool"]:
        print(f"| {row['model']} | {row['kv_dtype']} | {row['bytes_per_token']} | {row.get('pool_tokens', '')} | "
              f"{row.get('chats_4k', '')} | {row['vs_auto']:.2f}x |")
    print("\ndemo model, full-context chats pinned at once:")
    for row in r["demo_chats_held"]:
        print(f"  {row['kv_dtype']}: {row['resident']} of {row['offered']} {row['chat_tokens']}-token chats "
              f"resident in {row['budget']}")
    for g in r["small_greedy"]:
        print(f"\nllama small (init std {g['init_std']}), int8 KV vs fp32 KV, greedy over {g['prompts']} prompts: "
              f"{g['greedy_agreement']:.1%} of tokens before the first divergence, {g['identical_prompts']}/"
              f"{g['prompts']} identical, first divergences at {g['first_divergence']}, "
              f"{g['divergences_at_near_ties']} of them at a near-tie; max logit error {g['max_logit_error']:.4f} "
              f"({g['max_logit_error_rel_spread']:.2%} of the logits' spread)")
    d = r["demo_eval"]
    for run in d["runs"]:
        print(f"demo eval, KV {run['kv_dtype']}: {run['right']}/{run['questions']} right, answer perplexity "
              f"{run['perplexity']:.4f}")
    print(f"demo eval: {d['identical_replies']}/{d['runs'][0]['questions']} replies token-identical")


if __name__ == "__main__":
    sys.exit(main())
