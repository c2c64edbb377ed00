"""`pagedchat bench accuracy`: a quantized model against the unquantized one on the same prompts (the numbers
come from bench/int8_accuracy.py `measure`): greedy tokens agreeing up to each prompt's first divergence, how
many divergences fell at a near-tie, and the largest teacher-forced logit error, in logits and relative to the
unquantized logits' spread.

With -m: that model on chat questions through its template. Without: random models of the four Llama-family
architectures (nothing is downloaded) on random token prompts. Random weights are the worst case for a
quantizer: their logits are nearly flat, so greedy decoding meets near-ties; `--init-std 0.02` is what trained
checkpoints look like, the `small` size's own 0.1 makes the network chaotic.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from pagedchat.bench.common import print_table
from pagedchat.bench.int8_accuracy import measure
from pagedchat.bench.models import ARCHS, SIZES, build_random_model

QUESTIONS = ["What is 17 + 25?", "Tell me a short story about a cat.", "Hello! Who are you?",
             "Name three colours.", "What is the capital of France?", "Count from one to five.",
             "Why is the sky blue?", "Write a haiku about rain."]


def run_accuracy_bench(model: str | None, size: str, init_std: float | None, prompts: int, tokens: int) -> dict:
    rows = []
    if model is not None:
        from pagedchat.registry import Registry

        entry = Registry().resolve(model)
        rows.append({"model": entry.name, **measure(str(entry.path), _chat_prompts(entry.path, prompts), tokens)})
    else:
        overrides = {} if init_std is None else {"initializer_range": init_std}
        std = overrides.get("initializer_range", SIZES[size]["initializer_range"])
        with tempfile.TemporaryDirectory(prefix="pagedchat-bench-model-") as tmp:
            for arch in ARCHS:
                path = build_random_model(arch, Path(tmp) / arch, size, max_positions=1024, **overrides)
                rows.append({"model": f"{arch} {size}, init std {std:g}",
                             **measure(str(path), _random_prompts(size, prompts), tokens)})
    return {"quantize": "int8", "baseline": "the same model unquantized", "prompts": prompts, "tokens": tokens,
            "rows": rows}


def print_accuracy_report(result: dict) -> None:
    print_table(f"--quantize {result['quantize']} against {result['baseline']}: {result['prompts']} prompts x "
                f"{result['tokens']} greedy tokens",
                ["model", "greedy tokens agreeing", "prompts identical", "divergences at a near-tie",
                 "max logit error", "/ logit spread"],
                [[r["model"], f"{r['greedy_agreement']:.1%}", f"{r['identical_prompts']}/{r['prompts']}",
                  f"{r['divergences_at_near_ties']}/{r['prompts'] - r['identical_prompts']}",
                  f"{r['max_logit_error']:.4f}", f"{r['max_logit_error_rel_spread']:.2%}"] for r in result["rows"]])


def _chat_prompts(path: Path, count: int) -> list[list[int]]:
    from pagedchat.model.loader import load_tokenizer

    tok = load_tokenizer(Path(path), False, None)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            for q in (QUESTIONS * count)[:count]]


def _random_prompts(size: str, count: int) -> list[list[int]]:
    rng, vocab = random.Random(0), SIZES[size]["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(count)]
