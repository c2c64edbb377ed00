"""`--quantize int4` on a CUDA GPU, in one command: the Triton int4 matmul against bf16 cuBLAS on the layers of a
1B-shaped Llama (kernels/triton_int4.py's default tiles, and a sweep of the one-row kernel's tiles), then batch-1
decode of a random 1B-shaped Llama with `--quantize int4` against bf16, alternating runs (the goal: >= 1.6x).

    python scripts/bench_int4.py [--out int4.json] [--repeats 3] [--no-engine] [--no-sweep]

Needs CUDA torch and triton; without a GPU it says so in one line. Prints a table and writes one JSON object
(with "machine") to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# (name, out_features, in_features) of the 1B shape (bench/models.py SIZES["1b"]): fused q/k/v, o, gate+up,
# down, LM head
LAYERS = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
          ("lm_head", 128256, 2048)]
ROWS = (1, 2, 4, 8, 16, 64, 512)


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100) * 1000


def kernel_rows(sweep: bool) -> dict:
    import torch

    from pagedchat import kernels as K
    from pagedchat.kernels.triton_int4 import Int4Config, default_config
    from pagedchat.model.int4 import quantize_int4

    rows_out, sweep_out = [], []
    for name, n, k in LAYERS:
        weight = torch.randn(n, k, device="cuda") * 0.02
        packed, scales = quantize_int4(weight)
        dense = weight.to(torch.bfloat16)
        del weight
        int4_bytes = packed.numel() + scales.numel() * 2
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t4 = _time_us(lambda: K.int4_matmul(x, packed, scales))
            t16 = _time_us(lambda: torch.nn.functional.linear(x, dense))
            config = default_config(m, n, k // 32, x.device)
            rows_out.append({"layer": name, "out": n, "in": k, "rows": m, "int4_us": t4, "bf16_us": t16,
                             "speedup": t16 / t4, "int4_GBps": int4_bytes / t4 / 1e3,
                             "bf16_GBps": dense.numel() * 2 / t16 / 1e3, "config": config.__dict__})
        if sweep:
            sweep_out += _sweep(name, packed, scales, k, Int4Config, K)
        del dense, packed, scales
        torch.cuda.empty_cache()
    return {"rows": rows_out, "sweep": sweep_out}


def _sweep(name, packed, scales, k, Int4Config, K) -> list[dict]:
    """The one-row kernel's tiles at 1 row, and gemv-per-row against the 16-row gemm tile at 2..16 rows."""
    import torch

    out = []
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for block_n, block_g, warps in itertools.product((2, 4, 8, 16), (8, 16, 32), (2, 4, 8)):
        config = Int4Config("gemv", block_n=block_n, block_g=block_g, num_warps=warps)
        out.append({"layer": name, "rows": 1, "config": config.__dict__,
                    "us": _time_us(lambda: K.int4_matmul(x1, packed, scales, config=config))})
    for m in (2, 4, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for config in (Int4Config("gemv", block_n=4, block_g=32), Int4Config("gemv", block_n=8, block_g=32),
                       Int4Config("gemm", block_m=16, block_n=16, block_g=4),
                       Int4Config("gemm", block_m=16, block_n=32, block_g=2),
                       Int4Config("gemm", block_m=16, block_n=64, block_g=2)):
            out.append({"layer": name, "rows": m, "config": config.__dict__,
                        "us": _time_us(lambda: K.int4_matmul(x, packed, scales, config=config))})
    return out


def engine_decode(repeats: int, tokens: int = 128) -> dict:
    """Batch-1 decode tok/s of a random 1B-shaped Llama (bf16) with and without --quantize int4, alternating."""
    from pagedchat.bench.models import build_random_model
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    runs: dict[str, list[float]] = {"bf16": [], "int4": []}
    with tempfile.TemporaryDirectory(prefix="pagedchat-int4-") as tmp:
        path = build_random_model("llama", Path(tmp) / "llama-1b", "1b", max_positions=2048, dtype="bfloat16")
        engines = {mode: Engine(EngineConfig(model=str(path), device="cuda", kv_memory="4GiB",
                                             quantize=None if mode == "bf16" else "int4"), show_progress=False)
                   for mode in runs}
        prompt = list(range(100, 164))
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for engine in engines.values():
            engine.generate([prompt], params.with_(max_tokens=8))  # warm-up: graphs, kernels
        for _ in range(repeats):
            for mode, engine in engines.items():
                rid = engine.add_request(prompt, params)
                engine.step()  # the prefill and first token
                start = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                runs[mode].append((tokens - 1) / (time.perf_counter() - start))
                engine.pop_output(rid)
        same = [engines[m].generate([prompt], params.with_(max_tokens=32))[0].outputs[0].token_ids for m in runs]
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    first = next((i for i, (a, b) in enumerate(zip(*same)) if a != b), len(same[0]))
    return {"decode_tok_per_s": med, "runs": runs, "int4_over_bf16": med["int4"] / med["bf16"],
            "greedy_tokens_agreeing_of_32": first, "tokens": tokens, "repeats": repeats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="int4-gpu.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-engine", action="store_true", help="kernels only")
    parser.add_argument("--no-sweep", action="store_true", help="default tiles only")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_int4: no CUDA device here (this measures the Triton int4 kernels on a GPU)", file=sys.stderr)
        return 2
    from pagedchat.bench.common import machine_description

    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine_description(),
              "command": "python scripts/bench_int4.py " + " ".join(sys.argv[1:])}
    result["kernels"] = kernel_rows(not args.no_sweep)
    for r in result["kernels"]["rows"]:
        print(f"{r['layer']:8s} {r['out']:6d}x{r['in']:<5d} rows {r['rows']:4d}: int4 {r['int4_us']:8.1f} us "
              f"({r['int4_GBps']:6.0f} GB/s)  bf16 {r['bf16_us']:8.1f} us ({r['bf16_GBps']:6.0f} GB/s)  "
              f"{r['speedup']:.2f}x")
    best: dict = {}
    for s in result["kernels"]["sweep"]:
        key = (s["layer"], s["rows"])
        if key not in best or s["us"] < best[key]["us"]:
            best[key] = s
    for (layer, rows), s in best.items():
        print(f"best tile {layer} rows {rows}: {s['config']} {s['us']:.1f} us")
    if not args.no_engine:
        result["engine"] = engine_decode(args.repeats)
        e = result["engine"]
        print(f"batch-1 decode, random 1B llama: bf16 {e['decode_tok_per_s']['bf16']:.1f} tok/s, int4 "
              f"{e['decode_tok_per_s']['int4']:.1f} tok/s: {e['int4_over_bf16']:.2f}x (goal >= 1.6x); greedy "
              f"tokens agreeing {e['greedy_tokens_agreeing_of_32']}/32")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
