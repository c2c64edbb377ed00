"""Copy-on-write forks and the prefix cache, checked on real K/V tensors."""

import pytest
import torch

from pagedchat.engine import Engine, EngineConfig, SamplingParams
from pagedchat.engine.core.sequence import SeqStatus

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(model_dirs, arch="llama", **kw):
    path, _ = model_dirs[arch]
    return Engine(EngineConfig(model=str(path), **{"num_blocks": 64, "block_size": 8, **kw}), show_progress=False)


def block_kv(engine, block):
    return [(k[block].clone(), v[block].clone()) for k, v in zip(engine.runner.k_caches, engine.runner.v_caches)]


def run_all(engine):
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fork_of_pinned_sequence_mid_block(model_dirs, arch):
    engine = make_engine(model_dirs, arch)
    prompt = list(range(10, 30))  # 20 tokens + 12 generated = 32, 31 computed: the last block is partial
    rid = engine.add_request(prompt, GREEDY, keep=True)
    run_all(engine)
    parent = engine.pop_output(rid).outputs[0].handle.sequence  # white-box: the engine's own sequence
    assert parent.status == SeqStatus.PINNED and parent.num_computed % 8 != 0
    parent_tokens = list(parent.token_ids)
    snapshot = {b: block_kv(engine, b) for b in parent.block_table}
    copies_before = engine.pool.cow_copies

    child_id = engine.fork(parent, GREEDY)
    run_all(engine)
    child = engine.pop_output(child_id)

    assert engine.pool.cow_copies - copies_before == 1, "exactly the shared partial block is copied"
    assert child.prefix_hit_tokens == parent.num_computed
    assert parent.token_ids == parent_tokens
    for block, layers in snapshot.items():  # the parent's KV is untouched by the child's writes
        for (k0, v0), (k1, v1) in zip(layers, block_kv(engine, block)):
            # bit for bit; the pool is not zero-filled, so the unwritten tail slots may hold NaN patterns
            torch.testing.assert_close(k1, k0, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v1, v0, rtol=0, atol=0, equal_nan=True)

    alone = make_engine(model_dirs, arch).generate([parent_tokens], GREEDY)[0]
    assert child.outputs[0].token_ids == alone.outputs[0].token_ids
    engine.release(parent)
    engine.check_invariants()
    assert engine.pool.num_used == 0


def test_fork_of_running_sequence(model_dirs):
    engine = make_engine(model_dirs)
    rid = engine.add_request(list(range(40, 53)), GREEDY.with_(max_tokens=20))
    for _ in range(5):
        engine.step()
    running = engine.requests[rid].sequences[0]
    assert running.status == SeqStatus.RUNNING
    child_id = engine.fork(running, GREEDY)
    tokens_at_fork = engine.requests[child_id].prompt_token_ids  # (fork settles a step still in flight first)
    run_all(engine)
    child = engine.pop_output(child_id).outputs[0].token_ids
    alone = make_engine(model_dirs).generate([tokens_at_fork], GREEDY)[0].outputs[0].token_ids
    assert child == alone
    assert engine.pop_output(rid).outputs[0].token_ids[:len(tokens_at_fork) - 13] == tokens_at_fork[13:]
    engine.check_invariants()
    assert engine.pool.num_used == 0


def test_prefix_cache_hit_gives_same_output(model_dirs):
    engine = make_engine(model_dirs)
    prompt = list(range(5, 42))  # 37 tokens: 4 full blocks of 8 can be reused
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert first.prefix_hit_tokens == 0
    assert second.prefix_hit_tokens == 32
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.pool.stats().prefix_hit_tokens >= 32


def test_full_prompt_hit_still_recomputes_last_token(model_dirs):
    engine = make_engine(model_dirs)
    prompt = list(range(5, 37))  # exactly 4 blocks: the last one must be recomputed for logits
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert second.prefix_hit_tokens == 24
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_follow_up_turn_prefills_only_new_tokens(model_dirs):
    engine = make_engine(model_dirs)
    rid = engine.add_request(list(range(3, 30)), GREEDY, keep=True)
    run_all(engine)
    head = engine.pop_output(rid).outputs[0].handle
    follow_up = head.token_ids + [7, 8, 9, 10]
    rid2 = engine.add_request(follow_up, GREEDY, keep=True, parent=head)
    run_all(engine)
    out = engine.pop_output(rid2)
    assert out.prefix_hit_tokens == len(head.token_ids) - 1  # everything the head had computed
    alone = make_engine(model_dirs).generate([follow_up], GREEDY)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_variants_share_prompt_blocks(model_dirs):
    engine = make_engine(model_dirs, num_blocks=200)
    prompt = list(range(3, 203))  # 200 tokens = 25 blocks
    engine.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=12, n=8))
    peak_n8 = engine.pool.peak_used
    engine2 = make_engine(model_dirs, num_blocks=200)
    engine2.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=12))
    peak_n1 = engine2.pool.peak_used
    # one prompt's blocks plus each child's own tail (<= 3 blocks of 8 for 12 tokens), not 8 copies
    assert peak_n8 <= peak_n1 + 8 * 3
    assert peak_n8 < 2 * peak_n1


def test_request_too_big_for_pool_fails_alone(model_dirs):
    from pagedchat.errors import RequestError

    engine = make_engine(model_dirs, num_blocks=6)
    with pytest.raises(RequestError, match="whole KV pool"):
        engine.add_request(list(range(3, 60)), GREEDY)
    # fits as a prompt but not with its generation: it fails alone, the other request completes
    small = engine.add_request([5, 6, 7], GREEDY)
    big = engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    run_all(engine)
    assert engine.pop_output(small).outputs[0].finish_reason == "length"
    out = engine.pop_output(big)
    assert out.error and "whole pool" in out.error
    engine.check_invariants()
    assert engine.pool.num_used == 0


def test_simultaneous_requests_share_a_prefix_being_computed(model_dirs):
    engine = make_engine(model_dirs, num_blocks=128)
    system = list(range(3, 43))  # 40 shared tokens = 5 full blocks of 8
    batch = [system + [50 + i, 60 + i, 70 + i] for i in range(6)]
    outs = engine.generate(batch, GREEDY)
    assert outs[0].prefix_hit_tokens == 0
    assert all(o.prefix_hit_tokens == 40 for o in outs[1:]), [o.prefix_hit_tokens for o in outs]
    alone = make_engine(model_dirs).generate(batch[3:4], GREEDY)[0]
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids
