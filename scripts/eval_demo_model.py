#!/usr/bin/env python3
"""Evaluate the demo chat model on held-out prompts of every task family.

The prompts come from pagedchat.demo.corpus.eval_set(): arithmetic on operand pairs that were held out
of training (in the phrasings users type), held-out words for spelling and counting, new capital
phrasings, small talk, and two-turn follow-ups. Each prompt is answered greedily by transformers
and/or by pagedchat's engine (all prompts submitted together, so batching is exercised); the script
prints per-family accuracy for each and whether the two produced the same tokens.

    python scripts/eval_demo_model.py --engine both
    python scripts/eval_demo_model.py --engine both --words   # all held-out words x all phrasings
"""
from __future__ import annotations

import argparse
import sys
import time

from pagedchat.demo.evaluate import DEFAULT_MODEL, MAX_NEW_TOKENS, build_prompts, judge, score, stop_ids, strip_stop


def run_transformers(model_dir, items, tokenizer, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    stops = stop_ids(tokenizer)
    outs = []
    with torch.no_grad():
        for _, _, ids, _ in items:
            # One prompt at a time: no padding, so the result is the reference greedy answer.
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=MAX_NEW_TOKENS, eos_token_id=stops, pad_token_id=stops[1])
            outs.append(strip_stop(y[0, len(ids):].tolist(), stops))
    return outs


def run_pagedchat(model_dir, items, tokenizer, dtype, device):
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    stops = stop_ids(tokenizer)
    eng = Engine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, kv_memory="256MiB"))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=stops)
    results = eng.generate([ids for _, _, ids, _ in items], params)
    return [strip_stop(list(r.outputs[0].token_ids), stops) for r in results]


def report(name, items, outs, tokenizer, show_errors):
    per = score(items, outs, tokenizer)
    if show_errors:
        for (family, msgs, _, expected), ids in zip(items, outs):
            got = tokenizer.decode(ids, skip_special_tokens=True)
            if not judge(expected, got):
                print(f"  [{name}] {family}: {msgs[-1]['content']!r}\n      expected {expected!r}\n      got      {got!r}")
    total = [v for vals in per.values() for v in vals]
    print(f"{name}: " + "  ".join(f"{f} {sum(v) / len(v):.0%} ({sum(v)}/{len(v)})" for f, v in per.items())
          + f"  | all {sum(total) / len(total):.1%}")
    return {f: sum(v) / len(v) for f, v in per.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--engine", choices=["transformers", "pagedchat", "both"], default="both")
    p.add_argument("--per-family", type=int, default=30, help="prompts per phrasing/family")
    p.add_argument("--dtype", default="float32", help="weights are stored in float16; compute dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--show-errors", action="store_true")
    p.add_argument("--words", action="store_true",
                   help="instead: every held-out word in every spelling/counting phrasing")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    items = build_prompts(tokenizer, args.per_family, args.words)
    print(f"{len(items)} held-out prompts from {args.model}")

    outs = {}
    if args.engine in ("transformers", "both"):
        t = time.time()
        outs["transformers"] = run_transformers(args.model, items, tokenizer, args.dtype)
        print(f"transformers greedy: {time.time() - t:.0f}s")
        report("transformers", items, outs["transformers"], tokenizer, args.show_errors)
    if args.engine in ("pagedchat", "both"):
        t = time.time()
        outs["pagedchat"] = run_pagedchat(args.model, items, tokenizer, args.dtype, args.device)
        print(f"pagedchat batched greedy: {time.time() - t:.0f}s")
        report("pagedchat", items, outs["pagedchat"], tokenizer, args.show_errors)
    if len(outs) == 2:
        same = [a == b for a, b in zip(outs["transformers"], outs["pagedchat"])]
        print(f"agreement (identical greedy tokens): {sum(same)}/{len(same)}")
        for (family, msgs, _, _), a, b, s in zip(items, outs["transformers"], outs["pagedchat"], same):
            if not s:
                print(f"  differs [{family}] {msgs[-1]['content']!r}: transformers "
                      f"{tokenizer.decode(a)!r} vs pagedchat {tokenizer.decode(b)!r}")
        return 0 if all(same) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
