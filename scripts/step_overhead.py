"""Where a batch-1 decode step's time goes: the engine's Python (scheduler, block tables, batch tensors,
sampler, output processing) against the model's forward, on the demo model by default.

    python scripts/step_overhead.py [--model demo|DIR] [--threads 1] [--tokens 200] [--repeats 5] [--quantize int8]
                                    [--profile]

Each repeat decodes --tokens tokens of one request (greedy, EOS ignored) and times every `Engine.step`
and the `model(...)` and `compute_logits` calls inside it (or the one call of the native decode step, when
the model runs on it: pagedchat/native); "engine Python" is step time minus both. Each is
timed twice: wall time, and the CPU time of the calling thread (with 1 thread every op runs on it), which a
busy machine disturbs far less than wall time. The median over steps, then over repeats, is reported.
--profile adds a cProfile of one repeat's steps (the 25 costliest functions by own time).
"""

from __future__ import annotations

import argparse
import statistics
import time


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _timed(obj, name: str, bucket: list[tuple[float, float]]):
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = [clock() for clock in CLOCKS.values()]
        try:
            return inner(*args, **kwargs)
        finally:
            bucket.append(tuple(clock() - s for clock, s in zip(CLOCKS.values(), start)))

    setattr(obj, name, wrapper)


def one_repeat(engine, prompt: list[int], tokens: int, profile: bool) -> dict:
    from pagedchat.engine import SamplingParams

    model, native = engine.runner.model, engine.runner.native
    forward, logits = [], []
    if native is not None:  # the whole model in one native call: its time is the forward, no separate logits
        _timed(native, "step", forward)
        inner = native.step
        native.step = lambda *a: logits.append((0.0, 0.0)) or inner(*a)
    else:
        _timed(model, "forward", forward)
        _timed(model, "compute_logits", logits)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prefill
    forward.clear(), logits.clear()
    steps: list[tuple[float, float]] = []
    _timed(engine, "step", steps)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    while engine.has_unfinished():
        engine.step()
    if profiler:
        profiler.disable()
        import pstats

        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    engine.pop_output(rid)
    del engine.step  # back to the class methods
    if native is not None:
        del native.step
    else:
        del model.forward, model.compute_logits
    out = {}
    for i, clock in enumerate(CLOCKS):
        python = [s[i] - f[i] - g[i] for s, f, g in zip(steps, forward, logits)]
        for key, times in (("step", [s[i] for s in steps]), ("model forward", [f[i] for f in forward]),
                           ("compute_logits", [g[i] for g in logits]), ("engine Python", python)):
            out[key, clock] = 1000 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantize", default=None, help="int8: time the weight-only int8 model")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from pagedchat import threads

    threads.apply_threads(args.threads)
    from pagedchat.engine import Engine, EngineConfig
    from pagedchat.native import build
    from pagedchat.registry import Registry

    build.load(wait=True)  # a first build would leave this run on the torch path

    path = str(Registry().resolve(args.model).path)
    engine = Engine(EngineConfig(model=path, device="cpu", num_blocks=256, quantize=args.quantize), show_progress=False)
    prompt = list(range(5, 37))
    one_repeat(engine, prompt, 8, False)  # warm-up
    runs = [one_repeat(engine, prompt, args.tokens, args.profile and i == 0) for i in range(args.repeats)]
    print(f"| per decode step, median of {args.repeats} x {args.tokens} steps ({args.threads} thread) | wall ms "
          "| CPU ms |")
    print("|---|---|---|")
    for key in ("step", "model forward", "compute_logits", "engine Python"):
        wall, cpu = (statistics.median(r[key, clock] for r in runs) for clock in CLOCKS)
        print(f"| {key} | {wall:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
