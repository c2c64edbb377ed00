"""Greedy tokens equal transformers' generate(do_sample=False) for every architecture and every way the
engine can schedule them: alone, 16 at once, prefill in small chunks, a pool that forces preemption, n variants."""

import random

import pytest

from hf_models import ARCHS
from oracle import assert_greedy_equal, reference
from pagedchat.engine import Engine, EngineConfig, SamplingParams

NEW_TOKENS = 20


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_for(model_dirs, arch, **kw) -> Engine:
    path, _ = model_dirs[arch]
    return Engine(EngineConfig(model=str(path), **{"num_blocks": 256, **kw}), show_progress=False)


def check(engine, hf, batch, params=None, n=1):
    params = params or SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outs = engine.generate(batch, params.with_(n=n))
    for prompt, out in zip(batch, outs):
        ref_tokens, ref_logits = reference(hf, prompt, params.max_tokens)
        assert len(out.outputs) == n
        for variant in out.outputs:
            assert_greedy_equal(variant.token_ids, ref_tokens, ref_logits)
    engine.check_invariants()
    assert engine.pool.num_used == 0, "finished requests must return every block"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompts(model_dirs, arch):
    engine = engine_for(model_dirs, arch)
    for p in prompts(3, seed=1):
        check(engine, model_dirs[arch][1], [p])


@pytest.mark.parametrize("arch", ARCHS)
def test_sixteen_concurrent_mixed_lengths(model_dirs, arch):
    engine = engine_for(model_dirs, arch)
    check(engine, model_dirs[arch][1], prompts(16, seed=2, lo=2, hi=90))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(model_dirs, arch):
    # 7 tokens per step: every prompt is prefilled in several chunks, interleaved with other decodes
    engine = engine_for(model_dirs, arch, max_num_batched_tokens=7)
    check(engine, model_dirs[arch][1], prompts(4, seed=3, lo=20, hi=70))


@pytest.mark.parametrize("arch", ARCHS)
def test_small_pool_forces_preemption(model_dirs, arch):
    engine = engine_for(model_dirs, arch, num_blocks=14, block_size=8)
    check(engine, model_dirs[arch][1], prompts(8, seed=4, lo=20, hi=50))
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small to hold every request"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_variants_share_prompt(model_dirs, arch):
    engine = engine_for(model_dirs, arch)
    check(engine, model_dirs[arch][1], prompts(2, seed=5, lo=30, hi=50), n=4)


def test_tied_embeddings_and_bias_are_loaded(model_dirs):
    # qwen2 ties embeddings and has qkv bias; a loader that skipped either would fail equality above,
    # this pins down that the fixture really exercises them.
    _, hf = model_dirs["qwen2"]
    assert hf.config.tie_word_embeddings
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
