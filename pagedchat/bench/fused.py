"""The fused layer kernels against the unfused ops, in one run on one device: batch-1 decode with CUDA graphs
on and off, time to first token at a long prompt, and many requests at once (the GPU goals' three figures).

Each configuration gets its own engine (one alive at a time, a fixed pool size), built over the same model
folder, and runs the same prompts; the order is unfused then fused for each graphs setting, so the two sides
of every comparison run back to back. Greedy, EOS ignored. Decode tokens/s counts the tokens after the first
(the first comes from the prefill) over the time from the first token to the last.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import torch

from pagedchat.bench.common import lognormal_lengths


def _engine(path, device: str, fused: bool, graphs: bool, kv_memory: str):
    from pagedchat.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(path), device=device, fused_kernels=fused, cuda_graphs=graphs,
                               kv_memory=kv_memory, enable_prefix_cache=False), show_progress=False)


def _decode_rate(engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    from pagedchat.engine import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    first = None
    for events in engine.steps([rid]):
        if first is None and events:
            first = time.perf_counter()
    last = time.perf_counter()
    tokens = engine.pop_output(rid).outputs[0].token_ids
    return (len(tokens) - 1) / (last - first), tokens


def _ttft(engine, prompt: list[int]) -> float:
    from pagedchat.engine import SamplingParams

    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def _throughput(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from pagedchat.engine import SamplingParams

    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share (bf16 rounding may tip a near-tie, after which they differ)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_fused_bench(path, name: str, device: str = "cuda", prompt_tokens: int = 512, new_tokens: int = 256,
                    ttft_tokens: int = 2048, requests: int = 256, request_tokens: int = 128, repeats: int = 3,
                    kv_memory: str = "16GiB", seed: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = _vocab(path)
    decode_prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    ttft_prompts = [[rng.randrange(3, vocab) for _ in range(ttft_tokens)] for _ in range(repeats + 1)]
    lengths = lognormal_lengths(rng, requests, 128, 0.8, 15, 512)
    many = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    rows, tokens = [], {}
    for graphs in (True, False):
        for fused in (False, True):
            engine = _engine(path, device, fused, graphs, kv_memory)
            _decode_rate(engine, decode_prompt, 8)   # warm-up: compiles, autotunes, fills allocator pools
            rates = []
            for _ in range(repeats):
                rate, tokens[fused, graphs] = _decode_rate(engine, decode_prompt, new_tokens)
                rates.append(rate)
            row = {"fused": fused, "cuda_graphs": graphs, "batch1_decode_tok_s": statistics.median(rates),
                   "batch1_runs_tok_s": rates}
            if graphs:  # TTFT and the many-request run are prefill- and batch-bound: with graphs on only
                _ttft(engine, ttft_prompts[0])
                row["ttft_s"] = statistics.median(_ttft(engine, p) for p in ttft_prompts[1:])
                row["many_tok_s"] = _throughput(engine, many, request_tokens)
                row["graph_memory_bytes"] = getattr(engine.runner.graphs, "memory_bytes", 0)
            rows.append(row)
            del engine    # one engine at a time: its pool and graphs go before the next is built
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return {"bench": "fused", "model": name, "device": device, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "ttft_tokens": ttft_tokens, "requests": requests,
            "request_tokens": request_tokens, "repeats": repeats, "rows": rows,
            "greedy_agreement": {f"graphs_{g}": _agreement(tokens[False, g], tokens[True, g]) for g in (True, False)}}


def _vocab(path) -> int:
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def print_fused_report(result: dict) -> None:
    from pagedchat.bench.common import fmt, print_table

    def value(row, key, scale=1.0):
        return fmt(row[key] * scale) if key in row else "-"

    print_table(f"Fused layer kernels vs unfused ops ({result['model']}, {result['device']})",
                ["kernels", "CUDA graphs", "batch-1 decode tok/s", f"TTFT {result['ttft_tokens']} ms",
                 f"{result['requests']} x {result['request_tokens']} tok/s"],
                [["fused" if r["fused"] else "unfused", "on" if r["cuda_graphs"] else "off",
                  value(r, "batch1_decode_tok_s"), value(r, "ttft_s", 1000), value(r, "many_tok_s")]
                 for r in result["rows"]],
                caption=f"greedy tokens shared by fused and unfused before the first difference: "
                        f"{result['greedy_agreement']} of {result['new_tokens']}")
