"""`pagedchat bench serve`: latency under an offered load through pagedchat's own server, paged against
up-front reservation on the same engine, pool and model.

Two `pagedchat serve` subprocesses run side by side on loopback: `--kv-allocation paged` and
`--kv-allocation reserved` (every request takes the blocks of prompt + max_tokens at admission and shares
none, as a contiguous cache must). At each offered rate the same seeded requests (pagedchat.bench.load) go to
one server, then the other; the order alternates from rate to rate, so drift on a shared machine hits both.
While a rate runs, /v1/pagedchat/stats is polled for the KV blocks in use, preemptions and prefix hits.

The headline: for each mode the highest rate up to which every rate it ran completed all its requests with
p99 TTFT under the target ("sustained"), and paged / reserved. By default each mode's limit is searched for
(LimitSearch: the rate doubles until one is not sustained, then the gap is halved), so the headline is never
capped by a sweep that stopped below a limit; --rates runs a fixed sweep instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pagedchat.bench.common import percentile, ratio
from pagedchat.bench.load import Client, RequestResult, Workload, make_conversations, system_prompt
from pagedchat.errors import UserError

MODES = ("paged", "reserved")
SERVED_NAME = "bench"
STATS_EVERY_S = 0.2


@dataclass
class SweepParams:
    rates: tuple[float, ...] = ()                    # offered requests per second; () = search each mode's limit
    search_from: float = 1.0                         # the search's first rate
    search_to: float = 512.0                         # the highest rate the search offers
    search_steps: int = 3                            # gap halvings once a rate is not sustained
    search_seconds: float = 20.0                     # arrivals each searched rate offers at least (see _searched)
    modes: tuple[str, ...] = MODES
    pool_blocks: int = 192                           # KV pool of each server, in blocks
    block_size: int = 16
    ttft_target_s: float = 2.0                        # p99 TTFT a sustained rate stays under
    max_seconds: float = 60.0                        # arrivals per rate stop after this (time bound)
    timeout_s: float = 60.0                          # per request
    threads: int = 1                                 # torch threads of each server (0 = torch's default)
    device: str = "cpu"
    max_context: int | None = None

    def check(self) -> None:
        if self.rates and min(self.rates) <= 0:
            raise UserError("--rates wants positive requests per second, e.g. 1,2,4")
        if not 0 < self.search_from <= self.search_to:
            raise UserError("--max-rate must be at least the search's first rate (1 request/s)")
        if any(m not in MODES for m in self.modes) or not self.modes:
            raise UserError(f"--modes wants a comma-separated subset of {', '.join(MODES)}")
        if self.pool_blocks < 1 or self.ttft_target_s <= 0 or self.max_seconds <= 0 or self.timeout_s <= 0:
            raise UserError("--pool-blocks, --ttft-target, --max-seconds and --timeout must be positive")


# -- the servers ------------------------------------------------------------------------------------------------
class ServerProcess:
    """`pagedchat serve` in its own process group on 127.0.0.1 (any free port); stop() kills the group."""

    NO_TIERS = ("--kv-ram", "0", "--kv-disk", "0")   # both modes get exactly the pool: no tier below it

    def __init__(self, model: Path, mode: str, p: SweepParams, log_dir: Path, tiers: tuple[str, ...] = NO_TIERS,
                 env: dict | None = None, name: str | None = None):
        self.mode, self.log = mode, log_dir / f"serve-{name or mode}.log"
        dtype = "float32" if p.device == "cpu" else "bfloat16"
        cmd = [sys.executable, "-c", "from pagedchat.cli import main; main()", "serve", "-m", str(model),
               "--host", "127.0.0.1", "--port", "0", "--served-model-name", SERVED_NAME, "--device", p.device,
               "--dtype", dtype, "--block-size", str(p.block_size), "--kv-allocation", mode,
               "--kv-memory", str(p.pool_blocks * bytes_per_block(model, p.block_size, dtype)),
               *tiers]
        if p.max_context:
            cmd += ["--max-context", str(p.max_context)]
        env = dict(env or os.environ, TOKENIZERS_PARALLELISM="false")
        if p.threads > 0:   # 0 = torch's default
            env.update(OMP_NUM_THREADS=str(p.threads), MKL_NUM_THREADS=str(p.threads))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        self.url: str | None = None

    def wait_ready(self, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(r"pagedchat serve: (http://127\.0\.0\.1:\d+/v1)", self.log.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
        raise UserError(f"the {self.mode} server did not start: {' | '.join(tail) or 'no output'}")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL if it lingers: no server outlives the benchmark."""
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue


def bytes_per_block(model: Path, block_size: int, dtype: str) -> int:
    """KV bytes of one block of this model (what the server divides --kv-memory by)."""
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def check_loopback(url: str) -> str:
    if not re.match(r"^http://(127\.0\.0\.1|localhost)(:\d+)?(/|$)", url):
        raise UserError(f"--url must point at this machine (http://127.0.0.1:PORT/v1), got {url!r}")
    return url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"


# -- one rate against one server --------------------------------------------------------------------------------
async def _stats(http, base: str) -> dict:
    response = await http.get(base + "/pagedchat/stats")
    response.raise_for_status()
    return response.json()


async def _wait_idle(http, base: str, timeout_s: float = 30) -> dict:
    """Stats once the server has nothing running or waiting (the previous rate's streams are closed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await _stats(http, base)
        if not stats["running"] and not stats["waiting"] or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(STATS_EVERY_S)


async def _poll_blocks(http, base: str, samples: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            samples.append((await _stats(http, base))["pool"]["used"])
        except Exception:   # a missed sample is not a failed request
            pass
        try:
            await asyncio.wait_for(stop.wait(), STATS_EVERY_S)
        except TimeoutError:
            pass


async def run_rate(base: str, w: Workload, p: SweepParams, rate: float, rate_index: int, vocab: int, decode,
                   done) -> dict:
    import httpx

    conversations = offered_conversations(w, p, rate, rate_index, vocab)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(p.timeout_s), limits=limits) as http:
        before = await _wait_idle(http, base)
        client = Client(http, base, SERVED_NAME, w, system_prompt(w, vocab), decode, p.timeout_s)
        samples: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.ensure_future(_poll_blocks(http, base, samples, stop))
        t0 = time.perf_counter()
        try:
            per_conv = await asyncio.gather(*(client.conversation(c, t0, done) for c in conversations))
        finally:
            stop.set()
            await poller
        elapsed = time.perf_counter() - t0
        after = await _wait_idle(http, base)
    offered = sum(len(c.turns) for c in conversations)
    return summarize(rate, offered, [r for rs in per_conv for r in rs], elapsed, samples, before, after, p)


def summarize(rate: float, offered: int, results: list[RequestResult], elapsed: float, samples: list[int],
              before: dict, after: dict, p: SweepParams) -> dict:
    ok = [r for r in results if r.ok]
    ttft, e2e = [r.ttft_s for r in ok], [r.e2e_s for r in ok]
    itl = [x for r in ok for x in r.itl_s]
    failed = offered - len(ok)      # turns never sent after an earlier turn failed count as failed too
    hit = after["pool"]["prefix_hit_tokens"] - before["pool"]["prefix_hit_tokens"]
    query = after["pool"]["prefix_query_tokens"] - before["pool"]["prefix_query_tokens"]
    row = {
        "rate": rate, "offered": offered, "completed": len(ok), "failed": failed,
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / elapsed if elapsed > 0 else None,
        "duration_s": elapsed,
        "kv_blocks_peak": max(samples, default=None),
        "kv_blocks_mean": sum(samples) / len(samples) if samples else None,
        "preemptions": after["preemptions"] - before["preemptions"],
        "prefix_hit_rate": hit / query if query else 0.0,
    }
    row["sustained"] = failed == 0 and row["ttft_p99_s"] is not None and row["ttft_p99_s"] <= p.ttft_target_s
    return row


class LimitSearch:
    """One mode's search for the highest rate it sustains: from `start`, the rate doubles until one is not
    sustained, then the gap between the highest sustained and the lowest not sustained rate is halved
    (geometrically) `steps` times: the limit is bracketed to a factor 2 ** (1 / 2 ** steps) (1.09 at 3 steps)
    in about log2(limit / start) + steps + 1 rates. A first rate not sustained halves instead, down to
    start / 8. Past `top` the search stops: the limit is above it."""

    def __init__(self, start: float, top: float, steps: int):
        self.start, self.top, self.steps = start, top, steps
        self.low: float | None = None    # the highest rate sustained
        self.high: float | None = None   # the lowest rate not sustained
        self.narrowed = 0

    def next_rate(self) -> float | None:
        """The next rate to offer, or None: the search is over."""
        if self.high is None:
            rate = self.start if self.low is None else self.low * 2
            return rate if rate <= self.top else None
        if self.low is None:
            rate = self.high / 2
            return rate if rate >= self.start / 8 else None
        if self.narrowed >= self.steps:
            return None
        return float(f"{math.sqrt(self.low * self.high):.3g}")

    def record(self, rate: float, sustained: bool) -> None:
        if self.low is not None and self.high is not None:
            self.narrowed += 1
        if sustained:
            self.low = rate if self.low is None else max(self.low, rate)
        else:
            self.high = rate if self.high is None else min(self.high, rate)


def sustained_rate(rows: list[dict]) -> float | None:
    """The highest rate up to which every rate of the sweep was sustained (the knee of the curve)."""
    best = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        if not row["sustained"]:
            break
        best = row["rate"]
    return best


# -- the sweep --------------------------------------------------------------------------------------------------
def run_serve_bench(model: Path, model_name: str, w: Workload, p: SweepParams, url: str | None = None,
                    show_progress: bool = True) -> dict:
    """Start a server per mode (or use `url`, one mode), run every rate against each, alternating."""
    p.check()
    tokenizer = _tokenizer(model, w)
    vocab = len(tokenizer)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rows: dict[str, list[dict]] = {m: [] for m in p.modes}
    servers: dict[str, dict] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="pagedchat-bench-serve-") as tmp:
        bases = {p.modes[0]: check_loopback(url)} if url else _start_servers(model, p, Path(tmp), stack, servers)
        total = sum(_offered(w, p, r, i, vocab) for i, r in enumerate(p.rates)) * len(bases) if p.rates else None
        progress, task = _progress(stack, show_progress, total)
        searches = {m: LimitSearch(p.search_from, p.search_to, p.search_steps) for m in p.modes}
        for i, offers in enumerate(_rounds(p, searches)):
            for mode, rate in (offers if i % 2 == 0 else offers[::-1]):
                if progress is not None:
                    progress.update(task, description=f"{mode:>8} {rate:g} req/s")
                advance = (lambda: progress.advance(task)) if progress is not None else (lambda: None)
                row = asyncio.run(run_rate(bases[mode], w, p, rate, i, vocab, decode, advance))
                rows[mode].append(row)
                searches[mode].record(rate, row["sustained"])
        pool = asyncio.run(_pool_of(next(iter(bases.values()))))
    modes = {m: {"sustained_rate": sustained_rate(r), "failed": sum(x["failed"] for x in r), "rows": r}
             for m, r in rows.items()}
    if not p.rates:
        for m, search in searches.items():
            modes[m]["first_unsustained_rate"] = search.high
    paged, reserved = (modes.get(m, {}).get("sustained_rate") for m in MODES)
    return {"benchmark": "serve", "model": model_name, "workload": asdict(w), "sweep": asdict(p),
            "pool": pool, "ttft_target_s": p.ttft_target_s, "sustained_ratio": ratio(paged, reserved),
            "modes": modes, "servers": servers, "notes": _notes(modes, p)}


def _rounds(p: SweepParams, searches: dict[str, LimitSearch]):
    """Each round's (mode, rate) offers: every mode at each rate of a fixed sweep, or each mode's next search
    rate (a round's modes take turns going first, so drift on a shared machine hits both)."""
    if p.rates:
        yield from ([(m, rate) for m in p.modes] for rate in p.rates)
        return
    while offers := [(m, r) for m, r in ((m, s.next_rate()) for m, s in searches.items()) if r is not None]:
        yield offers


def _start_servers(model: Path, p: SweepParams, tmp: Path, stack: ExitStack, servers: dict) -> dict[str, str]:
    procs = [ServerProcess(model, mode, p, tmp) for mode in p.modes]   # they load their models in parallel
    for proc in procs:
        stack.callback(proc.stop)
    bases = {}
    for proc in procs:
        bases[proc.mode] = proc.wait_ready()
        servers[proc.mode] = {"pid": proc.proc.pid, "url": proc.url}
    return bases


def offered_conversations(w: Workload, p: SweepParams, rate: float, index: int, vocab: int):
    """The rate's conversations that arrive within --max-seconds; the first always does (a rate whose first
    arrival falls after the window would otherwise measure nothing)."""
    conversations = make_conversations(_searched(w, p, rate), rate, vocab, index)
    return conversations[:1] + [c for c in conversations[1:] if c.start_s <= p.max_seconds]


def _searched(w: Workload, p: SweepParams, rate: float) -> Workload:
    """A searched rate offers at least search_seconds of arrivals. Why: with a fixed count (--requests 60) a high
    rate is one burst that any server answers within the TTFT target once, and the search then "sustained"
    512 req/s on both modes; a rate is sustained only if a server keeps up with it for a while."""
    if p.rates:
        return w
    return replace(w, requests=max(w.requests, math.ceil(rate * min(p.search_seconds, p.max_seconds))))


def _offered(w: Workload, p: SweepParams, rate: float, index: int, vocab: int) -> int:
    return sum(len(c.turns) for c in offered_conversations(w, p, rate, index, vocab))


def _progress(stack: ExitStack, show: bool, total: int):
    if not show:
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                            TimeElapsedColumn(), console=Console(stderr=True), transient=True))
    return progress, progress.add_task("starting", total=total)


async def _pool_of(base: str) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        pool = (await _stats(http, base))["pool"]
    return {"num_blocks": pool["num_blocks"], "block_size": pool["block_size"],
            "capacity_tokens": pool["capacity_tokens"]}


def _tokenizer(model: Path, w: Workload):
    """The model's tokenizer: prompts are drawn as token ids, and chat messages need their text."""
    from transformers import AutoTokenizer

    from pagedchat.bench.common import quiet_transformers

    quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except Exception:
        raise UserError(f"bench serve needs a model with a tokenizer (the server streams text); {model} has "
                        f"none: leave out -m to use the built-in bench model") from None
    if w.kind == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"--workload chat needs a model with a chat template; {model} has none")
    return tokenizer


def _notes(modes: dict, p: SweepParams) -> list[str]:
    notes = []
    top = max(p.rates) if p.rates else None
    for mode, m in modes.items():
        if m["sustained_rate"] is None:
            lowest = "lowest rate of the sweep: lower --rates" if p.rates else f"{p.search_from / 8:g} req/s"
            notes.append(f"{mode}: not even the {lowest} was sustained")
        elif p.rates and m["sustained_rate"] == top:
            notes.append(f"{mode}: sustained the highest rate of the sweep: its limit is higher (raise --rates)")
        elif not p.rates and m.get("first_unsustained_rate") is None:
            notes.append(f"{mode}: sustained {m['sustained_rate']:g} req/s, the search's top: its limit is higher "
                         f"(raise --max-rate)")
    return notes


# -- output -----------------------------------------------------------------------------------------------------
def print_serve_report(result: dict) -> None:
    from pagedchat.bench.common import fmt, print_table

    w, pool = result["workload"], result["pool"]
    for mode, m in result["modes"].items():
        rows = [[r["rate"], f"{r['completed']}/{r['offered']}", r["ttft_p50_s"], r["ttft_p99_s"], r["itl_p50_s"],
                 r["itl_p99_s"], r["e2e_p50_s"], r["output_tokens_per_s"], r["kv_blocks_peak"], r["kv_blocks_mean"],
                 r["preemptions"], r["prefix_hit_rate"], "yes" if r["sustained"] else "no"] for r in m["rows"]]
        print_table(f"{mode}: {w['kind']} workload, pool {pool['num_blocks']} blocks x {pool['block_size']}",
                    ["req/s", "done", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50", "out tok/s",
                     "KV peak", "KV mean", "preempt", "prefix hit", "sustained"], rows)
    sustained = ", ".join(f"{m} {fmt(v['sustained_rate'])} req/s" + (
        f" ({fmt(v['first_unsustained_rate'])} not)" if v.get("first_unsustained_rate") else "")
        for m, v in result["modes"].items())
    print(f"sustained with p99 TTFT <= {result['ttft_target_s']:g} s and no failures: {sustained}; "
          f"paged / reserved = {fmt(result['sustained_ratio'])}")
    for note in result["notes"]:
        print(f"note: {note}")


def plot_serve(results: list[dict], path: str) -> None:
    """p99 TTFT and output tokens/s against offered load, one column per workload, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedchat.bench.common import save_figure

    fig, axes = plt.subplots(2, len(results), figsize=(5.2 * len(results), 6), squeeze=False, sharex="col")
    colors = {"paged": "tab:blue", "reserved": "tab:red"}
    for col, result in enumerate(results):
        top, bottom = axes[0][col], axes[1][col]
        for mode, m in result["modes"].items():
            ran = sorted(m["rows"], key=lambda r: r["rate"])   # (a search's rates come out of order)
            rates = [r["rate"] for r in ran]
            top.plot(rates, [r["ttft_p99_s"] for r in ran], "o-", color=colors[mode], label=mode)
            bottom.plot(rates, [r["output_tokens_per_s"] for r in ran], "o-", color=colors[mode], label=mode)
            if m["sustained_rate"] is not None:
                top.axvline(m["sustained_rate"], color=colors[mode], ls=":", lw=1)
        top.axhline(result["ttft_target_s"], color="gray", ls="--", lw=1, label="p99 target")
        top.set_yscale("log")
        top.set_title(f"{result['workload']['kind']} workload: paged / reserved = "
                      f"{result['sustained_ratio']:.2g}x" if result["sustained_ratio"] else result["workload"]["kind"])
        top.set_ylabel("p99 TTFT (s)")
        bottom.set_ylabel("output tokens/s")
        bottom.set_xlabel("offered load (requests/s)")
        top.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
