"""`pagedchat bench serve` and the up-front reservation mode it measures against.

The engine test pins down what "reserved" means (blocks for prompt + max_tokens at admission, nothing shared,
the same tokens); the end-to-end test runs a tiny sweep through two real server subprocesses and checks the
JSON's shape and that no server outlives it. No timing is asserted anywhere: latency numbers come from the
benchmark, not from tests."""

import json
import os

import pytest

from cli_util import invoke
from fake_runner import fake_engine
from pagedchat.engine import SamplingParams


def _admit(kv_allocation: str, prompt: list[int], max_tokens: int, num_blocks: int = 64):
    engine, _ = fake_engine(num_blocks=num_blocks, block_size=8, kv_allocation=kv_allocation)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    engine.step()      # admission + prefill
    return engine, rid


def test_reserved_admission_holds_the_whole_reply_and_paged_only_the_prompt():
    prompt = [3 + i % 20 for i in range(20)]        # 20 tokens: 3 blocks of 8
    paged, _ = _admit("paged", prompt, max_tokens=100)
    reserved, _ = _admit("reserved", prompt, max_tokens=100)
    assert paged.pool.num_used == 3
    assert reserved.pool.num_used == -(-(20 + 100) // 8)      # 15 blocks, before a single reply token
    assert not reserved.pool.enable_prefix_cache


def test_reserved_gives_the_same_tokens_and_frees_everything():
    prompts = [[3 + (i * n) % 20 for i in range(n)] for n in (5, 17, 30)]
    outputs = {}
    for mode in ("paged", "reserved"):
        engine, _ = fake_engine(num_blocks=40, block_size=8, kv_allocation=mode)
        results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        outputs[mode] = [r.outputs[0].token_ids for r in results]
        assert engine.pool.num_used == 0
    assert outputs["paged"] == outputs["reserved"]


def test_reserved_request_larger_than_the_pool_fails_alone():
    engine, rid = _admit("reserved", list(range(3, 13)), max_tokens=200, num_blocks=16)   # 210 tokens > 16 x 8
    out = engine.pop_output(rid)
    assert out.finished and "KV memory" in out.error and engine.pool.num_used == 0


def test_serve_rejects_an_unknown_allocation(model, capsys, monkeypatch):
    code, out, err = invoke(["serve", "-m", str(model), "--port", "0", "--device", "cpu", "--kv-allocation",
                             "contiguous"], capsys=capsys, monkeypatch=monkeypatch)
    assert code != 0 and "--kv-allocation must be paged or reserved" in err and "Traceback" not in out + err


def test_bench_serve_tiny_sweep_end_to_end(capsys, monkeypatch):
    code, out, err = invoke(["bench", "serve", "--rates", "3", "--requests", "3", "--max-seconds", "5",
                             "--mean-prompt", "8", "--mean-output", "3", "--max-tokens", "16", "--pool-blocks", "32",
                             "--timeout", "60", "--json"], capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0, err
    result = json.loads(out)
    assert set(result["modes"]) == {"paged", "reserved"}
    for mode in result["modes"].values():
        assert {"sustained_rate", "failed", "rows"} <= set(mode)
        (row,) = mode["rows"]
        assert row["rate"] == 3 and row["offered"] == row["completed"] + row["failed"]
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
                    "output_tokens_per_s", "kv_blocks_peak", "kv_blocks_mean", "preemptions", "prefix_hit_rate"):
            assert key in row
    assert "sustained_ratio" in result and result["pool"]["num_blocks"] == 32
    for server in result["servers"].values():          # every server it started is gone
        assert server["url"].startswith("http://127.0.0.1:")
        with pytest.raises(ProcessLookupError):
            os.kill(server["pid"], 0)


def test_bench_serve_refuses_other_machines(capsys, monkeypatch):
    code, out, err = invoke(["bench", "serve", "--url", "http://example.com:8000/v1", "--modes", "paged",
                             "--rates", "1"], capsys=capsys, monkeypatch=monkeypatch)
    assert code != 0 and "127.0.0.1" in err + out and "Traceback" not in err + out


def test_every_rate_offers_at_least_one_request_within_the_window():
    from pagedchat.bench.load import Workload
    from pagedchat.bench.serve import SweepParams, offered_conversations

    sweep = SweepParams(rates=(0.01,), max_seconds=1)       # first arrival expected ~100 s in
    for kind in ("lognormal", "chat"):
        conversations = offered_conversations(Workload(kind=kind, requests=20), sweep, 0.01, 0, vocab=100)
        assert len(conversations) == 1


@pytest.mark.parametrize("limit", [0.05, 0.3, 1, 5.5, 13, 100, 600])
def test_the_search_brackets_each_limit_to_a_ninth(limit):
    """Whatever the limit (below the first rate, between any two, past the top), the search ends with the
    highest rate it found sustained and the lowest it found not sustained at most 2 ** (1/8) apart, or says
    the limit is outside what it may offer."""
    from pagedchat.bench.serve import LimitSearch

    search, offered = LimitSearch(start=1, top=512, steps=3), []
    while (rate := search.next_rate()) is not None:
        offered.append(rate)
        search.record(rate, rate <= limit)
        assert len(offered) < 20
    low, high = search.low, search.high
    if limit < 1 / 8:
        assert low is None and high <= 1 / 4
    elif limit >= 512:
        assert high is None and low == 512
    else:
        assert low <= limit < high and high / low <= 2 ** (1 / 8) * 1.01, (offered, low, high)
    assert len(offered) <= 15


def test_the_search_runs_each_mode_to_its_own_limit_taking_turns(monkeypatch):
    """Without --rates each mode is offered rates until its own limit is found: both modes report a limit
    and the rate that broke it (never capped by a sweep), and in every round the modes take turns going
    first."""
    from pagedchat.bench import serve as bench_serve
    from pagedchat.bench.load import Workload

    limits, order = {"paged": 9.0, "reserved": 3.0}, []

    async def fake_rate(base, w, p, rate, index, vocab, decode, done):
        order.append((index, base))
        ok = rate <= limits[base]
        return {"rate": rate, "sustained": ok, "failed": 0 if ok else 1, "ttft_p99_s": 0.1 if ok else 9.0}

    monkeypatch.setattr(bench_serve, "run_rate", fake_rate)
    monkeypatch.setattr(bench_serve, "_start_servers", lambda model, p, tmp, stack, servers: {m: m for m in p.modes})
    monkeypatch.setattr(bench_serve, "_tokenizer", lambda model, w: ["t"] * 10)

    async def pool(base):
        return {"num_blocks": 8, "block_size": 16, "capacity_tokens": 128}

    monkeypatch.setattr(bench_serve, "_pool_of", pool)
    result = bench_serve.run_serve_bench(None, "fake", Workload(), bench_serve.SweepParams(), show_progress=False)
    paged, reserved = result["modes"]["paged"], result["modes"]["reserved"]
    assert 8 <= paged["sustained_rate"] <= 9 < paged["first_unsustained_rate"] <= 9 * 2 ** (1 / 8)
    assert 2.5 <= reserved["sustained_rate"] <= 3 < reserved["first_unsustained_rate"]
    assert result["sustained_ratio"] == paged["sustained_rate"] / reserved["sustained_rate"] and not result["notes"]
    firsts = [base for i, (index, base) in enumerate(order) if i == 0 or order[i - 1][0] != index]
    both = sum(1 for index in {i for i, _ in order} if sum(1 for j, _ in order if j == index) == 2)
    assert firsts[:2] == ["paged", "reserved"] and both >= 3


@pytest.mark.parametrize("rate", [1, 16, 256])
def test_a_searched_rate_offers_a_load_that_lasts(rate):
    """A rate the search offers lasts search_seconds at least, whatever --requests says (a burst of 60 requests
    at 512 req/s passed for 'sustained' on both modes); a fixed sweep keeps its count."""
    from pagedchat.bench.load import Workload
    from pagedchat.bench.serve import SweepParams, offered_conversations

    w = Workload(requests=60)
    searched = offered_conversations(w, SweepParams(search_seconds=20), rate, 0, vocab=100)
    assert len(searched) >= max(60, 20 * rate) * 0.95 and searched[-1].start_s >= 20 * 0.8
    fixed = offered_conversations(w, SweepParams(rates=(rate,)), rate, 0, vocab=100)
    assert len(fixed) <= 60 and (rate < 20 or len(fixed) == 60)
