"""`pagedchat serve`'s GET /metrics: valid Prometheus text, and numbers that move by what the requests did:
token counters by the responses' usage, latency histograms by one per request, prefix-cache hits when a prompt
comes back, the KV pool's gauges as the engine's own stats, an abandoned stream as an abort. On the shipped
demo model. prometheus_client's parser (when installed) checks the format as well as the parser here."""

from __future__ import annotations

import importlib.resources
import math
import re
import time

import httpx
import pytest

from serve_util import serving_model

DEMO = importlib.resources.files("pagedchat") / "assets" / "demo-chat"
KEY = "metrics-key"
NAME = "demo"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a prompt over several KV blocks (16 tokens each), so that sending it again hits the prefix cache
LONG = "paged attention keeps every branch of every conversation in one pool of blocks. " * 4

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"(?:,|$)')


@pytest.fixture(scope="module")
def server():
    with serving_model(DEMO, NAME, api_key=KEY) as (url, engine):
        yield url.removesuffix("/v1"), engine


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels but model_name): value}, after checking the page line by line: every sample
    belongs to a family announced by HELP and TYPE lines, and carries model_name."""
    r = httpx.get(server[0] + "/metrics", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples, types = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, value = match["name"], float(match["value"])
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no TYPE line"
        labels = dict((m["key"], m["value"]) for m in LABEL.finditer(match["labels"] or ""))
        assert labels.pop("model_name") == NAME
        samples[(name, frozenset(labels.items()))] = value
    check_with_prometheus_client(r.text)
    return samples


def check_with_prometheus_client(text: str) -> None:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["pagedchat:prompt_tokens"].type == "counter"
    assert families["pagedchat:time_to_first_token_seconds"].type == "histogram"
    assert families["pagedchat:kv_blocks_total"].type == "gauge"


def value(samples, name: str, **labels) -> float:
    return samples[(f"pagedchat:{name}", frozenset(labels.items()))]


def delta(before, after, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def chat(server, content: str, **kw) -> dict:
    r = httpx.post(server[0] + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server) -> dict:
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(server)
        idle = value(samples, "num_requests_running") == value(samples, "num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_the_page_names_every_metric(server):
    samples = scrape(server)
    names = {name for name, _ in samples}
    for family in ("num_requests_running", "num_requests_waiting", "kv_blocks_total", "kv_blocks_used",
                   "kv_blocks_cached", "kv_blocks_shared", "kv_cache_usage_perc", "kv_block_size",
                   "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                   "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_hit_rate"):
        assert f"pagedchat:{family}" in names, family
    for reason in ("stop", "length", "abort", "error"):
        value(samples, "request_success_total", finished_reason=reason)
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
                         if name == f"pagedchat:{histogram}_bucket")
        assert buckets[-1][0] == math.inf and buckets[-1][1] == value(samples, f"{histogram}_count")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)      # cumulative
    assert value(samples, "kv_blocks_total") == server[1].pool_stats().num_blocks
    assert value(samples, "kv_block_size") == server[1].pool_stats().block_size


def test_counters_grow_by_what_the_requests_did(server):
    before = wait_idle(server)
    replies = [chat(server, "what is 2 + 3?", max_tokens=6), chat(server, "name a colour", max_tokens=9),
               chat(server, "count to three", max_tokens=1)]
    after = wait_idle(server)
    usage = [r["usage"] for r in replies]
    assert delta(before, after, "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta(before, after, "generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(before, after, f"{histogram}_count") == len(replies)
        assert delta(before, after, f"{histogram}_sum") > 0
    # one latency per token after the first (no speculation: every step gives one token)
    assert server[1].speculator is None
    assert delta(before, after, "inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usage)
    reasons = [r["choices"][0]["finish_reason"] for r in replies]
    for reason in ("stop", "length"):
        assert delta(before, after, "request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta(before, after, "request_success_total", finished_reason="abort") == 0


def test_a_prompt_sent_again_hits_the_prefix_cache(server):
    first = chat(server, LONG, max_tokens=2)
    before = wait_idle(server)
    again = chat(server, LONG, max_tokens=2)
    after = wait_idle(server)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * (first["usage"]["prompt_tokens"] // 16 - 1) > 0
    assert delta(before, after, "prefix_cache_hits_total") == cached
    assert delta(before, after, "prefix_cache_queries_total") >= cached
    rate = value(after, "prefix_cache_hit_rate")
    assert rate == pytest.approx(value(after, "prefix_cache_hits_total") / value(after, "prefix_cache_queries_total"))


def test_pool_gauges_are_the_engines_stats(server):
    chat(server, LONG, max_tokens=2)
    samples = wait_idle(server)
    pool = server[1].pool_stats()      # idle: nothing changes the pool between the scrape and this read
    assert value(samples, "kv_blocks_used") == pool.used == 0          # the server pins nothing between calls
    assert value(samples, "kv_blocks_cached") == pool.cached > 0       # the prompt's blocks wait to be hit
    assert value(samples, "kv_blocks_shared") == pool.shared
    assert value(samples, "kv_cache_usage_perc") == pool.used / pool.num_blocks
    assert value(samples, "num_preemptions_total") == server[1].stats().preemptions


def test_an_abandoned_stream_counts_as_an_abort(server):
    before = wait_idle(server)
    body = {"model": NAME, "messages": [{"role": "user", "content": "tell me a long story"}], "stream": True,
            "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break                  # the first token has come: hang up
    after = wait_idle(server)
    assert delta(before, after, "request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "time_to_first_token_seconds_count") == 1
    assert delta(before, after, "e2e_request_latency_seconds_count") == 0     # only requests that ended themselves


def test_the_key_is_required(server):
    r = httpx.get(server[0] + "/metrics", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
