"""Accuracy of `--quantize int8` against fp32 (pagedchat/bench/int8_accuracy.py): greedy agreement and the
largest logit error, on random models of the four architectures (nothing is downloaded) and on a real folder.

    python scripts/int8_accuracy.py [--size small] [--init-std 0.02] [--prompts 8] [--tokens 32]
    python scripts/int8_accuracy.py --model demo     # a models.toml name or folder: chat prompts, its template

--init-std sets the random models' initializer_range: the benchmark sizes use a large one (0.1-0.3) so greedy
decoding meets no near-ties, which is the worst case for a quantizer; trained checkpoints look more like 0.02.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from pagedchat.bench.int8_accuracy import measure
from pagedchat.bench.models import ARCHS, SIZES, build_random_model

QUESTIONS = ["What is 17 + 25?", "Tell me a short story about a cat.", "Hello! Who are you?",
             "Name three colours.", "What is the capital of France?", "Count from one to five.",
             "Why is the sky blue?", "Write a haiku about rain."]


def _row(name: str, r: dict) -> str:
    diverged = r["prompts"] - r["identical_prompts"]
    return (f"| {name} | {r['greedy_agreement']:.1%} | {r['identical_prompts']}/{r['prompts']} | "
            f"{r['divergences_at_near_ties']}/{diverged} | {r['max_logit_error']:.4f} | "
            f"{r['max_logit_error_rel_spread']:.2%} |")


def _chat_prompts(path: str, count: int) -> list[list[int]]:
    from pagedchat.model.loader import load_tokenizer

    tok = load_tokenizer(Path(path), False, None)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            for q in (QUESTIONS * count)[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--init-std", type=float, default=None, help="initializer_range (default: the size's)")
    parser.add_argument("--model", default=None, help="a models.toml name or HF folder instead of random models")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | greedy tokens agreeing | prompts identical | divergences at a near-tie | max logit error "
          "| / logit spread |")
    print("|---|---|---|---|---|---|")
    if args.model:
        from pagedchat.registry import Registry

        entry = Registry().resolve(args.model)
        print(_row(entry.name, measure(str(entry.path), _chat_prompts(str(entry.path), args.prompts), args.tokens)))
        return
    overrides = {} if args.init_std is None else {"initializer_range": args.init_std}
    std = overrides.get("initializer_range", SIZES[args.size]["initializer_range"])
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = build_random_model(arch, Path(tmp) / arch, args.size, max_positions=1024, **overrides)
            rng = random.Random(0)
            vocab = SIZES[args.size]["vocab_size"]
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(args.prompts)]
            print(_row(f"{arch} {args.size}, init std {std}", measure(str(path), prompts, args.tokens)))


if __name__ == "__main__":
    main()
