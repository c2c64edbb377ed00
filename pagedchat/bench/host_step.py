"""The host's work in one engine step, without a model: what the GPU waits for between two steps.

The real engine (scheduler, block pool, sampler, output processing) drives `HostRunner`: ModelRunner's own
host path (the step's input tensors, the CUDA-graph input staging of DecodeGraphs) with the forward replaced
by nothing and the logits by a fixed tensor. With a small vocabulary the sampler's tensor math is negligible
on CPU, so what is timed is the per-step Python and per-op dispatch that a GPU step pays on the host
(on a GPU each tensor op is also a launch, and each host->device copy a transfer).

Timed: the CPU time of the calling thread (1 torch thread) per decode step, median over the steps in which
every sequence decodes, then over repeats; with steps not overlapped (the GPU waits for all of it, every step)
and overlapped (Engine.step: the same work, done while the GPU runs the step launched before it, so the GPU
waits only for what exceeds its own step time).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from pagedchat.engine.core.runner import DecodeGraphs, ModelRunner
from pagedchat.engine.core.seams import NoModel

VOCAB = 64  # the sampler's tensor math (device work on a GPU) stays negligible next to the host's


class _NoGraph:
    """DecodeGraphs' capturer without a GPU: the step's output is recorded once, replays do nothing."""

    class Graph:
        @staticmethod
        def replay():
            pass

    @classmethod
    def capture(cls, step, pool):
        return cls.Graph, step(), pool

    @staticmethod
    def synchronize():
        pass


class HostRunner(ModelRunner):
    """ModelRunner's host path with no model: inputs prepared and staged into the decode graphs' static
    buffers as for a real step; the logits are a fixed random tensor."""

    def __init__(self, loaded: NoModel, config, graphs: bool = True):
        self.loaded, self.device, self.block_size = loaded, loaded.device, config.block_size
        self.num_blocks, self.kv_groups, self.block_sharers, self.native = config.num_blocks, None, [], None
        self.backend = "torch"
        rows, max_query = DecodeGraphs.rows_for(config)
        self.logits = torch.randn(rows, loaded.vocab_size, generator=torch.Generator().manual_seed(0))
        self.model = lambda ids, positions, meta: torch.empty(ids.shape[0], 1)   # what a graph's output is
        self.graphs = DecodeGraphs.capture(self, rows, max_query, _NoGraph) if graphs else None

    def copy_blocks(self, copies) -> None:
        pass

    def run(self, batch):
        ids, positions, meta, sample_rows, samplers = self._prepare(batch)
        if self.graphs is not None and self.graphs.fits(ids.shape[0], max(n for _, n in batch.items)):
            self.graphs.replay(ids, positions, meta)
        if not sample_rows:
            return None, []
        return self.logits[:len(sample_rows)], samplers


WORKLOADS = {
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=50),
    "seeded": dict(temperature=0.8, top_p=0.9, top_k=50, seed=1),
    "penalty": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1),
}


MODES = {"not overlapped": False, "overlapped": True}


def time_steps(batch: int, workload: str, new_tokens: int, seed: int = 0, overlap: bool = False) -> list[float]:
    """Seconds of thread CPU time of each engine step in which all `batch` sequences decode."""
    from pagedchat.engine import Engine, EngineConfig, SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(512 if batch == 1 else rng.randint(15, 512))]
               for _ in range(batch)]
    blocks = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 16
    config = EngineConfig(model="host-step", num_blocks=blocks, max_num_seqs=max(batch, 1),
                          max_num_batched_tokens=max(2048, sum(map(len, prompts))), overlap=overlap)
    loaded = NoModel(max_model_len=4096, vocab_size=VOCAB)
    engine = Engine(config, loaded=loaded, runner=HostRunner(loaded, config))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **WORKLOADS[workload])
    for prompt in prompts:
        engine.add_request(prompt, params)
    times = []
    while engine.has_unfinished():
        decoding = len(engine.scheduler.running) == batch and not engine.scheduler.waiting and all(
            s.num_computed == s.num_tokens - 1 for s in engine.scheduler.running)
        start = time.thread_time()
        engine.step()
        if decoding:
            times.append(time.thread_time() - start)
    return times


def run_host_step_bench(batches=(1, 256), workloads=tuple(WORKLOADS), new_tokens: int = 64,
                        repeats: int = 3, modes=tuple(MODES)) -> dict:
    torch.set_num_threads(1)
    rows = []
    for batch in batches:
        for workload in workloads:
            for mode in modes:   # the modes take turns within each repeat: drift on a busy machine hits both
                rows.append({"batch": batch, "workload": workload, "steps": mode, "medians": []})
            for r in range(repeats):
                for row in rows[-len(modes):]:
                    row["medians"].append(statistics.median(time_steps(batch, workload, new_tokens, seed=r,
                                                                       overlap=MODES[row["steps"]])))
            for row in rows[-len(modes):]:
                medians = row.pop("medians")
                row.update(step_ms=1000 * statistics.median(medians),
                           per_sequence_us=1e6 * statistics.median(medians) / batch,
                           repeats_ms=[round(1000 * m, 4) for m in medians])
    return {"bench": "host_step", "vocab": VOCAB, "new_tokens": new_tokens, "threads": 1, "rows": rows}


def print_host_step_report(result: dict) -> None:
    from pagedchat.bench.common import print_table

    print_table(f"Host work of one engine step (no model; vocab {result['vocab']}, 1 thread, CPU time)",
                ["batch", "workload", "steps", "ms per step", "us per sequence"],
                [[r["batch"], r["workload"], r.get("steps", "not overlapped"), f"{r['step_ms']:.3f}",
                  f"{r['per_sequence_us']:.1f}"] for r in result["rows"]],
                caption="not overlapped: a GPU waits this long between two steps; overlapped: the same work runs "
                        "while the GPU computes the step before, and the GPU waits only for what exceeds that")
