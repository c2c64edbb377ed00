#!/usr/bin/env python3
"""Decode throughput with a JSON schema vs without, in the same process, alternating runs, medians; and the
per-token mask cost of the two grammar libraries considered (llguidance, used; xgrammar, measured only).

    python scripts/bench_structured.py [--model PATH] [--batch 8] [--tokens 64] [--rounds 5]

Both modes decode the same number of tokens per sequence (ignore_eos; the schema is a long array, so the
grammar is still open at the end): tokens/s compare like with like.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "pagedchat" / "assets" / "demo-chat"
SCHEMA = {"type": "object", "properties": {"ids": {"type": "array", "minItems": 500, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "ok": {"type": "boolean"}}, "required": ["id", "ok"],
    "additionalProperties": False}}}, "required": ["ids"], "additionalProperties": False}


def decode_rate(engine, prompt, params, batch: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process). On a machine shared with other work
    the CPU-time rate is the steadier of the two: it does not count time spent waiting for a core."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate([prompt] * batch, params)
    tokens = sum(len(v.token_ids) for o in outs for v in o.outputs)
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def engine_ratio(args) -> dict:
    from pagedchat.engine import Engine, EngineConfig, SamplingParams
    from pagedchat.engine.core.grammar import GrammarSpec

    engine = Engine(EngineConfig(model=str(args.model), device="cpu"), show_progress=False)
    prompt = engine.encode("Give me the list as JSON.")
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = plain.with_(grammar=GrammarSpec.json_schema(SCHEMA))
    decode_rate(engine, prompt, constrained, args.batch)   # warm-up (first mask, allocator)
    grammar_s = _time_masks(engine.grammars())
    runs = {"plain": [], "schema": []}
    schema_wall = 0.0
    for _ in range(args.rounds):
        runs["plain"].append(decode_rate(engine, prompt, plain, args.batch))
        start = time.perf_counter()
        runs["schema"].append(decode_rate(engine, prompt, constrained, args.batch))
        schema_wall += time.perf_counter() - start
    wall = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
    return {"tokens_per_wall_s": wall, "wall_ratio": wall["schema"] / wall["plain"],
            "tokens_per_cpu_s": cpu, "cpu_ratio": cpu["schema"] / cpu["plain"],
            # the grammar's own share of the constrained runs (mask computation and application, measured
            # inside them): robust to load swings between runs, which hit both parts alike
            "grammar_share": grammar_s[0] / schema_wall, "ratio_from_share": 1 - grammar_s[0] / schema_wall,
            "runs": runs}


def _time_masks(grammars) -> list[float]:
    """Wrap grammars.mask so the seconds spent in it add up in the returned one-item list."""
    spent, mask = [0.0], grammars.mask

    def timed(logits, matchers):
        start = time.perf_counter()
        try:
            return mask(logits, matchers)
        finally:
            spent[0] += time.perf_counter() - start

    grammars.mask = timed
    return spent


def mask_cost(args) -> dict:
    """Microseconds per token to compute one mask (+ apply it), random walk through the schema."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = len(tokenizer)
    out = {"vocab": vocab}
    import llguidance
    import llguidance.hf

    from pagedchat.engine.core.grammar import Grammars, GrammarSpec

    grammars = Grammars(tokenizer, vocab, {tokenizer.eos_token_id})
    matcher = grammars.matcher(GrammarSpec.json_schema(SCHEMA))
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.tokens * 4):
        logits = torch.randn((1, vocab), generator=gen)
        t = time.perf_counter()
        masked = grammars.mask(logits, [matcher])
        times.append(time.perf_counter() - t)
        assert matcher.consume_token(int(masked.argmax()))
    out["llguidance_us"] = statistics.median(times) * 1e6
    del llguidance
    try:
        import xgrammar as xgr
    except ImportError:
        return out
    t = time.perf_counter()
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)) \
        .compile_json_schema(json.dumps(SCHEMA))
    out["xgrammar_compile_ms"] = (time.perf_counter() - t) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.tokens * 4):
        logits = torch.randn((1, vocab), generator=gen)
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        times.append(time.perf_counter() - t)
        assert matcher.accept_token(int(logits.argmax()))
    out["xgrammar_us"] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps({"threads": torch.get_num_threads(), "batch": args.batch, "tokens": args.tokens,
                      "engine": engine_ratio(args), "mask": mask_cost(args)}, indent=1))


if __name__ == "__main__":
    main()
