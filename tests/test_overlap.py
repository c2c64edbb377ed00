"""Overlapped steps (Engine.step): step N+1 is scheduled and run before step N's tokens reach the host, each
running sequence ending meanwhile in a PENDING token that the runner reads from the device.

The engine must be exactly the synchronous one: greedy tokens equal transformers' for every family (sliding
windows, MoE) with preemption and chunked prefill; seeded sampling, penalties, stop strings, n variants,
beams and logprobs give the same tokens and text with the overlap on and off; what the steps stream adds up
to the outputs; API calls between steps (fork, abort, get_output) see only settled tokens. The pool's
invariants under random programs are checked by the state machine (OverlapEngineMachine)."""

import random

import pytest

from fake_runner import EOS, fake_engine
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.core.sequence import PENDING
from test_decode_graphs import graphed_engine, needs_triton


def prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_for(model_dirs, arch, overlap=True, **kw) -> Engine:
    path, _ = model_dirs[arch]
    return Engine(EngineConfig(model=str(path), overlap=overlap, **{"num_blocks": 256, **kw}), show_progress=False)


def streamed_run(engine: Engine, batch, params) -> list:
    """Run to the end through `steps`, checking that the streamed tokens and text add up to the outputs."""
    param_list = params if isinstance(params, list) else [params] * len(batch)
    ids = [engine.add_request(p, sp) for p, sp in zip(batch, param_list)]
    tokens, text = {}, {}
    for events in engine.steps(ids):
        for e in events:
            tokens.setdefault((e.request_id, e.index), []).extend(e.token_ids)
            text[e.request_id, e.index] = text.get((e.request_id, e.index), "") + e.text
    outs = [engine.pop_output(r) for r in ids]
    for rid, out in zip(ids, outs):
        if out.outputs and out.outputs[0].score is None:   # a beam's outputs are its final hypotheses
            for o in out.outputs:
                assert tokens.get((rid, o.index), []) == o.token_ids
                assert text.get((rid, o.index), "") == o.text
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma2"])
def test_greedy_equals_transformers_overlapped(model_dirs, arch):
    """16 prompts in a pool small enough to preempt, prefilled in chunks, every step overlapped."""
    engine = engine_for(model_dirs, arch, num_blocks=40, block_size=8, max_num_batched_tokens=48)
    batch = prompts(16, seed=11, lo=2, hi=60)
    outs = streamed_run(engine, batch, SamplingParams(temperature=0, max_tokens=16))
    hf = model_dirs[arch][1]
    for prompt, out in zip(batch, outs):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, 16))
    assert engine.overlapped_steps > 16 and engine.scheduler.num_preemptions > 0
    engine.check_invariants()
    assert engine.pool.num_used == 0


def test_sampling_and_stops_equal_synchronous(model_dirs):
    """Seeded sampling, top-k/p, min-p, repetition penalties, stop strings and stop ids, EOS, n variants,
    a beam search and logprobs in the same batch: the overlap changes nothing."""
    batch = prompts(7, seed=12, lo=4, hi=40)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=24, n=3),
              SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=2, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, seed=3, max_tokens=30, stop=["e", "a"]),
              SamplingParams(temperature=1.2, seed=4, max_tokens=30, stop_token_ids=list(range(3, 60))),
              SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(beam_width=3, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=1)]
    results = {}
    for overlap in (False, True):
        engine = engine_for(model_dirs, "llama", overlap=overlap)
        outs = streamed_run(engine, batch, params)
        results[overlap] = [[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outs]
        assert engine.pool.num_used == 0
    assert results[True] == results[False]
    assert any(r == "stop" for out in results[True][2:4] for _, _, r in out)


@needs_triton
def test_graphed_steps_read_the_pending_tokens(model_dirs, monkeypatch):
    """A graphed decode step (the CPU graph double, Triton kernels interpreted) gets its PENDING input ids
    from the device too: greedy tokens equal transformers'."""
    from triton_rounding import gpu_rounding

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine, replays = graphed_engine(model_dirs, monkeypatch, overlap=True)
    batch = prompts(2, seed=13, hi=30)
    with gpu_rounding():
        outs = streamed_run(engine, batch, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert_greedy_equal(out.outputs[0].token_ids, *reference(model_dirs["llama"][1], prompt, 5))
    assert replays and engine.overlapped_steps >= 4


# -- the mechanism, on the model-free runner -------------------------------------------------------------
def test_length_is_known_ahead_no_row_wasted():
    """A sequence whose next token reaches max_tokens gets no row for the token after it; one that ends on
    EOS had a row in the step already running, computed and dropped."""
    engine, _ = fake_engine(num_blocks=16, overlap=True)
    engine.generate([[2, 3, 4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert (engine.overlapped_steps, engine.discarded_rows) == (6, 0)
    engine, runner = fake_engine(num_blocks=16, overlap=True)
    runner.table[:, EOS] = 100.0   # every token after the first is EOS
    out = engine.generate([[2, 3, 4]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.outputs[0].token_ids[-1] == EOS and engine.discarded_rows == 1


def test_api_calls_between_steps_see_settled_tokens():
    """get_output never shows a PENDING token; fork settles first (the child copies every token) and the
    next step returns the settled events; abort drops the pending token; the pool stays exact."""
    engine, runner = fake_engine(num_blocks=32, overlap=True)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    a = engine.add_request([2, 3, 4, 5], params)
    b = engine.add_request([6, 7, 8], params)
    streamed = {a: [], b: [], "child": []}
    for _ in range(4):
        for e in engine.step():
            streamed[e.request_id].extend(e.token_ids)
    seq_a = engine.requests[a].sequences[0]
    assert seq_a.token_ids[-1] == PENDING and PENDING not in engine.get_output(a).outputs[0].token_ids
    assert engine.get_output(a).outputs[0].token_ids == streamed[a]
    child = engine.fork(seq_a, SamplingParams(temperature=0, max_tokens=3))
    assert PENDING not in seq_a.token_ids and engine.requests[child].sequences[0].token_ids == seq_a.token_ids
    engine.abort(b)
    assert PENDING not in engine.get_output(b).outputs[0].token_ids
    for events in engine.steps():
        for e in events:
            streamed.setdefault(e.request_id, []).extend(e.token_ids)
    assert streamed[a] == engine.pop_output(a).outputs[0].token_ids
    assert len(streamed[child]) == 3 and streamed[child] == engine.pop_output(child).outputs[0].token_ids
    assert streamed[b] == engine.pop_output(b).outputs[0].token_ids
    engine.check_invariants()
    assert engine.pool.num_used == 0


def test_overlap_switch(monkeypatch):
    monkeypatch.delenv("PAGEDCHAT_OVERLAP", raising=False)
    config = EngineConfig(model="x")
    assert config.overlaps("cuda") and not config.overlaps("cpu")
    monkeypatch.setenv("PAGEDCHAT_OVERLAP", "0")
    assert not config.overlaps("cuda")
    monkeypatch.setenv("PAGEDCHAT_OVERLAP", "1")
    assert config.overlaps("cpu") and not EngineConfig(model="x", overlap=False).overlaps("cpu")


def test_host_step_bench_times_both_modes():
    """`bench host-step` runs the real engine on the model-free runner with the steps overlapped and not."""
    from pagedchat.bench.host_step import run_host_step_bench

    r = run_host_step_bench(batches=(2,), workloads=("seeded",), new_tokens=6, repeats=1)
    assert [row["steps"] for row in r["rows"]] == ["not overlapped", "overlapped"]
    assert all(row["step_ms"] > 0 for row in r["rows"])


def test_the_host_waits_for_a_step_only_after_launching_the_next(monkeypatch):
    """The order that makes the overlap: run(N+1) is called before step N's tokens are waited for, and the
    tokens are read back to the host nowhere else (the sampler keeps them on the device)."""
    from pagedchat.engine.core.inflight import InFlight

    engine, runner = fake_engine(num_blocks=32, overlap=True)
    calls, run, wait = [], runner.run, InFlight.wait
    monkeypatch.setattr(runner, "run", lambda batch: (calls.append("run"), run(batch))[1])
    monkeypatch.setattr(InFlight, "wait", lambda self: (calls.append("wait"), wait(self))[1])
    monkeypatch.setattr(type(engine.sampler), "pick", lambda *a: pytest.fail("tokens read back by the sampler"))
    engine.generate([[2, 3, 4], [5, 6]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert calls == ["run"] + ["run", "wait"] * 4 + ["wait"]


@pytest.mark.parametrize("prompt_len", [17, 22])
def test_a_pin_ended_by_a_settled_token_is_what_it_would_be_without_overlap(prompt_len):
    """A reply that ends on EOS while the next step already computes that token: pinned with it not computed
    and no block for its slot, as without the overlap. (Counting it computed made a later fork step back one
    token, past what a sliding-window group had kept: found by a windowed state machine with overlap.) The
    replies end on token 19 (a window block released at 20) and on token 24 (a new block's first slot)."""
    engine, runner = fake_engine(num_blocks=26, window_groups=(2, 12), overlap=True)
    prompt = [2 + i % 17 for i in range(prompt_len)]
    runner.table[:] = -100.0
    runner.table[prompt[-1], 20] = runner.table[20, 21] = runner.table[21, EOS] = 100.0   # 20, 21, EOS
    runner.table[[5, 22], 22] = 100.0   # the other requests: 5 -> 22 -> 22 ...
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10), keep=True)
    engine.generate([[5]], SamplingParams(temperature=0, max_tokens=9))   # steps beside it
    out = engine.get_output(rid).outputs[0]
    assert out.token_ids == [20, 21, EOS] and engine.discarded_rows == 1
    pin = engine.requests[rid].sequences[0]
    assert pin.num_computed == pin.num_tokens - 1 and len(pin.block_table) == -(-pin.num_computed // 8)
    child = engine.fork(pin, SamplingParams(temperature=0, max_tokens=3), keep=True)
    runner.check_sequence(engine.requests[child].sequences[0])
    engine.generate([[5]], SamplingParams(temperature=0, max_tokens=2))
    engine.check_invariants()
    for seq in [pin, engine.requests[child].sequences[0]]:
        runner.check_sequence(seq)
