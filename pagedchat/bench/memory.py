"""`pagedchat bench memory`: the real BlockPool and Scheduler on a synthetic trace, against contiguous reservation.

No model runs: the real `Engine` steps with its model runner replaced by pure bookkeeping (the engine's
injectable `runner=`), so schedule -> commit -> fork the n variants -> append a token -> finish at the
target length are the engine's own code, and block counts, prefix hits, copy-on-write and preemption are
exactly what it would do on the same trace.

The peer is the pre-paged way: every admitted request reserves `max_len` contiguous slots for its whole
life; admission is first-come-first-served while slots remain; the same per-step token budget.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict, dataclass, field

from pagedchat.bench.common import lognormal_lengths
from pagedchat.errors import UserError

SWEEP_BLOCK_SIZES = (8, 16, 32, 64, 128)
FORK_HISTORIES = (256, 512, 1024, 2048, 4096, 8192)


@dataclass
class TraceParams:
    requests: int = 1000
    max_len: int = 2048
    mean_prompt: float = 300
    mean_output: float = 200
    sigma: float = 1.0                 # lognormal shape: 1.0 is a long-tailed, chat-like spread
    block_size: int = 16
    pool_tokens: int = 65536
    shared_prefix: int = 0             # tokens of a system prompt common to every request
    variants: int = 8
    variant_tail: int = 32             # tokens each variant decodes after the fork
    max_batched_tokens: int = 2048     # the engine's per-step token budget (chunked prefill)
    max_seqs: int = 0                  # running-sequence cap; 0 = no cap (memory is the only limit)
    seed: int = 0

    def check(self) -> None:
        if self.requests < 1:
            raise UserError("--requests must be >= 1")
        if self.max_len < 2:
            raise UserError("--max-len must be >= 2")
        if self.shared_prefix < 0 or self.shared_prefix > self.max_len - 2:
            raise UserError(f"--shared-prefix must be in [0, max-len - 2] = [0, {self.max_len - 2}]")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UserError(f"--block-size must be a power of two, got {self.block_size}")
        if self.pool_tokens < self.max_len:
            raise UserError(f"--pool-tokens ({self.pool_tokens}) must hold at least one max-len request "
                            f"({self.max_len} tokens)")
        if self.variants < 1 or self.variant_tail < 1:
            raise UserError("--variants and --variant-tail must be >= 1")
        if self.mean_prompt < 0 or self.mean_output <= 0 or self.sigma < 0:
            raise UserError("--mean-prompt must be >= 0, --mean-output > 0 and --sigma >= 0")
        if self.max_batched_tokens < 1:
            raise UserError("--max-batched-tokens must be >= 1")


@dataclass
class TraceRequest:
    prompt: list[int]      # token ids; the shared prefix first, then ids no other request uses
    output_len: int        # tokens to generate (no EOS: the trace fixes the length)


def make_trace(p: TraceParams) -> list[TraceRequest]:
    """Lognormal prompt and output lengths (means as given), clipped so prompt + output <= max_len."""
    rng = random.Random(p.seed)
    user = lognormal_lengths(rng, p.requests, p.mean_prompt, p.sigma, 1, p.max_len - 1 - p.shared_prefix)
    outs = lognormal_lengths(rng, p.requests, p.mean_output, p.sigma, 1, p.max_len - 1)
    system = list(range(1, p.shared_prefix + 1))
    fresh = itertools.count(10**9)   # unique ids: no accidental prefix hit between requests
    trace = []
    for u, o in zip(user, outs):
        prompt = system + [next(fresh) for _ in range(u)]
        trace.append(TraceRequest(prompt, min(o, p.max_len - len(prompt))))
    return trace


# -- the paged side: the engine's own bookkeeping -----------------------------------------------------------
@dataclass
class StepSample:
    blocks_used: int       # blocks with refcount > 0
    blocks_shared: int     # of those, held by more than one sequence
    blocks_unshared: int   # what the same sequences would hold without sharing (sum of table lengths)
    tokens_held: int       # distinct tokens whose K/V sit in those blocks
    running: int


@dataclass
class SimResult:
    samples: list[StepSample] = field(default_factory=list)
    block_size: int = 16
    preemptions: int = 0
    failed: int = 0
    cow_copies: int = 0
    peak_blocks: int = 0
    prefix_hit_tokens: int = 0

    @property
    def steps(self) -> int:
        return len(self.samples)

    def utilization(self) -> float:
        """Tokens held / token capacity of the allocated blocks, averaged over steps (empty steps skipped)."""
        ratios = [s.tokens_held / (s.blocks_used * self.block_size) for s in self.samples if s.blocks_used]
        return sum(ratios) / len(ratios) if ratios else 0.0

    def peak_concurrency(self) -> int:
        return max((s.running for s in self.samples), default=0)

    def mean_concurrency(self) -> float:
        return sum(s.running for s in self.samples) / len(self.samples) if self.samples else 0.0

    def sharing_saving(self) -> float:
        """Fraction of blocks that sharing saves against the same sequences holding private copies."""
        unshared = sum(s.blocks_unshared for s in self.samples)
        return 1 - sum(s.blocks_used for s in self.samples) / unshared if unshared else 0.0


class BookkeepingRunner:
    """Stands in for the ModelRunner: no forward pass. The sequences whose chunk reaches their last token
    (exactly the ones the real runner samples) get logits over a one-token vocabulary."""

    def __init__(self, num_blocks: int, kv_groups=None):
        self.num_blocks = num_blocks
        self.kv_groups = kv_groups   # a model's layer groups (sliding-window release), as the real runner has

    def run(self, batch):
        import torch

        samplers = [seq for seq, n in batch.items if seq.num_computed + n == seq.num_tokens]
        return (torch.zeros(len(samplers), 1), samplers) if samplers else (None, [])


class PagedSim:
    """The real Engine (its step(), BlockPool and Scheduler) with the model runner swapped for bookkeeping."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_batched_tokens: int,
                 max_len: int, prefix_cache: bool = True, kv_groups=None):
        from pagedchat.engine import Engine, EngineConfig
        from pagedchat.engine.core.seams import NoModel

        config = EngineConfig(model="(simulated)", device="cpu", block_size=block_size, num_blocks=num_blocks,
                              max_num_seqs=max_seqs, max_num_batched_tokens=max_batched_tokens,
                              max_model_len=max_len, enable_prefix_cache=prefix_cache)
        # no tokenizer, no EOS, any int is a valid token id
        loaded = NoModel(max_model_len=max_len, vocab_size=2**62, path="(simulated)")
        self.engine = Engine(config, loaded=loaded, runner=BookkeepingRunner(num_blocks, kv_groups))
        self.pool, self.scheduler = self.engine.pool, self.engine.scheduler
        self.failed = 0

    def add(self, prompt: list[int], output_len: int, n: int = 1) -> str:
        from pagedchat.engine import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=output_len, n=n, ignore_eos=True)
        return self.engine.add_request(prompt, params)

    def run(self, on_step=None, max_idle: int = 3) -> None:
        """Drive the engine until the trace is done; a step where nothing ran (nothing scheduled, nothing
        finished) counts as idle."""
        idle = 0
        for events in self.engine.steps():
            self.failed += sum(1 for e in events if e.finish_reason == "error")
            idle = 0 if events or self.scheduler.running else idle + 1
            if idle > max_idle:
                raise RuntimeError("the scheduler made no progress (pool too small for the trace?)")
            if on_step is not None:
                on_step(self)

    def sample(self) -> StepSample:
        """Blocks in use, shared, and the distinct tokens they hold (a shared block counts once)."""
        seqs = list(self.scheduler.running) + list(self.scheduler.pins.values())
        unshared = sum(len(seq.block_table) for seq in seqs)
        used = self.pool.num_used
        if unshared == used:   # no block is in two tables: every computed token is held once
            return StepSample(used, 0, unshared, sum(seq.num_computed for seq in seqs), len(self.scheduler.running))
        bs = self.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}
        for seq in seqs:
            table, computed = seq.block_table, seq.num_computed
            k = computed // bs
            full.update(table[:k])
            if computed % bs and k < len(table):
                partial[table[k]] = max(partial.get(table[k], 0), computed % bs)
        tokens = len(full) * bs + sum(fill for block, fill in partial.items() if block not in full)
        shared = sum(1 for r in self.pool.ref_count if r > 1)
        return StepSample(used, shared, unshared, tokens, len(self.scheduler.running))

    @property
    def block_size(self) -> int:
        return self.pool.block_size


def simulate_paged(trace: list[TraceRequest], p: TraceParams, block_size: int | None = None,
                   prefix_cache: bool = True) -> SimResult:
    bs = block_size or p.block_size
    sim = PagedSim(p.pool_tokens // bs, bs, p.max_seqs or len(trace), p.max_batched_tokens, p.max_len,
                   prefix_cache)
    for r in trace:
        sim.add(r.prompt, r.output_len)
    result = SimResult(block_size=bs)
    # Sample right after each step's commit: the forward pass has written its K/V and nothing has finished
    # yet, so every request that held memory during the step is counted (even one that ends in it).
    commit = sim.scheduler.commit

    def commit_and_sample(batch) -> None:
        commit(batch)
        result.samples.append(sim.sample())

    sim.scheduler.commit = commit_and_sample
    sim.run()
    sim.pool.check_invariants(sim.scheduler.all_tables())
    assert sim.pool.num_used == 0, "blocks leaked after every request finished"
    result.preemptions = sim.scheduler.num_preemptions
    result.failed = sim.failed
    result.cow_copies = sim.pool.cow_copies
    result.peak_blocks = sim.pool.peak_used
    result.prefix_hit_tokens = sim.pool.prefix_hit_tokens
    return result


# -- the contiguous peer --------------------------------------------------------------------------------------
@dataclass
class ContiguousResult:
    reserved: list[int] = field(default_factory=list)     # tokens reserved per step (running x max_len)
    held: list[int] = field(default_factory=list)         # tokens whose K/V exist per step
    running: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.reserved)

    def utilization(self) -> float:
        ratios = [h / r for h, r in zip(self.held, self.reserved) if r]
        return sum(ratios) / len(ratios) if ratios else 0.0

    def peak_concurrency(self) -> int:
        return max(self.running, default=0)

    def mean_concurrency(self) -> float:
        return sum(self.running) / len(self.running) if self.running else 0.0


def simulate_contiguous(trace: list[TraceRequest], p: TraceParams) -> ContiguousResult:
    """Max-length reservation: a request takes max_len slots at admission and keeps them until it ends.
    Same step model as the engine: running requests first, then FCFS admission, one token budget."""
    slots = p.pool_tokens // p.max_len
    cap = min(slots, p.max_seqs or slots)
    waiting = [[len(r.prompt), 0, len(r.prompt) + r.output_len] for r in trace]  # [tokens, computed, end]
    waiting.reverse()   # pop() from the end = first come, first served
    running: list[list[int]] = []
    out = ContiguousResult()
    while waiting or running:
        budget = p.max_batched_tokens
        scheduled = []
        for r in running:
            if budget <= 0:
                break
            n = min(r[0] - r[1], budget)
            scheduled.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < cap:
            r = waiting.pop()
            n = min(r[0] - r[1], budget)
            running.append(r)
            scheduled.append((r, n))
            budget -= n
        for r, n in scheduled:
            r[1] += n
        # Sampled at the same point as the paged side: K/V written, nothing finished yet.
        out.reserved.append(len(running) * p.max_len)
        out.held.append(sum(r[1] for r in running))
        out.running.append(len(running))
        for r, n in scheduled:
            if r[1] == r[0]:        # reached its last token: it samples one more
                r[0] += 1
        running = [r for r in running if r[0] < r[2]]
    return out


# -- variants and forks ---------------------------------------------------------------------------------------
def variant_blocks(history: int, tail: int, n: int, block_size: int) -> tuple[int, int]:
    """Peak blocks and copy-on-write copies for one history decoded into n variants of `tail` tokens."""
    bs = block_size
    blocks = n * (-(-(history + tail) // bs)) + 4
    sim = PagedSim(blocks, bs, n, 1 << 30, history + tail + 1)
    sim.add(list(range(10**9, 10**9 + history)), tail, n=n)
    sim.run()
    return sim.pool.peak_used, sim.pool.cow_copies


@dataclass
class VariantsResult:
    n: int
    history: int
    tail: int
    blocks_one: int
    blocks_n: int
    ratio: float
    ideal_ratio: float         # distinct tokens: (history + n * tail) / (history + tail); no scheme beats it
    contiguous_ratio: float    # every variant reserves its own region: n
    cow_copies: int            # block copies to separate the n variants (<= n - 1: one per child)
    ratio_mid_block: float     # the same with a history ending mid-block (its partial block is copied n - 1 times)


def measure_variants(p: TraceParams) -> VariantsResult:
    """Fork a history that fills max-len with its tails into n variants; compare peak blocks with one."""
    tail = p.variant_tail
    history = max(1, p.max_len - tail)
    one, _ = variant_blocks(history, tail, 1, p.block_size)
    many, copies = variant_blocks(history, tail, p.variants, p.block_size)
    mid = max(1, history - p.block_size // 2)
    mid_ratio = variant_blocks(mid, tail, p.variants, p.block_size)[0] / variant_blocks(mid, tail, 1, p.block_size)[0]
    ideal = (history + p.variants * tail) / (history + tail)
    return VariantsResult(p.variants, history, tail, one, many, many / one, ideal, float(p.variants), copies,
                          mid_ratio)


def measure_fork_costs(p: TraceParams) -> list[dict]:
    """Copy-on-write copies per child as the forked history grows: the claim is <= 1, whatever the length."""
    rows = []
    n = max(2, p.variants)
    for history in FORK_HISTORIES:
        for h in (history, history + p.block_size // 2):   # block-aligned and mid-block histories
            _, copies = variant_blocks(h, 2, n, p.block_size)
            rows.append({"history": h, "children": n - 1, "cow_copies": copies,
                         "copies_per_child": copies / (n - 1)})
    return rows


def sweep_block_sizes(trace: list[TraceRequest], p: TraceParams, done: dict[int, SimResult]) -> list[dict]:
    """Tail waste against block-table size: small blocks waste less, big blocks mean shorter tables."""
    rows = []
    for bs in SWEEP_BLOCK_SIZES:
        if bs > p.pool_tokens:
            continue
        result = done.get(bs) or simulate_paged(trace, p, block_size=bs)
        util = result.utilization()
        rows.append({"block_size": bs, "kv_utilization": util, "tail_waste": 1 - util,
                     "max_table_entries": -(-p.max_len // bs), "peak_concurrency": result.peak_concurrency(),
                     "steps": result.steps, "preemptions": result.preemptions})
    return rows


# -- the whole benchmark --------------------------------------------------------------------------------------
def run_memory_bench(p: TraceParams, sweep: bool = True, fork_costs: bool = True,
                     plot: str | None = None) -> dict:
    p.check()
    start = time.perf_counter()
    trace = make_trace(p)
    paged = simulate_paged(trace, p)
    contiguous = simulate_contiguous(trace, p)
    variants = measure_variants(p)
    peak_p, peak_c = paged.peak_concurrency(), contiguous.peak_concurrency()
    result = {
        "kv_utilization": paged.utilization(),
        "contiguous_utilization": contiguous.utilization(),
        "peak_concurrency_paged": peak_p,
        "peak_concurrency_contiguous": peak_c,
        "concurrency_ratio": peak_p / peak_c if peak_c else None,
        "variants_memory_ratio": variants.ratio,
        "shared_prefix_saving": paged.sharing_saving(),
        "mean_concurrency_paged": paged.mean_concurrency(),
        "mean_concurrency_contiguous": contiguous.mean_concurrency(),
        "steps_paged": paged.steps,
        "steps_contiguous": contiguous.steps,
        "pool_blocks": p.pool_tokens // p.block_size,
        "contiguous_slots": p.pool_tokens // p.max_len,
        "peak_blocks_used": paged.peak_blocks,
        "preemptions": paged.preemptions,
        "failed_requests": paged.failed,
        "prefix_hit_tokens": paged.prefix_hit_tokens,
        "trace": {**asdict(p),
                  "mean_prompt_tokens": sum(len(r.prompt) for r in trace) / len(trace),
                  "mean_output_tokens": sum(r.output_len for r in trace) / len(trace)},
        "variants": asdict(variants),
    }
    if fork_costs:
        result["fork_cost"] = measure_fork_costs(p)
    if sweep:
        result["block_size_sweep"] = sweep_block_sizes(trace, p, {p.block_size: paged})
    result["elapsed_s"] = time.perf_counter() - start
    if plot:
        plot_memory(paged, contiguous, p, plot)
        result["plot"] = str(plot)
    return result


def plot_memory(paged: SimResult, contiguous: ContiguousResult, p: TraceParams, path: str) -> None:
    """Top: KV memory taken over time (paged blocks vs contiguous reservations) and what is really used;
    the blocks shared between requests shaded. Bottom: requests running at once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedchat.bench.common import save_figure

    bs, k = p.block_size, 1000
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 2])
    steps_p, steps_c = range(paged.steps), range(contiguous.steps)
    used = [s.blocks_used * bs / k for s in paged.samples]
    shared = [s.blocks_shared * bs / k for s in paged.samples]
    top.plot(steps_c, [r / k for r in contiguous.reserved], color="tab:red", lw=0.8,
             label="contiguous: reserved (max-len per request)")
    top.plot(steps_c, [h / k for h in contiguous.held], color="tab:red", lw=1, ls=":",
             label="contiguous: K/V actually written")
    top.plot(steps_p, used, color="tab:blue", lw=1.2, label=f"paged: blocks in use (block {bs})")
    top.plot(steps_p, [s.tokens_held / k for s in paged.samples], color="tab:blue", lw=1, ls=":",
             label="paged: K/V actually written")
    unshared = [s.blocks_unshared * bs / k for s in paged.samples]
    if any(u > b for u, b in zip(unshared, used)):
        top.fill_between(steps_p, used, unshared, color="tab:green", alpha=0.25, lw=0,
                         label="paged: saved by sharing (the same requests with private copies)")
        top.fill_between(steps_p, 0, shared, color="tab:green", alpha=0.8, lw=0,
                         label=f"paged: shared blocks ({p.shared_prefix}-token system prompt)")
    top.axhline(p.pool_tokens / k, color="grey", lw=0.8, ls="--", label="pool capacity")
    top.set_ylabel("KV memory (thousand token slots)")
    top.set_ylim(0, max(used + unshared + [p.pool_tokens / k]) * 1.75)   # headroom for the legend
    top.legend(fontsize=7, loc="upper right", ncol=2, framealpha=0.9)
    system = f"{p.shared_prefix} shared + " if p.shared_prefix else ""
    top.set_title(f"{p.requests} requests, max-len {p.max_len}, prompt {system}~{p.mean_prompt:g} + output "
                  f"~{p.mean_output:g} tokens, pool {p.pool_tokens} tokens", fontsize=9)
    bottom.plot(steps_c, contiguous.running, color="tab:red", lw=1.2, label="contiguous")
    bottom.plot(steps_p, [s.running for s in paged.samples], color="tab:blue", lw=1.2, label="paged")
    bottom.set_ylabel("requests running")
    bottom.set_xlabel("engine step")
    bottom.legend(fontsize=7, loc="upper right")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


def print_memory_report(r: dict) -> None:
    from pagedchat.bench.common import print_table

    t = r["trace"]
    print_table(
        f"KV memory: paged (block {t['block_size']}) vs contiguous max-len reservation — {t['requests']} "
        f"requests, pool {t['pool_tokens']} tokens",
        ["metric", "paged", "contiguous", "ratio"],
        [["KV utilization (time-avg)", r["kv_utilization"], r["contiguous_utilization"],
          r["kv_utilization"] / r["contiguous_utilization"] if r["contiguous_utilization"] else None],
         ["peak concurrent requests", r["peak_concurrency_paged"], r["peak_concurrency_contiguous"],
          r["concurrency_ratio"]],
         ["mean concurrent requests", r["mean_concurrency_paged"], r["mean_concurrency_contiguous"],
          r["mean_concurrency_paged"] / r["mean_concurrency_contiguous"]],
         ["steps to finish the trace", r["steps_paged"], r["steps_contiguous"],
          r["steps_contiguous"] / r["steps_paged"]]],
        caption=f"mean prompt {t['mean_prompt_tokens']:.0f} + output {t['mean_output_tokens']:.0f} tokens; "
                f"preemptions {r['preemptions']}; shared-prefix saving {r['shared_prefix_saving']:.1%}")
    v = r["variants"]
    print_table(f"{v['n']} variants of a {v['history']}-token history, {v['tail']} tokens each",
                ["", "paged", "ideal (distinct tokens)", "contiguous"],
                [["memory vs one", v["ratio"], v["ideal_ratio"], v["contiguous_ratio"]],
                 ["  (history ending mid-block)", v["ratio_mid_block"], None, None],
                 ["blocks copied", v["cow_copies"], None, None]])
    if "fork_cost" in r:
        print_table("fork cost as the history grows", ["history", "children", "blocks copied", "per child"],
                    [[f["history"], f["children"], f["cow_copies"], f["copies_per_child"]] for f in r["fork_cost"]])
    if "block_size_sweep" in r:
        print_table("block size: tail waste vs block-table size",
                    ["block size", "KV utilization", "tail waste", "table entries (max-len)", "peak concurrency"],
                    [[s["block_size"], s["kv_utilization"], s["tail_waste"], s["max_table_entries"],
                      s["peak_concurrency"]] for s in r["block_size_sweep"]])
    if r.get("plot"):
        print(f"plot: {r['plot']}")
