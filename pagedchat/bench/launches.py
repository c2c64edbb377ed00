"""Kernel launches of one decode step, counted: the unfused layer ops against the fused layer kernels.

A decode step of a small model on a GPU costs what its launches cost (each is a few microseconds of host work
and of GPU start-up), so the count is the figure of merit that a CPU machine can measure exactly. The counter
sees every aten op that reaches the dispatcher (TorchDispatchMode) and every Triton launch (the `run` of
Triton's kernel objects, compiled or interpreted), and sorts them by where they happen: inside a decoder
layer, elsewhere in the model's forward (embedding, final norm), or elsewhere in the step (LM head, sampling).

On CPU the step runs the CUDA code path: attention and the fused kernels on Triton under TRITON_INTERPRET=1,
every other op on CPU tensors. An aten op counts as one launch unless it launches nothing on a GPU (views,
empty tensors, a `.to()` that returns its input); a composite op that CUDA runs as one kernel (linear with
bias, rms_norm) counts once, as it does there. What a CPU count cannot see: a split-KV decode's merge kernel,
which the GPU runs when its split heuristic (SM count, table width) splits the context (+1 per layer).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing on a GPU (allocation, metadata, aliasing)
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "detach_", "alias", "resolve_conj", "resolve_neg", "set_", "record_stream", "_local_scalar_dense"}


class LaunchCounter(TorchDispatchMode):
    """Counts launches by site: `where` is the innermost site being run (set by `site`): "step", "model" or
    the decoder layer's index."""

    def __init__(self):
        super().__init__()
        self.counts: dict[object, Counter] = {"step": Counter(), "model": Counter()}
        self.where: object = "step"
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._in_triton and _launches(func, args, out):
            self.counts.setdefault(self.where, Counter())[func.__name__.split(".")[0]] += 1
        return out

    @contextlib.contextmanager
    def site(self, where: str):
        outer, self.where = self.where, where
        try:
            yield
        finally:
            self.where = outer

    def triton_launch(self, name: str) -> None:
        self.counts.setdefault(self.where, Counter())[f"triton:{name.lstrip('_')}"] += 1

    def total(self, where) -> int:
        return sum(self.counts.get(where, Counter()).values())


def _launches(func, args, out) -> bool:
    name = func.__name__.split(".")[0]
    if name in NO_LAUNCH:
        return False
    if not func.is_view:
        return True
    # a "view" op that returned a new tensor (`.to(dtype)` converting, reshape copying) did launch a copy
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outs)


@contextlib.contextmanager
def counting(model) -> "LaunchCounter":
    """Count launches while the block runs; sites from the model's decoder layers and forward."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from pagedchat.model.llama import DecoderLayer

    counter = LaunchCounter()
    patched = []

    def wrap(cls, name, make):
        inner = getattr(cls, name)
        patched.append((cls, name, inner))
        setattr(cls, name, make(inner))

    def triton_run(inner):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return inner(self, *args, **kwargs)
            counter.triton_launch(getattr(self, "__name__", None) or self.fn.__name__)
            counter._in_triton += 1   # the interpreter copies arguments with torch ops: not launches
            try:
                return inner(self, *args, **kwargs)
            finally:
                counter._in_triton -= 1
        return run

    def at(where):
        def make(inner):
            def method(self, *args, **kwargs):
                with counter.site(where(self)):
                    return inner(self, *args, **kwargs)
            return method
        return make

    layer_index = {id(layer): i for i, layer in enumerate(model.layers)}
    in_layer = at(lambda layer: layer_index[id(layer)])

    wrap(InterpretedFunction, "run", triton_run)
    wrap(JITFunction, "run", triton_run)
    wrap(DecoderLayer, "forward", in_layer)
    wrap(DecoderLayer, "forward_fused", in_layer)
    wrap(type(model), "forward", at(lambda _: "model"))
    try:
        with counter:
            yield counter
    finally:
        for cls, name, inner in reversed(patched):
            setattr(cls, name, inner)


def count_decode_step(path: Path, fused: bool, device: str = "cpu", dtype: str = "bfloat16", batch: int = 1,
                      context: int = 512) -> dict:
    """Launches of one greedy decode step of `batch` sequences at `context` tokens, on the CUDA code path
    (CUDA graphs off: every launch is made by the host)."""
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(path), device=device, dtype=dtype, cuda_graphs=False,
                                 num_blocks=batch * (-(-(context + 8) // 16)) + 4, fused_kernels=fused,
                                 max_num_batched_tokens=max(2048, batch * context)), show_progress=False)
    model = engine.runner.model
    layers = model.attention_layers()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.loaded.spec.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (context,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefills (on whatever backend the device has: not counted)
    for layer in layers:
        layer.backend = "triton"
    model.use_fused_kernels("triton" if fused else None)
    with _interpreting(device):
        engine.step()  # a first decode step compiles every kernel
        with counting(model) as counter:
            engine.step()
    # A layer's own launches are the last layer's: the first also does what the step shares (the rotary
    # table rows of the unfused path), which counts with the model outside the layers.
    num_layers = len(model.layers)
    last = counter.counts.get(num_layers - 1, Counter())
    model_rest = Counter(counter.counts["model"])
    for i in range(num_layers):
        model_rest.update(counter.counts.get(i, Counter()))
    model_rest.subtract({op: n * num_layers for op, n in last.items()})
    model_rest = +model_rest
    return {"fused": fused, "num_layers": num_layers, "batch": batch, "context": context, "dtype": dtype,
            "per_layer": sum(last.values()), "per_layer_ops": dict(sorted(last.items())),
            "model_outside_layers": sum(model_rest.values()), "model_outside_layers_ops": dict(model_rest),
            "step_outside_model": counter.total("step"), "step_outside_model_ops": dict(counter.counts["step"]),
            "per_step": sum(sum(c.values()) for c in counter.counts.values())}


@contextlib.contextmanager
def _interpreting(device: str):
    """On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1) for the counted step."""
    if device != "cpu":
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def counting_model(arch: str, workdir: Path) -> tuple[Path, str]:
    """Llama-3.2-1B's attention layout (32 query / 8 KV heads of 64, hidden 2048) in 2 layers, with a narrow MLP
    and vocabulary: launch counts depend on the layout, not on the sizes, and the CPU interprets it quickly."""
    from pagedchat.bench.models import build_random_model

    path = build_random_model(arch, workdir / f"{arch}-launches", "1b", max_positions=2048, num_hidden_layers=2,
                              intermediate_size=1024, vocab_size=2048)
    return path, f"random {arch}, Llama-3.2-1B heads, 2 layers"


LIKE_LAYERS = 16  # Llama-3.2-1B's depth: what a step of the model the GPU goals name launches


def run_launch_bench(path: Path, name: str, device: str = "cpu", dtype: str = "bfloat16", batch: int = 1,
                     context: int = 512) -> dict:
    rows = {}
    for fused in (False, True):
        row = rows["fused" if fused else "unfused"] = count_decode_step(path, fused, device, dtype, batch, context)
        row["per_step_like"] = row["per_step"] + (LIKE_LAYERS - row["num_layers"]) * row["per_layer"]
    return {"bench": "launches", "model": name, "device": device, "dtype": dtype, "batch": batch,
            "context": context, **rows, "layers_like": LIKE_LAYERS,
            "per_layer_ratio": rows["unfused"]["per_layer"] / max(rows["fused"]["per_layer"], 1)}


def print_launch_report(result: dict) -> None:
    from pagedchat.bench.common import print_table

    ops = sorted(set(result["unfused"]["per_layer_ops"]) | set(result["fused"]["per_layer_ops"]))
    rows = [[op, _fmt(result["unfused"]["per_layer_ops"].get(op, 0)), _fmt(result["fused"]["per_layer_ops"].get(op, 0))]
            for op in ops]
    rows += [["per layer", _fmt(result["unfused"]["per_layer"]), _fmt(result["fused"]["per_layer"])],
             ["model, outside the layers", result["unfused"]["model_outside_layers"],
              result["fused"]["model_outside_layers"]],
             ["step, outside the model", result["unfused"]["step_outside_model"],
              result["fused"]["step_outside_model"]],
             ["one decode step", result["unfused"]["per_step"], result["fused"]["per_step"]]]
    rows.append([f"with {result['layers_like']} layers", result["unfused"]["per_step_like"],
                 result["fused"]["per_step_like"]])
    print_table(f"Launches of one decode step ({result['model']}, {result['dtype']}, batch {result['batch']}, "
                f"context {result['context']}, {result['device']})", ["op", "unfused", "fused"], rows)


def _fmt(n: float) -> str:
    return f"{n:g}"
