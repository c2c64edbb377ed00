"""`pagedchat bench step`: where a batch-1 decode step's time goes, the engine's own Python (scheduler, block
tables, batch tensors, sampler, output processing) against the model's forward and LM head.

Each repeat decodes `tokens` tokens of one request (greedy, EOS ignored) and times every `Engine.step` and the
model calls inside it (or the one call of the native CPU step, which is the whole model: pagedchat/native);
"engine Python" is the step minus those. Each is timed twice: wall time, and the CPU time of the calling thread
(with 1 thread every op runs on it, and a busy machine disturbs it far less than the wall clock). The median over
steps, then over repeats, is reported.
"""

from __future__ import annotations

import statistics
import time

from pagedchat.bench.common import print_table

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
PARTS = ("step", "model forward", "compute_logits", "engine Python")


def run_step_bench(path: str, name: str, threads: int, tokens: int, repeats: int, quantize: str | None) -> dict:
    from pagedchat.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=path, device="cpu", num_blocks=256, quantize=quantize), show_progress=False)
    prompt = list(range(5, 37))
    _one_repeat(engine, prompt, 8)  # warm-up
    runs = [_one_repeat(engine, prompt, tokens) for _ in range(repeats)]
    ms = {part: {clock: statistics.median(r[part, clock] for r in runs) for clock in CLOCKS} for part in PARTS}
    return {"model": name, "quantize": quantize or "none", "threads": threads, "tokens": tokens, "repeats": repeats,
            "native_step": engine.runner.native is not None, "ms_per_step": ms}


def print_step_report(result: dict) -> None:
    print_table(f"per decode step of {result['model']} (quantize {result['quantize']}), median of "
                f"{result['repeats']} x {result['tokens']} steps, {result['threads']} thread(s)"
                + (", native CPU step" if result["native_step"] else ", torch path"),
                ["", "wall ms", "CPU ms"],
                [[part, f"{t['wall']:.3f}", f"{t['cpu']:.3f}"] for part, t in result["ms_per_step"].items()])


def _one_repeat(engine, prompt: list[int], tokens: int) -> dict:
    from pagedchat.engine import SamplingParams

    model, native = engine.runner.model, engine.runner.native
    forward, logits, steps = [], [], []
    if native is not None:  # the whole model in one native call: its time is the forward, no separate logits
        _timed(native, "step", forward)
        inner = native.step
        native.step = lambda *a: logits.append((0.0, 0.0)) or inner(*a)
    else:
        _timed(model, "forward", forward)
        _timed(model, "compute_logits", logits)
    try:
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        engine.step()  # the prefill
        forward.clear(), logits.clear()
        _timed(engine, "step", steps)
        while engine.has_unfinished():
            engine.step()
        engine.pop_output(rid)
    finally:
        for obj, names in ((engine, ("step",)), (native, ("step",)), (model, ("forward", "compute_logits"))):
            for name in names:
                if obj is not None and name in vars(obj):
                    delattr(obj, name)     # back to the class's own methods
    out = {}
    for i, clock in enumerate(CLOCKS):
        python = [s[i] - f[i] - g[i] for s, f, g in zip(steps, forward, logits)]
        for part, times in zip(PARTS, ([s[i] for s in steps], [f[i] for f in forward], [g[i] for g in logits],
                                       python)):
            out[part, clock] = 1000 * statistics.median(times)
    return out


def _timed(obj, name: str, bucket: list[tuple[float, float]]) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = [clock() for clock in CLOCKS.values()]
        try:
            return inner(*args, **kwargs)
        finally:
            bucket.append(tuple(clock() - s for clock, s in zip(CLOCKS.values(), start)))

    setattr(obj, name, wrapper)
