"""`pagedchat bench gguf` (CUDA): the Triton GGUF matmuls of a batch-1 decode step, per layer and as a whole step.

The model is Llama-3.2-1B's shape typed as llama.cpp's Q4_K_M types it (bench/gguf_writer.py), with the fused
layers' parts joined as the loader joins them on CUDA. For each distinct layer (output features, inputs, type):
the current gemv tile, the former one (512 inputs per iteration on 4 warps) and candidates around them, each timed
alone (L2 flushed, CUDA graph replay) and read as GB/s of its blocks against the device's copy bandwidth, beside
bf16 cuBLAS on the same shape. Then the step's matmuls, every layer's weight its own (no cache hits between
layers), in one CUDA graph: current tiles, former tiles, the fastest candidate per layer, and bf16. The bf16 /
Q4_K_M ratio of that graph is the matmuls' share of the batch-1 goal (Q4_K_M decode >= 2.5x bf16), without
attention, norms and sampling.

Weights are random bytes: a matmul's time does not depend on the values (the outputs are not read).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedchat.bench.common import print_table, report_partial
from pagedchat.bench.gguf_writer import LLAMA_3_2_1B, q4_k_m_type

# (inputs per iteration at one row, output features per program, warps) around the current and former tiles
# (each a compile per type: a few seconds of a lent GPU's minutes)
CANDIDATES = [(512, 8, 4), (1024, 4, 4), (1024, 2, 8), (1024, 8, 8), (2048, 2, 8), (2048, 4, 8)]


@dataclass(frozen=True)
class Layer:
    name: str
    out_features: int
    in_features: int
    qtype: str
    per_step: int          # launches of this layer in one decode step

    @property
    def weight_bytes(self) -> int:
        from pagedchat.model.gguf.quants import row_bytes
        from pagedchat.model.gguf.reader import GGMLType

        return self.out_features * row_bytes(int(GGMLType[self.qtype]), self.in_features)

    @property
    def kind(self) -> tuple:
        """What its time depends on: launches of one kind are timed once."""
        return self.name, self.out_features, self.in_features, self.qtype


def step_layers(shape: dict | None = None) -> list[list[Layer]]:
    """Each decoder layer's launches in step order, then the LM head's: the fused q/k/v and gate/up parts joined
    where adjacent parts share a type, as the loader does on CUDA (model/gguf/linear.py runs_of_one_type)."""
    import torch

    from pagedchat.model.gguf.linear import runs_of_one_type
    from pagedchat.model.gguf.reader import GGMLType

    s = shape or LLAMA_3_2_1B
    hidden, layers = s["hidden_size"], s["num_hidden_layers"]
    kv = hidden // s["num_attention_heads"] * s["num_key_value_heads"]
    fused = {"qkv": [("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)], "o": [("attn_output", hidden)],
             "gate_up": [("ffn_gate", s["intermediate_size"]), ("ffn_up", s["intermediate_size"])],
             "down": [("ffn_down", hidden)]}
    inputs = {"qkv": hidden, "o": hidden, "gate_up": hidden, "down": s["intermediate_size"]}
    step = []
    for i in range(layers):
        launches = []
        for name, parts in fused.items():
            typed = [(torch.empty(rows, 1, device="meta"), int(GGMLType[q4_k_m_type(part, i, layers)]))
                     for part, rows in parts]
            for raw, qtype in runs_of_one_type(typed):
                launches.append(Layer(name, raw.shape[0], inputs[name], GGMLType(qtype).name, 1))
        step.append(launches)
    step.append([Layer("lm_head", s["vocab_size"], hidden, q4_k_m_type("output", 0, layers), 1)])
    return step


def distinct_layers(step: list[list[Layer]]) -> list[Layer]:
    """One Layer per (name, shape, type), its per_step the number of launches of it in a step."""
    counts: dict[tuple, int] = {}
    for launches in step:
        for layer in launches:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
    return [Layer(*kind, per_step=n) for kind, n in counts.items()]


def run_gguf_bench(iters: int = 20, candidates: bool = True) -> dict:
    import torch

    from pagedchat.bench.kernels import Timer, measure_ceilings
    from pagedchat.errors import UserError

    if not torch.cuda.is_available():
        raise UserError("bench gguf times the Triton GGUF matmuls on a CUDA GPU; none is available here")
    timer = Timer(torch, warmup=3, iters=iters)
    copy_gbps, _ = measure_ceilings(torch, timer, torch.bfloat16)
    return measure(timer, copy_gbps, step_layers(), torch.device("cuda"), candidates) | {"iters": iters}


def measure(timer, copy_gbps: float, step: list[list[Layer]], device, candidates: bool) -> dict:
    """Every distinct layer, then the whole step's graphs, timed by `timer` (a callable -> seconds) on `device`
    (the tests run it on the CPU under the Triton interpreter, with a stand-in timer)."""
    import torch

    rows, best = [], {}
    for layer in distinct_layers(step):
        row, best[layer.kind] = _layer_row(torch, timer, layer, copy_gbps, candidates, device)
        rows.append(row)
        report_partial(row)
    graphs = _step_graphs(torch, timer, step, best, device)
    return {"copy_gbps": copy_gbps, "layers": rows, "step_us": graphs,
            "bf16_over_current": graphs["bf16"] / graphs["current"],
            "former_over_current": graphs["former"] / graphs["current"],
            "bf16_over_best": graphs["bf16"] / graphs["best"],
            "weight_bytes": sum(layer.weight_bytes for launches in step for layer in launches)}


def _current_and_former(layer: Layer, device) -> dict[str, object]:
    """The gemv tile a batch-1 step uses now, and the one it used before (512 inputs per iteration, 4 warps)."""
    from pagedchat.kernels._launch import sm_count
    from pagedchat.kernels.triton_gguf import gemv_config

    sms = sm_count(device)
    return {"current": gemv_config(layer.qtype, 1, layer.out_features, sms),
            "former": gemv_config(layer.qtype, 1, layer.out_features, sms, inputs=512, num_warps=4)}


def _configs(layer: Layer, candidates: bool, device) -> dict[str, object]:
    """The current tile, the former one and (candidates) the others, by name; names that give the same launch
    are kept once."""
    from pagedchat.kernels.triton_gguf import FORMATS, GGUFConfig

    configs = _current_and_former(layer, device)
    if candidates:
        run = FORMATS[layer.qtype][2]
        for inputs, block_n, warps in CANDIDATES:
            configs[f"{inputs}/{block_n}/{warps}"] = GGUFConfig("gemv", block_n=block_n,
                                                                 block_u=inputs // (2 * run), num_warps=warps)
    seen, unique = set(), {}
    for name, config in configs.items():
        if config not in seen:
            seen.add(config)
            unique[name] = config
    return unique


def _layer_row(torch, timer, layer: Layer, copy_gbps: float, candidates: bool, device) -> tuple[dict, object]:
    from pagedchat.kernels.triton_gguf import gguf_matmul_triton

    raw = _random_blocks(torch, layer, device)
    x = torch.randn(1, layer.in_features, device=device, dtype=torch.bfloat16)
    out = torch.empty(1, layer.out_features, device=device, dtype=torch.bfloat16)
    configs = _configs(layer, candidates, device)
    times = {name: timer(lambda: gguf_matmul_triton(x, raw, layer.qtype, out=out, config=config)) * 1e6
             for name, config in configs.items()}
    dense = torch.randn(layer.out_features, layer.in_features, device=device, dtype=torch.bfloat16)
    bf16_us = timer(lambda: torch.nn.functional.linear(x, dense)) * 1e6
    del dense, raw
    fastest = min(times, key=times.get)
    row = {"layer": layer.name, "out": layer.out_features, "in": layer.in_features, "qtype": layer.qtype,
           "per_step": layer.per_step, "weight_bytes": layer.weight_bytes, "us": times, "bf16_us": bf16_us,
           "current_of_copy": layer.weight_bytes / (times["current"] * 1e-6) / 1e9 / copy_gbps,
           "bf16_of_copy": layer.out_features * layer.in_features * 2 / (bf16_us * 1e-6) / 1e9 / copy_gbps,
           "fastest": fastest, "fastest_config": asdict(configs[fastest])}
    return row, configs[fastest]


def _random_blocks(torch, layer: Layer, device):
    return torch.randint(0, 256, (layer.out_features, layer.weight_bytes // layer.out_features), dtype=torch.uint8,
                         device=device)


def _step_graphs(torch, timer, step: list[list[Layer]], best: dict, device) -> dict[str, float]:
    """µs of one step's matmuls in one CUDA graph, each launch with a weight of its own: the current tiles, the
    former, the fastest per layer, and bf16 cuBLAS."""
    from pagedchat.kernels.triton_gguf import gguf_matmul_triton

    launches = [layer for layers in step for layer in layers]
    xs = {n: torch.randn(1, n, device=device, dtype=torch.bfloat16) for n in {la.in_features for la in launches}}
    result = {}
    weights = [_random_blocks(torch, layer, device) for layer in launches]
    outs = [torch.empty(1, layer.out_features, device=device, dtype=torch.bfloat16) for layer in launches]
    tiles = [_current_and_former(la, device) for la in launches]
    choices = {"current": [t["current"] for t in tiles], "former": [t["former"] for t in tiles],
               "best": [best[la.kind] for la in launches]}
    for name, configs in choices.items():
        def run(configs=configs):
            for layer, raw, out, config in zip(launches, weights, outs, configs):
                gguf_matmul_triton(xs[layer.in_features], raw, layer.qtype, out=out, config=config)
        result[name] = timer(run) * 1e6
        report_partial({"step": name, "us": result[name]})
    del weights, outs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dense = [torch.randn(la.out_features, la.in_features, device=device, dtype=torch.bfloat16) for la in launches]

    def run_bf16():
        for layer, w in zip(launches, dense):
            torch.nn.functional.linear(xs[layer.in_features], w)
    result["bf16"] = timer(run_bf16) * 1e6
    report_partial({"step": "bf16", "us": result["bf16"]})
    return result


def print_gguf_report(r: dict) -> None:
    rows = [[f"{x['layer']} {x['qtype']} {x['out']}x{x['in']}", x["per_step"], x["us"]["current"],
             x["us"].get("former"), x["us"][x["fastest"]], x["fastest"], x["bf16_us"],
             f"{x['current_of_copy']:.0%}"] for x in r["layers"]]
    print_table("GGUF Q4_K_M matmuls at batch 1, per layer (µs, L2 flushed)",
                ["layer", "per step", "current", "former", "fastest", "fastest tile", "bf16", "current of copy"],
                rows, caption=f"copy bandwidth {r['copy_gbps']:,.0f} GB/s (read + write)")
    s = r["step_us"]
    print_table("One step's matmuls in one CUDA graph (µs)", ["tiles", "µs", "bf16 / this"],
                [[name, us, s["bf16"] / us] for name, us in s.items()],
                caption=f"{r['weight_bytes'] / 1e9:.2f} GB of Q4_K_M blocks per step")
