"""Accuracy of `--quantize int8` against fp32 on the four architectures: greedy agreement and the largest
logit error over the same prompts (random `small` benchmark models, so nothing is downloaded).

    python scripts/int8_accuracy.py [--size small] [--prompts 8] [--tokens 32]

Greedy agreement: generated tokens equal to the fp32 engine's, up to the first divergence of each prompt
(after one differing token the continuations differ by construction). Max logit error: teacher-forced on the
fp32 tokens, the largest |int8 - fp32| logit over every position, and the same relative to the logits' spread.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from pagedchat.bench.models import ARCHS, build_random_model
from pagedchat.engine import Engine, EngineConfig, SamplingParams


def _logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Every position's logits for `ids` in one prefill (teacher forcing)."""
    from pagedchat.model.attention import AttentionMetadata

    runner = engine.runner
    n, bs = len(ids), runner.block_size
    blocks = -(-n // bs)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), is_decode=False, max_seq_len=n)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(n), meta)
        return runner.model.compute_logits(hidden)


def measure(path: Path, prompts: list[list[int]], tokens: int) -> dict:
    engines = {q: Engine(EngineConfig(model=str(path), device="cpu", num_blocks=128, quantize=q), show_progress=False)
               for q in (None, "int8")}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = {q: [o.outputs[0].token_ids for o in e.generate(prompts, params)] for q, e in engines.items()}
    agree = total = 0
    max_err = rel_err = 0.0
    for prompt, ref, got in zip(prompts, outs[None], outs["int8"]):
        same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        agree, total = agree + same, total + len(ref)
        full = prompt + ref
        fp, q8 = _logits(engines[None], full), _logits(engines["int8"], full)
        err = (q8 - fp).abs().max().item()
        max_err, rel_err = max(max_err, err), max(rel_err, err / (fp.max() - fp.min()).item())
    return {"greedy_agreement": agree / total, "identical_prompts": sum(a == b for a, b in zip(outs[None], outs["int8"])),
            "prompts": len(prompts), "max_logit_error": max_err, "max_logit_error_rel_range": rel_err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| architecture | greedy tokens agreeing | prompts identical | max logit error | / logit range |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = build_random_model(arch, Path(tmp) / arch, args.size, max_positions=1024)
            vocab = 320 if args.size == "tiny" else 8192
            rng = random.Random(0)
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(args.prompts)]
            r = measure(path, prompts, args.tokens)
            print(f"| {arch} | {r['greedy_agreement']:.1%} | {r['identical_prompts']}/{r['prompts']} | "
                  f"{r['max_logit_error']:.4f} | {r['max_logit_error_rel_range']:.2%} |")


if __name__ == "__main__":
    main()
