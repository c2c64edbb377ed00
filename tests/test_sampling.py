"""Sampling: seeded requests reproduce whatever shares their batch; filters match transformers' warpers."""

import pytest
import torch

from fake_runner import fake_engine
from pagedchat.engine import SamplingParams
from pagedchat.engine.decoding.sampler import _filter, apply_repetition_penalty
from pagedchat.errors import UserError


def sample_alone_and_in_company(params, company):
    engine, _ = fake_engine(num_blocks=64)
    alone = engine.generate([[2, 3, 4, 5]], params)[0].outputs
    engine, _ = fake_engine(num_blocks=64)
    outs = engine.generate([[7, 8]] * company + [[2, 3, 4, 5]] + [[9, 10, 11]] * company,
                           [SamplingParams(temperature=1.0, max_tokens=9)] * company + [params]
                           + [SamplingParams(temperature=1.3, top_k=5, max_tokens=4)] * company)
    return [o.token_ids for o in alone], [o.token_ids for o in outs[company].outputs]


@pytest.mark.parametrize("company", [1, 5])
def test_seed_is_reproducible_regardless_of_batch(company):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True, n=3)
    alone, together = sample_alone_and_in_company(params, company)
    assert alone == together
    assert len({tuple(v) for v in alone}) > 1, "variants of one seed must differ from each other"


def test_variant_zero_equals_single_request_with_same_seed():
    engine, _ = fake_engine()
    one = engine.generate([[2, 3]], SamplingParams(temperature=1, seed=7, max_tokens=10, ignore_eos=True))[0]
    many = engine.generate([[2, 3]], SamplingParams(temperature=1, seed=7, max_tokens=10, ignore_eos=True, n=4))[0]
    assert many.outputs[0].token_ids == one.outputs[0].token_ids


def test_different_seeds_differ():
    engine, _ = fake_engine()
    a, b = engine.generate([[2, 3], [2, 3]], [SamplingParams(temperature=1, seed=s, max_tokens=12, ignore_eos=True)
                                              for s in (1, 2)])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (10, 0.7, 0.05),
                                              (1, 1.0, 0.0), (0, 0.01, 0.0)])
def test_filters_match_transformers(top_k, top_p, min_p):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    if min_p:
        expected = MinPLogitsWarper(min_p)(None, expected)
    n = logits.shape[0]
    ours = _filter(logits, torch.full((n,), top_k), torch.full((n,), top_p), torch.full((n,), min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    assert torch.allclose(ours[kept], expected[kept])


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    engine, _ = fake_engine()
    engine.add_request([2, 3, 3, 9], SamplingParams(repetition_penalty=1.3))
    seq = engine.scheduler.waiting[0]
    logits = torch.randn(1, 24, generator=torch.Generator().manual_seed(1))
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seq.token_ids]), logits.clone())
    apply_repetition_penalty(logits, [seq])
    assert torch.allclose(logits, expected)


def test_stop_strings_and_token_ids():
    engine, _ = fake_engine()
    out = engine.generate([[2, 3]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    stop_at = out.token_ids[3]
    out2 = engine.generate([[2, 3]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                    stop_token_ids=[stop_at]))[0].outputs[0]
    assert out2.finish_reason == "stop" and out2.token_ids == out.token_ids[:out.token_ids.index(stop_at) + 1]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                                 dict(top_k=-1), dict(min_p=1.0), dict(n=0), dict(repetition_penalty=0)])
def test_invalid_values_are_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


def test_device_penalty_state_equals_the_per_row_penalty_every_step():
    """The device-resident token sets (SamplingState) give transformers' repetition penalty at every step:
    more sequences than the first capacity (slots grow), variants forked after the prompt, finished
    sequences' slots reused, and n-gram speculation appending verified runs the sampler never saw."""
    from pagedchat.engine.decoding.sampler import Sampler

    engine, _ = fake_engine(num_blocks=600, speculate="ngram")
    checked = []
    scores = Sampler.scores

    def checked_scores(self, logits, seqs):
        out = scores(self, logits, seqs)
        expected = logits.float().clone()
        apply_repetition_penalty(expected, seqs)
        assert torch.equal(out, expected)
        checked.append(len(seqs))
        return out

    Sampler.scores = checked_scores
    try:
        prompts = [[2 + i % 7, 3, 3 + i % 5, 9, 2 + i % 7, 3] for i in range(70)]
        params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, repetition_penalty=1.0 if i % 4 == 0 else 1.3,
                                 seed=i if i % 2 else None, max_tokens=6 + i % 9, ignore_eos=True, n=1 + (i == 5))
                  for i in range(70)]
        engine.generate(prompts, params)
        engine.generate(prompts[:10], params[:10])   # the finished sequences' slots are reused
    finally:
        Sampler.scores = scores
    assert max(checked) > 64 and len(engine.sampler.state.owner) >= 128
