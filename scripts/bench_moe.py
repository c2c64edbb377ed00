"""MoE decode vs a dense model with the same active parameters, same run (issue 19's CPU goal: <= 1.5x).

Both are random HF checkpoints built here with transformers' config classes: a Mixtral (E experts, top-k,
expert size I) and a Llama whose MLP has k * I intermediate units, with identical attention, hidden size,
layers and vocabulary, so each decoded token touches the same number of weights. Each round decodes the
same prompts with pagedchat on both models (alternating which goes first); medians over rounds.

    python scripts/bench_moe.py [--rounds 5] [--threads 2] [--batch 1] [--tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

COMMON = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)


def build(root: Path, experts: int, top_k: int, expert_size: int) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    configs = {"moe": MixtralConfig(**COMMON, intermediate_size=expert_size, num_local_experts=experts,
                                    num_experts_per_tok=top_k),
               "dense": LlamaConfig(**COMMON, intermediate_size=top_k * expert_size)}
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        paths[name] = root / name
    return paths


def decode_rate(engine, batch: int, tokens: int) -> float:
    from pagedchat.engine import SamplingParams

    prompts = [[(7 * i + j) % 4000 + 1 for j in range(32)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, params.with_(max_tokens=2))          # warm-up
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first = None
    while any(not engine.requests[i].finished for i in ids):
        engine.step()
        first = first or time.perf_counter()
    for i in ids:
        engine.pop_output(i)
    return batch * (tokens - 1) / (time.perf_counter() - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from pagedchat.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp), a.experts, a.top_k, a.expert_size)
        engines = {n: Engine(EngineConfig(model=str(p), device="cpu", num_blocks=512), show_progress=False)
                   for n, p in paths.items()}
        rates = {n: [] for n in engines}
        for r in range(a.rounds):
            for name in (["moe", "dense"] if r % 2 == 0 else ["dense", "moe"]):
                rates[name].append(decode_rate(engines[name], a.batch, a.tokens))
    med = {n: statistics.median(v) for n, v in rates.items()}
    result = {"moe_tokens_per_s": med["moe"], "dense_tokens_per_s": med["dense"],
              "dense_over_moe_time_ratio": med["dense"] / med["moe"], "rounds": a.rounds, "threads": a.threads,
              "batch": a.batch, "tokens": a.tokens, "experts": a.experts, "top_k": a.top_k,
              "expert_size": a.expert_size, "all_rates": rates}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"MoE {med['moe']:.1f} tok/s, dense (same active params) {med['dense']:.1f} tok/s: MoE decode takes "
              f"{result['dense_over_moe_time_ratio']:.2f}x the dense model's time per token")


if __name__ == "__main__":
    main()
