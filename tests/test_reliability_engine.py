"""A full pool never hangs and never crashes the engine: whatever fills it (pins, running sequences, the
variants of one request), a new request completes or fails alone within a bounded number of steps.

The model-free runner (fake_runner.py) drives the real Engine.step() and records which token each KV slot
holds; after every step the pool invariants and every computed token's slot are checked."""

import pytest

from fake_runner import EOS, fake_engine
from pagedchat.engine import SamplingParams
from pagedchat.engine.core.sequence import SeqStatus

BS = 8          # tokens per block
BLOCKS = 16     # 128 tokens in all


def drain(engine, runner, limit: int) -> int:
    """Step until nothing is left, checking the invariants after every step; fail if it takes > limit."""
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        engine.check_invariants()
        pool = engine.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        for seq in list(engine.scheduler.running) + list(engine.scheduler.pins.values()):
            runner.check_sequence(seq)
        assert steps <= limit, f"no progress after {limit} steps: {engine.stats()}"
    return steps


def all_free(engine) -> None:
    for pin in list(engine.scheduler.pins.values()):
        engine.release(pin)
    engine.check_invariants()
    assert engine.pool.num_used == 0, "blocks leaked"


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt(start: int, length: int) -> list[int]:
    return [2 + (start + i) % 22 for i in range(length)]


# -- a pool that is exactly full ------------------------------------------------------------------------------
def fill_with_pins(engine, runner, count: int, length: int) -> list:
    pins = []
    for i in range(count):
        rid = engine.add_request(prompt(7 * i, length), greedy(1), keep=True)
        drain(engine, runner, 100)
        pins.append(engine.pop_output(rid).outputs[0].handle.sequence)  # white-box: the engine's sequences
    return pins


def test_full_pool_of_pins_and_running_sequences_admits_a_new_request():
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS)
    pins = fill_with_pins(engine, runner, 3, 23)          # 24 tokens each after one output: 3 x 3 = 9 blocks
    assert engine.stats().pinned_blocks == 9
    running = [engine.add_request(prompt(50 + i, 15), greedy(30)) for i in range(2)]
    while engine.pool.num_free > 0:                       # the 2 running sequences grow into the last 7 blocks
        engine.step()
    assert engine.pool.num_free == 0 and len(engine.scheduler.running) == 2 and len(engine.scheduler.pins) == 3

    late = engine.add_request(prompt(90, 20), greedy(10))
    steps = drain(engine, runner, 200)
    outs = [engine.pop_output(r) for r in running + [late]]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3 and not any(o.error for o in outs)
    assert steps < 80
    # pins were dropped oldest first to make room: whatever survived is the most recently used
    alive = [p.status == SeqStatus.PINNED for p in pins]
    assert alive == sorted(alive), alive
    for pin in pins:                                      # a dropped pin keeps its tokens: the next turn re-prefills
        assert len(pin.token_ids) == 24
    all_free(engine)


def test_full_pool_of_running_sequences_queues_a_new_request_until_room():
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS, max_num_batched_tokens=64)
    running = [engine.add_request(prompt(i, 24), greedy(20)) for i in range(4)]   # 4 x 6 blocks > the pool
    for _ in range(40):
        engine.step()
        if engine.pool.num_free == 0:
            break
    assert engine.pool.num_free == 0 and len(engine.scheduler.running) == 4
    late = engine.add_request(prompt(40, 30), greedy(2))
    drain(engine, runner, 50)
    assert all(engine.pop_output(r).outputs[0].finish_reason == "length" for r in running + [late])
    all_free(engine)


def test_full_pool_of_pins_only_evicts_least_recently_used():
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS)
    pins = fill_with_pins(engine, runner, 4, 31)          # 4 x 4 blocks = the whole pool
    assert engine.pool.num_free == 0
    engine.scheduler.touch_pin(pins[0])                    # the oldest conversation was just used again
    rid = engine.add_request(prompt(100, 20), greedy(4))   # needs 3 blocks: one pin must go
    drain(engine, runner, 50)
    assert engine.pop_output(rid).outputs[0].finish_reason == "length"
    assert pins[0].status == SeqStatus.PINNED and pins[1].status != SeqStatus.PINNED
    assert pins[2].status == SeqStatus.PINNED and pins[3].status == SeqStatus.PINNED
    # the dropped branch comes back: its follow-up re-prefills (from the cache where blocks survived)
    follow = engine.add_request(pins[1].token_ids + [5, 6], greedy(3), keep=True, parent=pins[1])
    drain(engine, runner, 50)
    assert engine.pop_output(follow).outputs[0].finish_reason == "length"
    all_free(engine)


# -- variants --------------------------------------------------------------------------------------------------
def test_variants_whose_tails_exceed_the_pool_are_queued_and_all_complete():
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS)
    # 24-token prompt (3 blocks) + 4 variants x 40 tokens (5 own blocks each): 23 blocks > 16, each fits alone
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=4, ignore_eos=True)
    rid = engine.add_request(prompt(0, 24), params)
    other = engine.add_request(prompt(30, 10), greedy(12))
    drain(engine, runner, 400)
    out = engine.pop_output(rid)
    assert out.error is None
    assert [(o.finish_reason, len(o.token_ids)) for o in out.outputs] == [("length", 40)] * 4
    assert engine.pop_output(other).outputs[0].finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    # preemption changes nothing: each variant samples from its own seeded stream
    roomy, _ = fake_engine(num_blocks=128, block_size=BS)
    want = roomy.generate([prompt(0, 24)], params)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]
    all_free(engine)


class VariantZeroStops:
    """Variant 0 ends after 3 tokens (EOS); the others never emit EOS and grow until max_tokens."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, batch):
        logits, samplers = self.runner.run(batch)
        if logits is None:
            return logits, samplers
        logits = logits.clone()
        for row, seq in enumerate(samplers):
            stop = seq.index == 0 and seq.num_output_tokens >= 3
            logits[row, EOS] = 100.0 if stop else -100.0
        return logits, samplers


@pytest.mark.parametrize("keep", [False, True])
def test_a_variant_that_cannot_fit_alone_fails_alone(keep):
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS)
    engine.runner = VariantZeroStops(runner)
    small = engine.add_request(prompt(40, 5), greedy(10))
    # 24 + 150 tokens > the 128-token pool: variants 1 and 2 can never finish; variant 0 stops early
    big = engine.add_request(prompt(0, 24), SamplingParams(temperature=0, max_tokens=150, n=3), keep=keep)
    after = engine.add_request(prompt(60, 12), greedy(20))
    drain(engine, runner, 1000)

    out = engine.pop_output(big)
    assert out.finished and "whole pool" in out.error
    reasons = [o.finish_reason for o in out.outputs]
    assert reasons == ["stop", "error", "error"], reasons
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].error is None
    assert all("raise --kv-memory" in o.error for o in out.outputs[1:])
    assert all(len(o.token_ids) > 100 for o in out.outputs[1:])   # they ran as far as the pool allows
    # keep=True: variant 0 was pinned, and its pin went first when its siblings needed the room
    assert out.outputs[0].handle is None
    for rid in (small, after):
        got = engine.pop_output(rid)
        assert got.error is None and got.outputs[0].finish_reason == "length"
    all_free(engine)


def test_prompt_that_fits_but_whose_reply_cannot_fails_alone_while_others_complete():
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS)
    others = [engine.add_request(prompt(i * 5, 9), greedy(12)) for i in range(3)]
    big = engine.add_request(prompt(0, 100), greedy(60))   # 100 tokens fit; 160 never do
    more = [engine.add_request(prompt(i * 3, 11), greedy(8)) for i in range(3)]
    drain(engine, runner, 500)
    assert "whole pool" in engine.pop_output(big).error
    for rid in others + more:
        assert engine.pop_output(rid).outputs[0].finish_reason == "length"
    all_free(engine)


def test_engine_stream_abort_mid_step_leaves_the_pool_consistent():
    """An exception out of the forward pass (Ctrl-C reaching the model) with blocks already reserved: the
    stream's cleanup aborts the request, and the next request runs on a consistent pool."""
    engine, runner = fake_engine(num_blocks=BLOCKS, block_size=BS)
    pins = fill_with_pins(engine, runner, 2, 20)
    real_run, calls = runner.run, {"n": 0}

    def interrupted(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_run(batch)

    runner.run = interrupted
    rid = engine.add_request(pins[0].token_ids + [4, 5, 6], SamplingParams(temperature=1, seed=1, max_tokens=20,
                                                                             n=3), keep=True, parent=pins[0])
    stream = engine.steps([rid])
    with pytest.raises(KeyboardInterrupt):
        for _ in stream:
            pass
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.check_invariants()
    runner.run = real_run
    rid = engine.add_request(pins[1].token_ids + [7], greedy(5), parent=pins[1])
    drain(engine, runner, 50)
    assert engine.pop_output(rid).outputs[0].finish_reason == "length"
    all_free(engine)


# -- the real model: the same workloads on real K/V tensors ----------------------------------------------------
def test_real_model_variants_over_the_pool_equal_an_unconstrained_run(model_dirs):
    from pagedchat.engine import Engine, EngineConfig

    path, _ = model_dirs["llama"]
    ids = list(range(10, 50))                                   # 40 tokens = 5 blocks of 8
    params = SamplingParams(temperature=0, max_tokens=24, n=3, ignore_eos=True)
    small = Engine(EngineConfig(model=str(path), num_blocks=12, block_size=8), show_progress=False)
    roomy = Engine(EngineConfig(model=str(path), num_blocks=64, block_size=8), show_progress=False)
    side = [5, 6, 7, 8, 9]
    got = small.generate([ids, side], [params, greedy(16)])
    want = roomy.generate([ids, side], [params, greedy(16)])
    assert small.scheduler.num_preemptions > 0 and small.pool.peak_used <= 12
    assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in want]
    too_big = small.generate([ids], [params.with_(max_tokens=80)])[0]
    assert too_big.error and [o.finish_reason for o in too_big.outputs] == ["error"] * 3
    small.check_invariants()
    assert small.pool.num_used == 0


def test_cli_variants_over_a_small_pool_match_an_unconstrained_run(model_dirs, tmp_path, capsys, monkeypatch):
    import json

    from cli_util import invoke

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path, _ = model_dirs["llama"]
    args = ["run", "-m", str(path), "--raw", "--json", "--temperature", "0", "-n", "3", "--max-tokens", "40",
            "the quick brown fox jumps over the lazy dog " * 5]
    # 10 blocks of 16; the prompt is 100 tokens: one variant needs 9 blocks, three need 6 shared + 3 x 3 = 15,
    # so variants are preempted and re-prefilled (from the prefix cache) in turn
    code, out, err = invoke(args + ["--kv-memory", "80KiB"], None, capsys, monkeypatch)
    assert code == 0, err
    small = json.loads(out)
    code, out, err = invoke(args, None, capsys, monkeypatch)
    big = json.loads(out)
    assert small["usage"]["prompt_tokens"] == 100
    assert small["kv"]["num_blocks"] == 10 and small["kv"]["peak_blocks_used"] <= 10
    assert small["kv"]["prefix_hit_tokens"] > big["kv"]["prefix_hit_tokens"]   # the re-prefills
    assert [o["token_ids"] for o in small["outputs"]] == [o["token_ids"] for o in big["outputs"]]
    assert all(len(o["token_ids"]) == 40 or o["finish_reason"] == "stop" for o in small["outputs"])
