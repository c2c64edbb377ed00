"""`pagedchat bench spec`: decode tokens/s with and without speculative decoding, same prompts, one run.

Two engines on the same model and thread count (speculation off, and the method under test) run each
workload's requests in lockstep, one engine step each in turn, and each side is timed over its own steps
only: a neighbour's burst of work on a shared machine lands on both sides alike, not on one side's whole
run. The median of the repeats counts. Three workloads, at batch 1 and batch B:
  - edit:  the answer repeats most of the prompt. The prompt holds a text (the model's own greedy
           continuation of a seed, so it is text this model produces) and the start of its copy with one
           token changed; the reply goes on copying as far as the model does.
  - regen: a sibling reply already exists (attached as context, as the chat tree does for /regen); the new
           reply samples with another seed.
  - plain: a fresh prompt and nothing to copy from.
Decode tokens/s counts the tokens after each request's first one over the time of a side's steps after the
one where every request had its first token (prefill excluded, EOS ignored so both sides decode the same count).
It is reported twice: over the wall clock, and over the process's CPU time (`*_cpu_tok_s`, `cpu_speedup`):
each engine computes on one thread, so on a machine shared with other work the CPU time is the steadier
measure of what a side costs (a busy neighbour stretches wall time, not the work done).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from pagedchat.engine import Engine, EngineConfig, SamplingParams

WORKLOADS = ("edit", "regen", "plain")


def _engine(path, speculate: str, num_draft_tokens: int, device: str, draft_model: str | None,
            max_num_seqs: int, dtype: str = "auto") -> Engine:
    """Steps not overlapped on either side: in lockstep on one GPU, an overlapped step still computing when its
    call returns would be timed inside the other side's next step. (A GPU's plain decode overlaps its steps:
    the GPU check's batch-1 rows give that factor.)"""
    config = EngineConfig(model=str(path), device=device, dtype=dtype, kv_memory="1GiB", speculate=speculate,
                          num_draft_tokens=num_draft_tokens, draft_model=draft_model if speculate == "draft" else None,
                          max_num_seqs=max_num_seqs, overlap=False)
    return Engine(config, show_progress=False)


def _prompts(engine: Engine, batch: int, seed: int, text_tokens: int) -> dict[str, tuple[list, list, SamplingParams]]:
    """Per workload: prompts, context streams, sampling params (built with an engine of their own: an edit prompt
    holds the text its engine decoded, so there its start would be a prefix-cache hit of K/V written by decode
    steps, on one side only; in bf16 those differ from a prefill's by rounding, and greedy tokens could part)."""
    rng = random.Random(seed)
    vocab = engine.loaded.spec.vocab_size
    seeds = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(batch)]
    greedy = SamplingParams(temperature=0, max_tokens=text_tokens, ignore_eos=True)
    texts = [o.outputs[0].token_ids for o in engine.generate(seeds, greedy)]
    edit = []
    for s, text in zip(seeds, texts):
        copy = list(text[: len(text) // 8])
        copy[len(copy) // 2] = rng.randrange(3, vocab)  # the one change
        edit.append(s + text + [rng.randrange(3, vocab)] + copy)
    sampled = SamplingParams(temperature=0.8, max_tokens=text_tokens, ignore_eos=True)
    siblings = [o.outputs[0].token_ids for o in
                engine.generate(seeds, [sampled.with_(seed=seed * 1000 + i) for i in range(batch)])]
    plain = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(batch)]
    return {"edit": (edit, [[] for _ in edit], greedy),
            "regen": (seeds, [[s + sib] for s, sib in zip(seeds, siblings)], sampled),
            "plain": (plain, [[] for _ in plain], greedy)}


def _lockstep(engines: list[Engine], prompts: list, contexts: list, params: SamplingParams, max_tokens: int,
              seed: int) -> list[tuple[float, float, list[list[int]]]]:
    """The same requests on every engine, one step each in turn. Per engine: decode tokens per second of its
    own steps' wall time and of their CPU time, and the tokens."""
    params = params.with_(max_tokens=max_tokens)
    sides = [_Side(engine, [engine.add_request(p, params.with_(seed=None if params.greedy else seed + i), context=c)
                            for i, (p, c) in enumerate(zip(prompts, contexts))]) for engine in engines]
    while any(side.running for side in sides):
        for side in sides:
            if side.running:
                side.step()
    return [side.result() for side in sides]


class _Side:
    """One engine's requests in a lockstep run, and the time its decode steps took."""

    def __init__(self, engine: Engine, ids: list[str]):
        self.engine, self.ids = engine, ids
        self.decoding = False  # every request has its first token: the steps from here on are timed
        self.wall = self.cpu = 0.0

    @property
    def running(self) -> bool:
        return any(not self.engine.requests[r].finished for r in self.ids)

    def step(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.engine.step()
        if self.engine.device.type == "cuda":   # its work done before the other side's starts
            torch.cuda.synchronize(self.engine.device)
        if self.decoding:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu
        self.decoding = self.decoding or all(self.engine.requests[r].first_token_time for r in self.ids)

    def result(self) -> tuple[float, float, list[list[int]]]:
        outs = [self.engine.pop_output(r) for r in self.ids]
        decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return decoded / max(self.wall, 1e-9), decoded / max(self.cpu, 1e-9), [o.outputs[0].token_ids for o in outs]


def run_spec_bench(path, name: str, method: str = "ngram", batches: tuple[int, ...] = (1, 16),
                   max_tokens: int = 128, num_draft_tokens: int = 6, repeats: int = 3, device: str = "cpu",
                   threads: int | None = None, seed: int = 0, draft_model: str | None = None,
                   dtype: str = "auto") -> dict:
    if threads:
        torch.set_num_threads(threads)
    writer = _engine(path, "off", num_draft_tokens, device, None, max(batches), dtype)
    workloads = {batch: _prompts(writer, batch, seed + batch, max_tokens * 2) for batch in batches}
    writer.close()
    plain_engine = _engine(path, "off", num_draft_tokens, device, None, max(batches), dtype)
    spec_engine = _engine(path, method, num_draft_tokens, device, draft_model, max(batches), dtype)
    rows = []
    for batch in batches:
        for workload in WORKLOADS:
            prompts, contexts, params = workloads[batch][workload]
            off, on, identical = [], [], True
            before = spec_engine.speculator.stats.as_dict()
            for r in range(repeats):
                (*rates_off, tokens_off), (*rates_on, tokens_on) = _lockstep(
                    [plain_engine, spec_engine], prompts, contexts, params, max_tokens, seed + r)
                off.append(rates_off)
                on.append(rates_on)
                identical &= tokens_on == tokens_off
            (off_wall, off_cpu), (on_wall, on_cpu) = _medians(off), _medians(on)
            after = spec_engine.speculator.stats.as_dict()
            proposed = after["proposed_tokens"] - before["proposed_tokens"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            rows.append({"workload": workload, "batch": batch, "off_tok_s": off_wall, "spec_tok_s": on_wall,
                         "speedup": on_wall / off_wall, "off_cpu_tok_s": off_cpu, "spec_cpu_tok_s": on_cpu,
                         "cpu_speedup": on_cpu / off_cpu,
                         "acceptance_rate": accepted / proposed if proposed else 0.0,
                         "proposed_tokens": proposed, "accepted_tokens": accepted,
                         "greedy_identical": identical if params.greedy else None})
    return {"model": name, "method": method, "max_tokens": max_tokens, "num_draft_tokens": num_draft_tokens,
            "repeats": repeats, "threads": torch.get_num_threads(), "device": device,
            "dtype": str(plain_engine.loaded.dtype).removeprefix("torch."), "rows": rows}


def _medians(rates: list[list[float]]) -> list[float]:
    """Per column (wall, CPU), the median over the repeats."""
    return [statistics.median(column) for column in zip(*rates)]


def print_spec_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    rows = [[row["workload"], row["batch"], row["off_tok_s"], row["spec_tok_s"], f"{row['speedup']:.2f}x",
             f"{row['cpu_speedup']:.2f}x", f"{row['acceptance_rate']:.0%}"] for row in r["rows"]]
    print_table(f"speculative decoding ({r['method']}) on {r['model']}: decode tokens/s, median of {r['repeats']}",
                ["workload", "batch", "off", r["method"], "speedup", "CPU-time speedup", "acceptance"], rows,
                caption=f"{r['max_tokens']} new tokens per request, up to {r['num_draft_tokens']} drafts, "
                        f"{r['threads']} threads, {r['device']}")


def plot_spec(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedchat.bench.common import save_figure

    batches = sorted({row["batch"] for row in r["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = [row for row in r["rows"] if row["batch"] == batch]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [row["off_tok_s"] for row in rows], 0.4, label="off", color="#9aa5b1")
        ax.bar([i + 0.2 for i in x], [row["spec_tok_s"] for row in rows], 0.4, label=r["method"], color="#2f6fb0")
        for i, row in enumerate(rows):
            ax.annotate(f"{row['speedup']:.2f}x\n{row['acceptance_rate']:.0%} acc.", (i + 0.2, row["spec_tok_s"]),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [row["workload"] for row in rows])
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_ylabel("decode tokens/s")
        ax.margins(y=0.25)
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"speculative decoding: {r['model']}", fontsize=10)
    save_figure(fig, path)
    plt.close(fig)
