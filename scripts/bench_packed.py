"""Every linear layer of a model, MKL (nn.Linear) against oneDNN with packed weights (pagedchat/model/packed.py),
at several row counts: CPU time of one pass over all layers, the two interleaved call by call, medians.

    python scripts/bench_packed.py [--model DIR] [--rows 1,2,6,16,64,512] [--repeats 9] [--threads 1]

Without --model: the random llama `small` shapes (8 layers, hidden 512, intermediate 1536, vocab 8192).
Random weights of the model's shapes: speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of the fused projections pagedchat runs, layer by layer, then the LM head."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    layer = [((heads + 2 * kv) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def one_pass(layers, rows: int, packed: bool) -> float:
    import torch

    inputs = {k: torch.randn(rows, k) for _, k in {s for s in (w.shape for w, _ in layers)}}
    start = time.thread_time()
    for weight, packed_weight in layers:
        x = inputs[weight.shape[1]]
        if packed:
            torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
        else:
            torch.nn.functional.linear(x, weight)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="1,2,6,16,64,512")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from pagedchat import threads

    threads.apply_threads(args.threads)
    import torch

    from pagedchat.model.packed import PACK_FOR_ROWS

    config = json.loads((Path(args.model) / "config.json").read_text()) if args.model else \
        dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536,
             num_hidden_layers=8, vocab_size=8192)
    torch.manual_seed(0)
    weights = [torch.randn(shape) * 0.05 for shape in layer_shapes(config)]
    layers = [(w, torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)) for w in weights]
    print(f"| rows | MKL ms | oneDNN packed ms | packed speedup | ({args.threads} thread(s), median of {args.repeats}) |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        one_pass(layers, rows, False), one_pass(layers, rows, True)  # warm-up
        plain, packed = [], []
        for _ in range(args.repeats):
            plain.append(one_pass(layers, rows, False))
            packed.append(one_pass(layers, rows, True))
        a, b = statistics.median(plain) * 1e3, statistics.median(packed) * 1e3
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | |")


if __name__ == "__main__":
    main()
