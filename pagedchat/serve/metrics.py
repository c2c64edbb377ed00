"""`GET /metrics`: the server's state and counters in Prometheus' text format (version 0.0.4).

Names are vLLM's with a `pagedchat:` prefix instead of `vllm:` (its dashboards carry over by changing the
prefix), plus the block pool's own gauges. Every sample carries a `model_name` label, as vLLM's do.

Request metrics are recorded on the engine loop thread (serve/async_engine.py) where a request is added,
produces tokens and ends; pool and queue figures are read from the engine when scraped. The page is rendered
on that same thread, between two steps, so one scrape is one consistent snapshot.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

from pagedchat.engine import EngineStats, RequestOutput, TokenEvent

PREFIX = "pagedchat:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")

# Seconds. Wide at both ends: a small model on a GPU answers in milliseconds, a large one on a CPU in minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Counts per bucket (upper bounds, ascending); rendered cumulative, as Prometheus wants them."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        i = bisect_left(self.buckets, value)     # the first bound >= value: `le` is inclusive
        if i < len(self.counts):
            self.counts[i] += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, total = [], 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            out.append((bound, total))
        return out + [(math.inf, self.count)]


@dataclass
class _Live:
    """A request between its arrival and its end."""
    arrival: float
    prompt_tokens: int
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)    # variant -> when its last tokens came


class ServerMetrics:
    """What the engine's own stats do not keep: per-request latencies, token counts, why requests ended.
    Touched only by the engine loop thread."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._live: dict[str, _Live] = {}

    # -- recording (the engine loop thread) ---------------------------------------------------------------
    def started(self, request_id: str, prompt_tokens: int, arrival: float) -> None:
        self._live[request_id] = _Live(arrival, prompt_tokens)

    def tokens(self, event: TokenEvent, now: float) -> None:
        """A step's new tokens of one variant. The prompt counts once its prefill has made the first token
        (as vLLM counts it); the inter-token latency is per variant, per step that gave it tokens (a verified
        draft gives several at once)."""
        live = self._live.get(event.request_id)
        if live is None or not event.token_ids:
            return
        self.generation_tokens += len(event.token_ids)
        if live.first_token_at is None:
            live.first_token_at = now
            self.prompt_tokens += live.prompt_tokens
            self.ttft.observe(now - live.arrival)
        last = live.last_token_at.get(event.index)
        if last is not None:
            self.itl.observe(now - last)
        live.last_token_at[event.index] = now

    def done(self, output: RequestOutput, now: float) -> None:
        """A request ended by itself: stop, length, or an error (too large for the pool)."""
        live = self._live.pop(output.request_id, None)
        if live is None:
            return
        first = output.outputs[0].finish_reason if output.outputs else None
        self._count_finish("error" if output.error else first)
        self.e2e.observe(now - live.arrival)

    def ended(self, request_id: str, reason: str | None) -> None:
        """A request stopped from outside: "abort" (its client went away), "error" (an engine failure), or
        None (never really started: its call was refused while being added) to forget it uncounted."""
        if self._live.pop(request_id, None) is not None and reason is not None:
            self._count_finish(reason)

    def _count_finish(self, reason: str | None) -> None:
        self.finished[reason if reason in self.finished else "stop"] += 1

    # -- the page -----------------------------------------------------------------------------------------
    def render(self, stats: EngineStats, model_name: str) -> str:
        pool = stats.pool_stats
        page = _Page({"model_name": model_name})
        page.gauge("num_requests_running", "Sequences in the running batch (each variant of a request counts).",
                   stats.running)
        page.gauge("num_requests_waiting", "Sequences waiting to be scheduled (new or preempted).", stats.waiting)
        page.counter("request_success_total", "Requests finished, by why they ended.", self.finished,
                     label="finished_reason")
        page.counter("prompt_tokens_total", "Prompt tokens of requests whose prefill is done (cached ones "
                                            "included).", self.prompt_tokens)
        page.counter("generation_tokens_total", "Tokens generated.", self.generation_tokens)
        page.histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                       self.ttft)
        page.histogram("inter_token_latency_seconds", "Time between two steps' tokens of one variant.",
                       self.itl)
        page.histogram("e2e_request_latency_seconds", "Time from a request's arrival to its end (requests "
                                                      "that ended by themselves).", self.e2e)
        page.gauge("kv_block_size", "Tokens per KV block.", pool.block_size)
        page.gauge("kv_blocks_total", "KV blocks in the pool.", pool.num_blocks)
        page.gauge("kv_blocks_used", "KV blocks held by sequences (refcount > 0).", pool.used)
        page.gauge("kv_blocks_cached", "Free KV blocks still holding a hashed prefix that can be hit.",
                   pool.cached)
        page.gauge("kv_blocks_shared", "KV blocks held by more than one sequence (refcount > 1).", pool.shared)
        page.gauge("kv_cache_usage_perc", "Fraction of the KV blocks in use (1 = full).",
                   pool.used / pool.num_blocks if pool.num_blocks else 0.0)
        page.counter("num_preemptions_total", "Sequences preempted for lack of KV blocks.", stats.preemptions)
        page.counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                     pool.prefix_query_tokens)
        page.counter("prefix_cache_hits_total", "Prompt tokens whose KV came from the prefix cache (any tier).",
                     pool.prefix_hit_tokens)
        page.gauge("prefix_cache_hit_rate", "prefix_cache_hits_total / prefix_cache_queries_total.",
                   pool.prefix_hit_rate)
        return page.text()


class _Page:
    """Prometheus text format 0.0.4: per family a HELP and a TYPE line, then its samples."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.lines: list[str] = []

    def gauge(self, name: str, help: str, value: float) -> None:
        self._family(name, "gauge", help)
        self._sample(name, value)

    def counter(self, name: str, help: str, value, label: str | None = None) -> None:
        """value: a number, or with `label` {label value: number}, one sample each."""
        self._family(name, "counter", help)
        if label is None:
            self._sample(name, value)
            return
        for label_value, n in value.items():
            self._sample(name, n, {label: label_value})

    def histogram(self, name: str, help: str, h: Histogram) -> None:
        self._family(name, "histogram", help)
        for bound, count in h.cumulative():
            self._sample(f"{name}_bucket", count, {"le": _number(float(bound))})
        self._sample(f"{name}_sum", h.sum)
        self._sample(f"{name}_count", h.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def _family(self, name: str, kind: str, help: str) -> None:
        self.lines.append(f"# HELP {PREFIX}{name} {_escape_help(help)}")
        self.lines.append(f"# TYPE {PREFIX}{name} {kind}")

    def _sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        pairs = ",".join(f'{k}="{_escape_label(v)}"' for k, v in {**self.labels, **(labels or {})}.items())
        self.lines.append(f"{PREFIX}{name}{{{pairs}}} {_number(value)}")


def _number(value: float) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
