"""Beam search equals transformers' generate(num_beams=W, num_return_sequences=W, do_sample=False): the same
hypotheses in the same order, scores within 1e-4 relative, on every architecture, for W = 1, 2, 4, 8, mixed
with other requests in one continuous batch, with prefill in small chunks and in a pool small enough that beams
are preempted and parked. Then what it costs the pool: copies, freed blocks, a request that cannot fit."""

import random

import pytest

from beam_oracle import assert_beams_equal, beam_reference
from fake_runner import fake_engine
from hf_models import ARCHS
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.errors import UserError

NEW_TOKENS = 12
# (width, length_penalty, early_stopping): every stopping rule, penalties that favour short and long outputs
CASES = [(1, 1.0, False), (2, 0.5, True), (4, 2.0, "never"), (8, -1.0, False), (8, 1.0, True), (4, 1.0, "never"),
         (2, 0.0, False), (8, 1.5, "never")]


def run_beams(engine, hf, seed: int, cases=CASES, lo: int = 3, hi: int = 50):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(len(cases) + 2)]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, beam_width=w, length_penalty=lp,
                             early_stopping=es) for w, lp, es in cases]
    params += [SamplingParams(temperature=0, max_tokens=NEW_TOKENS)] * 2   # plain requests in the same batches
    outs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        if p.beam_width:
            expected = beam_reference(hf, prompt, p.beam_width, NEW_TOKENS, p.length_penalty, p.early_stopping)
            assert_beams_equal(out.outputs, expected)
        else:
            assert_greedy_equal(out.outputs[0].token_ids, *reference(hf, prompt, NEW_TOKENS))
    engine.check_invariants()
    assert engine.pool.num_used == 0, "a finished beam search must return every block"


@pytest.mark.parametrize("arch", ARCHS)
def test_beams_match_transformers(model_dirs, arch):
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), num_blocks=256), show_progress=False)
    run_beams(engine, hf, seed=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_beams_match_with_chunked_prefill_and_preemption(model_dirs, arch):
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), num_blocks=20, block_size=8, max_num_batched_tokens=7),
                    show_progress=False)
    run_beams(engine, hf, seed=2, cases=[CASES[0], CASES[1], CASES[2], CASES[4]], lo=20, hi=60)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for every beam at once"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_beams_on_sliding_window_models(model_dirs, arch):
    """Window layers keep block tables of their own: beams fork, share and free those too, still exact (a
    window of 24 tokens over 20-72-token sequences, prefill in chunks, a pool that can preempt)."""
    path, hf = model_dirs[arch]
    engine = Engine(EngineConfig(model=str(path), num_blocks=40, block_size=8, max_num_batched_tokens=7),
                    show_progress=False)
    run_beams(engine, hf, seed=3, cases=[CASES[1], CASES[2], CASES[4]], lo=20, hi=60)

def test_beams_share_blocks_and_copy_at_most_w_per_step():
    """8 beams over a 64-token prompt: every step copies at most W blocks (only partial last blocks), and
    after every step the pool holds exactly the blocks of the live beams (dropped beams freed at once)."""
    engine, runner = fake_engine(num_blocks=64, block_size=8, vocab=24)
    width = 8
    rid = engine.add_request([2 + i % 20 for i in range(64)],
                             SamplingParams(beam_width=width, max_tokens=30, ignore_eos=True))
    copies = 0
    while not engine.requests[rid].finished:
        engine.step()
        assert engine.pool.cow_copies - copies <= width
        copies = engine.pool.cow_copies
        live = [s for s in engine.requests[rid].sequences if not s.is_finished]
        assert engine.pool.num_used == len({b for s in live for b in s.block_table})
        assert engine.pool.num_used <= 8 + width * 5, "beams must share the prompt and most of their history"
        for seq in live:
            runner.check_sequence(seq)
    assert copies > 0
    out = engine.pop_output(rid)
    assert len(out.outputs) == width and all(len(o.token_ids) == 30 for o in out.outputs)
    assert [o.score for o in out.outputs] == sorted((o.score for o in out.outputs), reverse=True)
    assert engine.pool.num_used == 0


def test_beam_request_that_cannot_fit_fails_alone():
    engine, _ = fake_engine(num_blocks=8, block_size=8)
    big = engine.add_request([2 + i % 20 for i in range(40)], SamplingParams(beam_width=4, max_tokens=40,
                                                                            ignore_eos=True))
    small = engine.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.check_invariants()
    big_out, small_out = engine.pop_output(big), engine.pop_output(small)
    assert big_out.error and "whole pool" in big_out.error
    assert small_out.error is None and len(small_out.outputs[0].token_ids) == 5
    assert engine.pool.num_used == 0


def test_abort_mid_search_frees_every_block():
    engine, _ = fake_engine(num_blocks=32, block_size=8)
    rid = engine.add_request(list(range(2, 22)), SamplingParams(beam_width=4, max_tokens=20, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used > 0
    engine.abort(rid)
    assert engine.requests[rid].finished and engine.pool.num_used == 0
    engine.check_invariants()


@pytest.mark.parametrize("bad", [dict(beam_width=-1), dict(beam_width=2, n=2), dict(early_stopping="sometimes"),
                                 dict(length_penalty="long"), dict(beam_width=1.5)])
def test_bad_beam_settings_are_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)
