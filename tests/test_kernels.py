"""Tests of pagedchat.kernels.

* the torch twins against a naive per-token float64 loop;
* the Triton kernels under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) against the
  float64 twin: many shapes, head_dim 64..256 (80 and 96 included), block sizes 8..128, GQA/MQA,
  forced split counts, zero-length sequences, caches and outputs poisoned with NaN;
* int64 address math, on a 4 GiB *virtual* cache whose touched blocks lie past 2**31 elements;
* `gpu`-marked repeats in bf16 on CUDA (skipped without a device).

The interpreter is switched on per test through the `interpret` fixture, not for the whole process:
the kernels are jitted at their first launch (kernels/_launch.py), so it takes effect whenever set,
and other test modules keep the fast torch path.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import (SLOW, assert_matches_oracle, check_decode, check_prefill, check_quantized,
                          check_quantized_write_and_copy, make_case, make_pool, needs_cuda, needs_triton, quantize_case)

from pagedchat import kernels as K


def bounded(examples: int):
    """Hypothesis settings for interpreter tests: few examples (the interpreter is slow), reproducible."""
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(params=["v1", "v2"])
def impl(request, monkeypatch):
    """Both Triton implementations, through the environment variable a user sets."""
    monkeypatch.setenv("PAGEDCHAT_ATTN", request.param)
    return request.param


# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------

def naive_attention_row(q_row, k_cache, v_cache, table_row, num_visible, scale):
    """q_row [Hq, D] attends to the first num_visible tokens of a paged sequence, token by token."""
    num_q_heads, head_dim = q_row.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_q_heads, head_dim, dtype=torch.float64)
    for h in range(num_q_heads):
        scores, values = [], []
        for t in range(num_visible):
            block, offset = int(table_row[t // block_size]), t % block_size
            key = k_cache[block, offset, h // group].double()
            scores.append(float((q_row[h].double() * key).sum()) * scale)
            values.append(v_cache[block, offset, h // group].double())
        if not scores:
            continue
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        out[h] = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    return out


# ---------------------------------------------------------------------------------------------------
# Twins against the naive loop
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_decode_ref_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    block_size = [4, 8, 16, 5][seed]
    num_kv_heads, group, head_dim = [(2, 2, 8), (1, 4, 16), (3, 1, 12), (2, 3, 8)][seed]
    seq_lens = [0, 1, block_size, 3 * block_size + 1, 17][: 2 + seed]
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, torch.float64, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.37)
    for b, n in enumerate(seq_lens):
        want = naive_attention_row(q[b], k_cache, v_cache, table[b], n, 0.37)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("batch", [5, 70])  # the per-sequence loop and the padded batched path
def test_decode_ref_paths_match_naive(batch):
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(0, 40, (batch,), generator=gen).tolist()
    k_cache, v_cache, table = make_case(seq_lens, 8, 2, 16, torch.float64, gen)
    q = torch.randn(batch, 4, 16, generator=gen, dtype=torch.float64)
    out = K.paged_decode_attention_ref(q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), 0.3)
    assert not out.isnan().any()
    for b in range(0, batch, 7):
        want = naive_attention_row(q[b], k_cache, v_cache, table[b], seq_lens[b], 0.3)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


def test_decode_ref_groups_mixed_lengths_and_matches_naive():
    """Mixed lengths go through several padded calls (short contexts do not pay the longest one's padding);
    the NaN-poisoned pool shows that no padding slot reaches the output."""
    from pagedchat.kernels.reference import group_by_length

    seq_lens = [1, 300, 3, 0, 40, 210, 90, 500, 45]
    groups = group_by_length(seq_lens)
    assert sorted(i for g in groups for i in g) == [i for i, n in enumerate(seq_lens) if n] and len(groups) > 2
    for g in groups:  # each group's padding is bounded: a third of its longest, or one call's worth
        longest = max(seq_lens[i] for i in g)
        assert all(3 * seq_lens[i] >= 2 * longest or longest - seq_lens[i] <= 64 for i in g)
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, table = make_case(seq_lens, 16, 2, 8, torch.float64, gen)
    q = torch.randn(len(seq_lens), 4, 8, generator=gen, dtype=torch.float64)
    out = K.paged_decode_attention_ref(q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), 0.4)
    assert not out.isnan().any() and out[3].eq(0).all()
    for b, n in enumerate(seq_lens):
        want = naive_attention_row(q[b], k_cache, v_cache, table[b], n, 0.4)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("length", [1, 16, 37, 200])
def test_decode_ref_reads_a_consecutive_table_in_place_with_the_same_result(length):
    """One sequence whose blocks are consecutive is read in place (no gather): bit for bit the result of the
    same context laid out in scattered blocks."""
    gen = torch.Generator().manual_seed(length)
    block_size, blocks = 8, -(-length // 8)
    k_cache = torch.randn(64, block_size, 2, 16, generator=gen)
    v_cache = torch.randn(64, block_size, 2, 16, generator=gen)
    consecutive = torch.arange(3, 3 + blocks, dtype=torch.int32)[None]
    scattered = torch.arange(62, 62 - 2 * blocks, -2, dtype=torch.int32)  # descending, every other block
    k2, v2 = torch.randn(k_cache.shape, generator=gen), torch.randn(v_cache.shape, generator=gen)
    k2[scattered.long()], v2[scattered.long()] = k_cache[3:3 + blocks], v_cache[3:3 + blocks]
    q = torch.randn(1, 4, 16, generator=gen)
    lens = torch.tensor([length], dtype=torch.int32)
    in_place = K.paged_decode_attention_ref(q, k_cache, v_cache, consecutive, lens, 0.25)
    assert torch.equal(in_place, K.paged_decode_attention_ref(q, k2, v2, scattered[None], lens, 0.25))
    want = naive_attention_row(q[0].double(), k_cache.double(), v_cache.double(), consecutive[0], length, 0.25)
    torch.testing.assert_close(in_place[0].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_ref_matches_naive(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    block_size, num_kv_heads, group, head_dim = [(4, 2, 2, 8), (8, 1, 3, 16), (3, 2, 1, 4)][seed]
    seq_lens = [5, 9, 1, 12][: 2 + seed]
    new_tokens = [2, 9, 1, 4][: 2 + seed]  # 9 of 9: a plain prefill; others extend a cached prefix
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, torch.float64, gen)
    cu = torch.tensor([0] + list(torch.tensor(new_tokens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    out = K.paged_prefill_attention_ref(q, k_cache, v_cache, table, cu,
                                        torch.tensor(seq_lens, dtype=torch.int32), 0.5)
    for b, (n, m) in enumerate(zip(seq_lens, new_tokens)):
        for j in range(m):
            want = naive_attention_row(q[cu[b] + j], k_cache, v_cache, table[b], n - m + j + 1, 0.5)
            torch.testing.assert_close(out[cu[b] + j], want, rtol=1e-10, atol=1e-10)


# padded batch / per sequence / equal row counts (no scatter) / all alike (one mask) / one sequence verifying
@pytest.mark.parametrize("new_tokens,extras", [([1, 3, 7, 1, 2], [30, 0, 12, 57, 4]),
                                               ([70, 2, 1, 5, 3], [30, 0, 12, 57, 4]),
                                               ([4, 4, 4, 4, 4], [30, 0, 12, 57, 4]),
                                               ([3, 3, 3], [20, 20, 20]), ([5], [30])])
def test_prefill_ref_short_extend_and_per_sequence_paths_match_naive(new_tokens, extras):
    """Decode + speculative drafts: every sequence adds a few rows (one padded gather + SDPA for the batch,
    at batch 1 too); one long chunk sends the batch through the per-sequence loop. Lengths differ, the pool
    is NaN-poisoned."""
    gen = torch.Generator().manual_seed(sum(new_tokens))
    seq_lens = [n + extra for n, extra in zip(new_tokens, extras)]
    k_cache, v_cache, table = make_case(seq_lens, 8, 2, 16, torch.float64, gen)
    cu = torch.tensor([0] + list(torch.tensor(new_tokens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 6, 16, generator=gen, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K.paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.4)
    assert not out.isnan().any()
    for b, (n, m) in enumerate(zip(seq_lens, new_tokens)):
        for j in range(0, m, 9):
            want = naive_attention_row(q[cu[b] + j], k_cache, v_cache, table[b], n - m + j + 1, 0.4)
            torch.testing.assert_close(out[cu[b] + j], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ref_half_precision_accumulates_in_fp32(dtype):
    gen = torch.Generator().manual_seed(7)
    seq_lens = [6, 0, 300]
    k_cache, v_cache, table = make_case(seq_lens, 16, 2, 64, dtype, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.125)
    ref = K.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape and (out[1] == 0).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)  # output rounding only


def test_write_kv_and_copy_blocks_ref():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = make_pool(6, 4, 2, 8, torch.float32, gen)
    k = torch.randn(4, 2, 8, generator=gen)
    v = torch.randn(4, 2, 8, generator=gen)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    K.write_kv_ref(k, v, k_cache, v_cache, torch.tensor([5, -1, 17, 3]))
    for i, slot in [(0, 5), (2, 17), (3, 3)]:
        expect_k[slot // 4, slot % 4], expect_v[slot // 4, slot % 4] = k[i], v[i]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    K.copy_blocks_ref(k_cache, v_cache, [1, 4], [5, 0])
    expect_k[5], expect_k[0], expect_v[5], expect_v[0] = expect_k[1], expect_k[4], expect_v[1], expect_v[4]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


# ---------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------

def test_dispatch_rule(monkeypatch):
    t32, t64 = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert K.resolve_backend(None, t32) == "torch"  # CPU tensor, no interpreter
    assert K.resolve_backend("torch", t32) == "torch"
    if K.HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert K.resolve_backend(None, t32) == "triton"
        assert K.resolve_backend(None, t64) == "torch"  # fp64 is the oracle's dtype: always the twin
        assert K.resolve_backend("torch", t32) == "torch"
    with pytest.raises(AssertionError):
        K.resolve_backend("cuda", t32)


# ---------------------------------------------------------------------------------------------------
# Triton decode under the interpreter
# ---------------------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_head_dims(interpret, impl, head_dim):
    check_decode([37, 0, 130], 16, 2, 4, head_dim, torch.float32, seed=head_dim, num_splits=2, impl=impl)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_decode_block_sizes(interpret, impl, block_size):
    # lengths: one token, a whole block, one past a block, and a long ragged one
    lens = [1, block_size, block_size + 1, 2 * block_size + 75]
    check_decode(lens, block_size, 2, 2, 64, torch.float32, seed=block_size, impl=impl)


@needs_triton
@pytest.mark.parametrize("num_kv_heads,group", [(4, 1), (2, 4), (2, 8), (1, 16), (1, 80)],
                         ids=["mha", "gqa4", "gqa8", "mqa16", "mqa80-two-head-tiles"])
def test_decode_gqa(interpret, impl, num_kv_heads, group):
    check_decode([70, 3], 16, num_kv_heads, group, 64, torch.float32, seed=group, num_splits=3, impl=impl)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_splits(interpret, impl, num_splits):
    # v1: 16 splits of a 150-token sequence: most are empty and must merge to nothing
    check_decode([150, 64, 0, 9], 16, 2, 4, 64, torch.float32, seed=num_splits, num_splits=num_splits,
                 impl=impl)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(interpret, impl, dtype):
    check_decode([90, 17, 0], 16, 2, 4, 128, dtype, seed=11, num_splits=2, impl=impl)


@needs_triton
def test_decode_all_empty_and_long(interpret, impl):
    check_decode([0, 0, 0], 16, 2, 4, 64, torch.float32, seed=1, impl=impl)
    check_decode([0, 0, 0], 16, 2, 4, 64, torch.float32, seed=1, num_splits=4, impl=impl)
    check_decode([700], 16, 1, 8, 64, torch.float32, seed=2, impl=impl)  # B=1: the heuristic splits it


@needs_triton
def test_decode_and_prefill_fp32_queries_over_bf16_cache(interpret, impl):
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, table = make_case([40, 7], 16, 2, 64, torch.bfloat16, gen)
    lens, cu = torch.tensor([40, 7], dtype=torch.int32), torch.tensor([0, 40, 47], dtype=torch.int32)
    q = torch.randn(47, 8, 64, generator=gen)
    for got, ref in [
        (K.paged_decode_attention(q[:2], k_cache, v_cache, table, lens, 0.125, backend="triton"),
         K.paged_decode_attention_ref(q[:2].double(), k_cache.double(), v_cache.double(), table, lens, 0.125)),
        (K.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.125, backend="triton"),
         K.paged_prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, cu, lens, 0.125)),
    ]:
        assert got.dtype == torch.float32  # q's dtype; q is rounded to the cache dtype for the dot
        torch.testing.assert_close(got.double(), ref, rtol=3e-2, atol=3e-2)


@needs_triton
@bounded(25)
@given(data=st.data())
def test_decode_random_shapes(interpret, data):
    num_kv_heads = data.draw(st.integers(1, 3), "Hkv")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 8]), "group")
    head_dim = data.draw(st.sampled_from([64, 80, 96, 128]), "head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), "block_size")
    seq_lens = data.draw(st.lists(st.integers(0, 160), min_size=1, max_size=4), "seq_lens")
    num_splits = data.draw(st.sampled_from([None, 1, 2, 3]), "num_splits")
    check_decode(seq_lens, block_size, num_kv_heads, group, head_dim, torch.float32,
                 seed=len(seq_lens), num_splits=num_splits)


@needs_triton
def test_decode_split_heuristic_v1():
    from pagedchat.kernels.triton_attention_v1 import choose_num_splits as n

    cpu = torch.device("cpu")
    assert n(batch=1, programs_per_seq=8, max_len=32768, block_n=64, device=cpu) > 1
    assert n(batch=256, programs_per_seq=8, max_len=32768, block_n=64, device=cpu) == 1
    assert n(batch=1, programs_per_seq=1, max_len=64, block_n=64, device=cpu) == 1  # one tile: no split
    assert n(batch=1, programs_per_seq=1, max_len=10**7, block_n=64, device=cpu) <= 64


@needs_triton
def test_decode_split_plan_v2_follows_the_work():
    """The v2 plan (host mirror of the device code) on an H100/H200 (132 SMs, 4 programs per SM), headline
    shape: 8 KV heads, 64-key tiles, at least 4 tiles per split."""
    from pagedchat.kernels.triton_attention_v2 import _MAX_SPLITS, split_counts

    target, heads = 132 * 4, 8

    def plan(lens, **kw):
        splits = split_counts(lens, heads, 64, 4, target, **kw)
        assert sum(splits) <= len(lens) + -(-target // heads), "more work items than the grid holds"
        return splits

    one_long = plan([32768])
    assert one_long[0] * heads >= 132, "batch 1 at 32k spreads over the whole GPU"
    assert plan([4096] * 256) == [1] * 256, "a large batch is not split"
    assert set(plan([4096] * 64)) == {2}, "batch 64 at 4k: two splits each (1,024 programs)"
    mixed = plan([32768] + [16] * 63)
    assert mixed[0] > 8 and set(mixed[1:]) == {1}, "only the long sequence of a mixed batch splits"
    assert plan([0, 1, 0]) == [1, 1, 1]
    assert max(split_counts([1 << 24], 1, 16, 1, 10**6)) == _MAX_SPLITS
    windowed = plan([32768], window=4096)
    assert windowed[0] < one_long[0], "a window reads (and splits) its last keys only"


# ---------------------------------------------------------------------------------------------------
# Triton prefill under the interpreter
# ---------------------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_prefill_head_dims(interpret, impl, head_dim):
    # a full prompt, a chunk over a cached prefix, a single new token
    check_prefill([20, 45, 33], [20, 9, 1], 16, 2, 2, head_dim, torch.float32, seed=head_dim, impl=impl)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_prefill_block_sizes(interpret, impl, block_size):
    check_prefill([block_size + 3, 2 * block_size], [5, block_size], block_size, 2, 1, 64, torch.float32,
                  seed=block_size, impl=impl)


@needs_triton
@pytest.mark.parametrize("num_kv_heads,group", [(3, 1), (2, 3), (2, 4), (1, 8), (1, 32)],
                         ids=["mha", "gqa3", "gqa4", "gqa8", "mqa32"])
def test_prefill_gqa(interpret, impl, num_kv_heads, group):
    # the 70-token chunk spans several query tiles (tile = 128 rows / padded group)
    check_prefill([90, 12], [70, 12], 16, num_kv_heads, group, 64, torch.float32, seed=group, impl=impl)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(interpret, impl, dtype):
    check_prefill([50, 30], [50, 7], 16, 2, 4, 128, dtype, seed=5, impl=impl)


@needs_triton
def test_prefill_sequence_without_new_tokens(interpret, impl):
    # a sequence in the middle of the batch contributes no query rows
    check_prefill([25, 40, 9], [4, 0, 9], 8, 2, 2, 64, torch.float32, seed=3, impl=impl)


@needs_triton
@bounded(15)
@given(data=st.data())
def test_prefill_random_shapes(interpret, data):
    num_kv_heads = data.draw(st.integers(1, 2), "Hkv")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 8]), "group")
    head_dim = data.draw(st.sampled_from([64, 80, 96]), "head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), "block_size")
    seq_lens = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=3), "seq_lens")
    new_tokens = [data.draw(st.integers(0, n), "new") for n in seq_lens]
    check_prefill(seq_lens, new_tokens, block_size, num_kv_heads, group, head_dim, torch.float32,
                  seed=sum(seq_lens))


# ---------------------------------------------------------------------------------------------------
# v2 sweeps over sizes the tests above do not use: every head dim 32..256, GQA groups 1..32 (odd ones
# too), page sizes 8..128 (and one that is not a power of two), fp32 / bf16 / fp16, windows and softcap,
# empty and one-token sequences, in NaN-poisoned pools. CI runs a covering subset (each value of each axis
# at least once); PAGEDCHAT_SLOW=1 runs many more combinations.
# ---------------------------------------------------------------------------------------------------

SWEEP_HEAD_DIMS = [32, 40, 48, 64, 80, 96, 128, 256]
SWEEP_HEADS = [(1, 1), (3, 1), (7, 1), (2, 3), (1, 5), (3, 4), (1, 7), (1, 9), (2, 16), (1, 32)]  # (Hkv, group)
SWEEP_BLOCKS = [8, 16, 24, 32, 64, 128]
SWEEP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SWEEP_MODES = [{}, {"sliding_window": 19}, {"softcap": 5.0}, {"sliding_window": 40, "softcap": 30.0}]


def sweep_cases():
    """(CI cases, slow cases): ten combinations in which every value of every axis appears, and 80 seeded draws."""
    ci = [(SWEEP_HEAD_DIMS[i % 8], SWEEP_HEADS[i % 10], SWEEP_BLOCKS[i % 6], SWEEP_DTYPES[i % 3],
           SWEEP_MODES[(i // 3) % 4]) for i in range(10)]
    rng = random.Random(29)
    axes = [SWEEP_HEAD_DIMS, SWEEP_HEADS, SWEEP_BLOCKS, SWEEP_DTYPES, SWEEP_MODES]
    slow = [tuple(rng.choice(axis) for axis in axes) for _ in range(80)]
    return ci, [c for c in slow if c not in ci]


def sweep_params():
    ci, slow = sweep_cases()

    def ident(i, c):
        return f"{i}-d{c[0]}-h{c[1][0]}x{c[1][1]}-b{c[2]}-{str(c[3])[6:]}-{'-'.join(c[4]) or 'plain'}"

    return [pytest.param(*c, id=ident(i, c), marks=SLOW if i >= len(ci) else ()) for i, c in enumerate(ci + slow)]


def test_sweep_subset_covers_every_value():
    ci, _ = sweep_cases()
    for axis, values in enumerate([SWEEP_HEAD_DIMS, SWEEP_HEADS, SWEEP_BLOCKS, SWEEP_DTYPES, SWEEP_MODES]):
        assert all(v in [c[axis] for c in ci] for v in values)


@needs_triton
@pytest.mark.parametrize("head_dim,heads,block_size,dtype,mode", sweep_params())
def test_v2_sweep(interpret, head_dim, heads, block_size, dtype, mode):
    num_kv_heads, group = heads
    seed = head_dim + block_size + group
    # decode: empty, one token, a page boundary, a long one; split by the plan on 4 SMs, then finely
    lens = [0, 1, block_size, block_size + 1, 3 * block_size + 29]
    check_decode(lens, block_size, num_kv_heads, group, head_dim, dtype, seed=seed, impl="v2", **mode)
    check_decode(lens[1:], block_size, num_kv_heads, group, head_dim, dtype, seed=seed, num_splits=4, impl="v2",
                 **mode)
    # prefill: a whole prompt, a chunk over a cached prefix, one new token, a sequence without new tokens
    check_prefill([37, 2 * block_size + 5, 9, 20], [37, 11, 1, 0], block_size, num_kv_heads, group, head_dim,
                  dtype, seed=seed, impl="v2", **mode)


# ---------------------------------------------------------------------------------------------------
# The Qwen2 shape that diverged inside the engine on an H200: MHA (7 query = 7 KV heads), head_dim 32,
# ~1,600-token contexts over 16-token blocks, a batch of 4 of mixed lengths and 4 forks of one prompt,
# split counts as a 132-SM GPU chooses them for a CUDA-graph table sized for a 4,096-token model
# ---------------------------------------------------------------------------------------------------

QWEN2 = dict(block_size=16, num_kv_heads=7, group=1, head_dim=32)
QWEN2_TABLE_BLOCKS = 4096 // 16  # the decode graphs' table width: the model's whole context


@pytest.fixture
def h200_sms(monkeypatch):
    """The split heuristics see a 132-SM GPU (the interpreter's stand-in is 4 SMs)."""
    from pagedchat.kernels import _launch

    monkeypatch.setattr(_launch, "_CPU_SM_COUNT", 132)


def make_fork_case(prefix_len, extras, block_size, num_kv_heads, head_dim, dtype, gen):
    """len(extras) forks of one prompt: their tables share the prompt's full blocks; each fork owns its
    last (copied-on-write) block and `extra` more tokens. Every slot outside a fork's tokens is NaN."""
    shared = prefix_len // block_size
    lens = [prefix_len + e for e in extras]
    own = [-(-n // block_size) - shared for n in lens]
    num_blocks = shared + sum(own) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(lens), QWEN2_TABLE_BLOCKS), -1, dtype=torch.int32)
    table[:, :shared] = perm[:shared]
    used = shared
    for i, n in enumerate(own):
        table[i, shared:shared + n] = perm[used:used + n]
        used += n
    prompt_k = torch.randn(prefix_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    prompt_v = torch.randn(prefix_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    for i, n in enumerate(lens):
        for t in range(n):
            block, offset = int(table[i, t // block_size]), t % block_size
            fresh = t >= prefix_len
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype) if fresh \
                else prompt_k[t]
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype) if fresh \
                else prompt_v[t]
    return k_cache, v_cache, table, lens


def check_qwen2_decode(dtype, forks, device="cpu", graph=False):
    gen = torch.Generator().manual_seed(1600 + forks)
    if forks:
        k_cache, v_cache, table, lens = make_fork_case(1593, [1, 8, 9, 40], QWEN2["block_size"],
                                                       QWEN2["num_kv_heads"], QWEN2["head_dim"], dtype, gen)
    else:
        lens = [1601, 1587, 777, 1]
        k_cache, v_cache, table = make_case(lens, QWEN2["block_size"], QWEN2["num_kv_heads"],
                                            QWEN2["head_dim"], dtype, gen)
        padded = torch.full((len(lens), QWEN2_TABLE_BLOCKS), -1, dtype=torch.int32)
        padded[:, :table.shape[1]] = table
        table = padded
    q = torch.randn(len(lens), QWEN2["num_kv_heads"], QWEN2["head_dim"], generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = QWEN2["head_dim"] ** -0.5
    ref = K.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, seq_lens, scale)
    args = [x.to(device) for x in (q, k_cache, v_cache, table, seq_lens)]
    out = torch.full_like(args[0], float("nan"))
    if graph:  # captured with other lengths, replayed with these (as the engine's decode graphs are)
        lens_buf = torch.zeros_like(args[4])
        K.paged_decode_attention(args[0], args[1], args[2], args[3], lens_buf, scale, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            K.paged_decode_attention(args[0], args[1], args[2], args[3], lens_buf, scale, out=out)
        lens_buf.copy_(args[4])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    else:
        K.paged_decode_attention(*args, scale, out=out, backend="triton")
    assert_matches_oracle(out.cpu(), ref, dtype)


def qwen2_cases(*cases):
    """Parameter tuples (impl first): the first three run in CI, the others with PAGEDCHAT_SLOW=1."""
    return [pytest.param(*c, marks=SLOW if i >= 3 else (), id="-".join(map(str, c)).replace("torch.", ""))
            for i, c in enumerate(cases)]


@needs_triton
@pytest.mark.parametrize("impl_name,dtype,forks", qwen2_cases(
    ("v2", torch.float32, False), ("v2", torch.bfloat16, True), ("v1", torch.float32, False),
    ("v2", torch.bfloat16, False), ("v2", torch.float32, True), ("v1", torch.bfloat16, True)))
def test_qwen2_shape_decode(interpret, h200_sms, monkeypatch, impl_name, dtype, forks):
    monkeypatch.setenv("PAGEDCHAT_ATTN", impl_name)
    check_qwen2_decode(dtype, forks)


@needs_triton
@pytest.mark.parametrize("impl_name,dtype", qwen2_cases(
    ("v2", torch.float32), ("v2", torch.bfloat16), ("v1", torch.float32), ("v1", torch.bfloat16)))
def test_qwen2_shape_prefill_long_prefix_short_chunks(interpret, impl_name, dtype):
    # chunked prefill's last chunks over ~1,600-token prefixes, one token, and a short whole prompt
    check_prefill([1600, 1601, 1234, 40], [64, 17, 1, 40], QWEN2["block_size"], QWEN2["num_kv_heads"],
                  QWEN2["group"], QWEN2["head_dim"], dtype, seed=1600, impl=impl_name)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen2_shape_write_kv_and_copy_blocks(interpret, dtype):
    check_write_and_copy(QWEN2["num_kv_heads"], QWEN2["head_dim"], QWEN2["block_size"], dtype, "cpu")


def check_write_and_copy(num_kv_heads, head_dim, block_size, dtype, device):
    """write_kv (strided k/v views, padding slots) then copy_blocks, bit for bit against the twins."""
    gen = torch.Generator().manual_seed(head_dim + num_kv_heads)
    shape = (12, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    kv = torch.randn(9, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([3, -1, 5 * block_size + 2, 17, -1, 40, 11 * block_size + block_size - 1, 0, 1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    K.write_kv_ref(kv[:, 0], kv[:, 1], want_k, want_v, slots)
    K.copy_blocks_ref(want_k, want_v, [0, 5, 11], [7, 8, 9])
    k_cache, v_cache, kv, slots = (x.to(device) for x in (k_cache, v_cache, kv, slots))
    K.write_kv(kv[:, 0], kv[:, 1], k_cache, v_cache, slots, backend="triton")
    K.copy_blocks(k_cache, v_cache, [0, 5, 11], [7, 8, 9], backend="triton")
    assert_same(k_cache.cpu(), want_k)
    assert_same(v_cache.cpu(), want_v)


# ---------------------------------------------------------------------------------------------------
# Quantized pools (kv_quant.py: int8 / float8 e4m3 values, a float16 scale per slot and KV head) in v2
# ---------------------------------------------------------------------------------------------------

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


@needs_triton
@pytest.mark.parametrize("kv_dtype", QUANT_DTYPES, ids=["int8", "fp8"])
def test_quantized_write_kv_and_copy_blocks_match_quantize_kv(interpret, kv_dtype):
    check_quantized_write_and_copy(kv_dtype, 3, 80, 16, "cpu")


@needs_triton
@pytest.mark.parametrize("kv_dtype,q_dtype,mode", [
    (torch.int8, torch.float32, {}), (torch.float8_e4m3fn, torch.bfloat16, {}),
    (torch.int8, torch.bfloat16, {"sliding_window": 21, "softcap": 20.0}),
    (torch.float8_e4m3fn, torch.float16, {"sliding_window": 40})], ids=["int8-fp32", "fp8-bf16", "int8-window", "fp8-fp16-window"])
def test_quantized_decode_and_prefill(interpret, kv_dtype, q_dtype, mode):
    lens, new = [0, 1, 16, 77, 150], [0, 1, 16, 9, 40]
    check_quantized("decode", lens, None, 16, 2, 4, 64, kv_dtype, q_dtype, seed=1, **mode)
    check_quantized("prefill", lens, new, 16, 2, 4, 64, kv_dtype, q_dtype, seed=2, **mode)


@needs_triton
def test_quantized_decode_splits_and_odd_shapes(interpret):
    from kernel_cases import split_options

    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, table = make_case([300, 5, 64], 8, 3, 40, torch.float32, gen)
    kq, vq, ks, vs, k64, v64 = quantize_case(k_cache, v_cache, torch.int8)
    q = torch.randn(3, 3, 40, generator=gen)
    lens = torch.tensor([300, 5, 64], dtype=torch.int32)
    out = K.paged_decode_attention_triton(q, kq, vq, table, lens, 0.2, k_scale=ks, v_scale=vs,
                                          **split_options("v2", 5))
    assert_matches_oracle(out, K.paged_decode_attention_ref(q.double(), k64, v64, table, lens, 0.2), torch.float32)


@needs_triton
def test_v1_refuses_quantized_pools_in_one_line(interpret):
    k_cache = torch.zeros(2, 16, 1, 64, dtype=torch.int8)
    scales = torch.ones(2, 16, 1, dtype=torch.float16)
    q, table, lens = torch.zeros(1, 1, 64), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="PAGEDCHAT_ATTN=v2"):
        K.paged_decode_attention(q, k_cache, k_cache, table, lens, 0.1, backend="triton", impl="v1", k_scale=scales,
                                 v_scale=scales)


# ---------------------------------------------------------------------------------------------------
# write_kv / copy_blocks under the interpreter
# ---------------------------------------------------------------------------------------------------

def assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_write_kv(interpret, slot_dtype, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    shape = (7, 16, 3, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # k and v as strided views of one fused projection output, as a model produces them
    kv = torch.randn(6, 2, 3, head_dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, -1, 111, 17, -1, 40], dtype=slot_dtype)  # -1: padding, skipped
    want_k, want_v = k_cache.clone(), v_cache.clone()
    K.write_kv_ref(k, v, want_k, want_v, slots)
    K.write_kv(k, v, k_cache, v_cache, slots, backend="triton")
    assert_same(k_cache, want_k)
    assert_same(v_cache, want_v)


@needs_triton
@pytest.mark.parametrize("as_list", [True, False])
def test_copy_blocks(interpret, as_list):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = make_pool(9, 8, 2, 80, torch.bfloat16, gen)
    k_cache[5] = float("nan")  # a poisoned block that is copied over
    src, dst = [1, 2, 6], [5, 8, 0]
    if not as_list:
        src, dst = torch.tensor(src, dtype=torch.int32), torch.tensor(dst)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    K.copy_blocks_ref(want_k, want_v, src, dst)
    K.copy_blocks(k_cache, v_cache, src, dst, backend="triton")
    assert_same(k_cache, want_k)
    assert_same(v_cache, want_v)
    K.copy_blocks(k_cache, v_cache, [], [], backend="triton")  # nothing to copy is fine
    layers_k, layers_v = [k_cache.clone(), k_cache.clone()], [v_cache.clone(), v_cache.clone()]
    K.copy_blocks_all_layers(layers_k, layers_v, [3], [4], backend="triton")
    assert all(torch.equal(c[4], c[3]) for c in layers_k + layers_v)


@needs_triton
def test_write_kv_empty(interpret):
    k_cache = torch.zeros(2, 4, 1, 64)
    K.write_kv(torch.zeros(0, 1, 64), torch.zeros(0, 1, 64), k_cache, k_cache.clone(),
               torch.zeros(0, dtype=torch.int64), backend="triton")


# ---------------------------------------------------------------------------------------------------
# int64 addressing: blocks past 2**31 elements of a 4 GiB virtual cache
# ---------------------------------------------------------------------------------------------------

_BIG_POOL_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from pagedchat import kernels as K
    bs, H, D = 16, 1, 64
    nb = 2**31 // (bs * H * D) + 8  # 2**31 + 8192 fp16 elements: only the blocks we write are touched
    try:
        kc = torch.empty(nb, bs, H, D, dtype=torch.float16)
        vc = torch.empty(nb, bs, H, D, dtype=torch.float16)
    except RuntimeError:
        print("SKIP: cannot reserve 8 GiB of virtual memory"); sys.exit(0)
    g = torch.Generator().manual_seed(0)
    hi = torch.arange(nb - 6, nb, dtype=torch.int32)  # block id * 1024 > 2**31: int32 math would wrap
    kc[nb - 6:] = torch.randn(6, bs, H, D, generator=g).half()
    vc[nb - 6:] = torch.randn(6, bs, H, D, generator=g).half()
    table, lens = torch.stack([hi[:3], hi[3:]]), torch.tensor([40, 37], dtype=torch.int32)
    q = torch.randn(2, 4, D, generator=g).half()
    out = K.paged_decode_attention(q, kc, vc, table, lens, 0.125, backend="triton")
    ref = K.paged_decode_attention_ref(q, kc, vc, table, lens, 0.125)
    assert (out.float() - ref.float()).abs().max() < 2e-3, "decode"
    cu, qp = torch.tensor([0, 5, 12], dtype=torch.int32), torch.randn(12, 4, D, generator=g).half()
    out = K.paged_prefill_attention(qp, kc, vc, table, cu, lens, 0.125, backend="triton")
    ref = K.paged_prefill_attention_ref(qp, kc, vc, table, cu, lens, 0.125)
    assert (out.float() - ref.float()).abs().max() < 2e-3, "prefill"
    k, v = torch.randn(3, H, D, generator=g).half(), torch.randn(3, H, D, generator=g).half()
    slots = torch.tensor([(nb - 2) * bs + 3, -1, (nb - 1) * bs + 15])
    K.write_kv(k, v, kc, vc, slots, backend="triton")
    assert torch.equal(kc[nb - 2, 3], k[0]) and torch.equal(vc[nb - 1, 15], v[2]), "write_kv"
    K.copy_blocks(kc, vc, torch.tensor([nb - 6]), torch.tensor([nb - 1]), backend="triton")
    assert torch.equal(kc[nb - 1], kc[nb - 6]) and torch.equal(vc[nb - 1], vc[nb - 6]), "copy_blocks"
    print("OK")
""")


@needs_triton
@pytest.mark.skipif(sys.platform != "linux", reason="relies on lazily committed virtual memory")
def test_int64_addressing_past_2_to_31_elements():
    # In a subprocess: with int32 offsets the kernel reads 4 GiB before the cache and segfaults.
    proc = subprocess.run([sys.executable, "-c", _BIG_POOL_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.strip().endswith("OK")


# ---------------------------------------------------------------------------------------------------
# GPU (compiled Triton, bf16)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group",
                         [(128, 16, 8, 4), (64, 8, 4, 1), (80, 32, 2, 8), (96, 128, 1, 16), (256, 16, 2, 4)])
def test_gpu_decode_bf16(compiled, impl, head_dim, block_size, num_kv_heads, group):
    lens = [0, 1, block_size, 1000, 4097, 33]
    for splits in (None, 1, 7):
        check_decode(lens, block_size, num_kv_heads, group, head_dim, torch.bfloat16, seed=head_dim,
                     num_splits=splits, device="cuda")
    check_decode(lens, block_size, num_kv_heads, group, head_dim, torch.float32, seed=1, device="cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group",
                         [(128, 16, 8, 4), (64, 8, 4, 1), (80, 32, 2, 8), (96, 128, 1, 32), (256, 16, 2, 4)])
def test_gpu_prefill_bf16(compiled, impl, head_dim, block_size, num_kv_heads, group):
    check_prefill([300, 1000, 77, 5], [300, 129, 1, 0], block_size, num_kv_heads, group, head_dim,
                  torch.bfloat16, seed=head_dim, device="cuda")
    check_prefill([300, 64], [100, 64], block_size, num_kv_heads, group, head_dim, torch.float32, seed=2,
                  device="cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_write_and_copy_bf16(compiled):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = [c.cuda() for c in make_pool(64, 16, 8, 128, torch.bfloat16, gen)]
    k = torch.randn(100, 8, 128, generator=gen).bfloat16().cuda()
    v = torch.randn(100, 8, 128, generator=gen).bfloat16().cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:100].cuda()
    slots[::7] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    K.write_kv_ref(k, v, want_k, want_v, slots)
    K.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    K.copy_blocks(k_cache, v_cache, [1, 2, 3], [60, 61, 62])
    K.copy_blocks_ref(want_k, want_v, [1, 2, 3], [60, 61, 62])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("forks", [False, True], ids=["batch4", "forks4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_qwen2_shape_decode(compiled, impl, dtype, forks, graph):
    check_qwen2_decode(dtype, forks, device="cuda", graph=graph)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen2_shape_prefill_write_and_copy(compiled, impl, dtype):
    check_prefill([1600, 1601, 1234, 40], [64, 17, 1, 40], QWEN2["block_size"], QWEN2["num_kv_heads"],
                  QWEN2["group"], QWEN2["head_dim"], dtype, seed=1600, device="cuda")
    check_prefill([1600, 700], [1600, 700], QWEN2["block_size"], QWEN2["num_kv_heads"], QWEN2["group"],
                  QWEN2["head_dim"], dtype, seed=1601, device="cuda")
    check_write_and_copy(QWEN2["num_kv_heads"], QWEN2["head_dim"], QWEN2["block_size"], dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_decode_is_cuda_graph_capturable(compiled, impl):
    """No host sync in decode: capture once, replay with new lengths."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = [c.cuda() for c in make_pool(256, 16, 8, 128, torch.bfloat16, gen)]
    table = torch.randperm(256, generator=gen)[:4 * 64].view(4, 64).int().cuda()
    lens = torch.tensor([100, 1, 0, 1024], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 32, 128, generator=gen).bfloat16().cuda()
    out = torch.empty_like(q)
    K.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.088, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.088, out=out)
    lens.copy_(torch.tensor([7, 500, 16, 3], dtype=torch.int32))
    graph.replay()
    ref = K.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, lens, 0.088)
    assert_matches_oracle(out.cpu(), ref.cpu(), torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("window,softcap", [(100, None), (None, 30.0), (1000, 50.0)])
def test_gpu_window_and_softcap(compiled, impl, window, softcap):
    lens = [0, 1, 99, 100, 101, 1000, 4097]
    for dtype in (torch.bfloat16, torch.float32):
        check_decode(lens, 16, 2, 4, 128, dtype, seed=3, device="cuda", sliding_window=window, softcap=softcap)
        check_prefill([300, 1000, 4097], [300, 129, 1], 16, 2, 4, 128, dtype, seed=4, device="cuda",
                      sliding_window=window, softcap=softcap)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_v2_prefill_is_cuda_graph_capturable(compiled):
    """v2 prefill sizes its grid from static sizes: a captured extend step replays with new lengths."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = [c.cuda() for c in make_pool(512, 16, 8, 128, torch.bfloat16, gen)]
    table = torch.randperm(512, generator=gen)[:4 * 128].view(4, 128).int().cuda()
    cu = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32, device="cuda")
    lens = torch.tensor([100, 8, 50, 2000], dtype=torch.int32, device="cuda")
    q = torch.randn(32, 32, 128, generator=gen).bfloat16().cuda()
    out = torch.empty_like(q)
    K.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.088, out=out, impl="v2")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.088, out=out, impl="v2")
    cu.copy_(torch.tensor([0, 1, 9, 25, 32], dtype=torch.int32))
    lens.copy_(torch.tensor([1, 700, 16, 1031], dtype=torch.int32))
    graph.replay()
    ref = K.paged_prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, cu, lens, 0.088)
    assert_matches_oracle(out.cpu(), ref.cpu(), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# `bench kernels` on CPU: its case builders, both implementations, tuning and the goals table run under the
# interpreter on tiny shapes, so a GPU run does not discover a broken benchmark
# ---------------------------------------------------------------------------------------------------

class _CpuTimer:
    last_mode = "eager"

    def __call__(self, fn, graph=True):
        import time

        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


@needs_triton
def test_bench_kernels_runs_both_implementations_on_cpu(interpret, monkeypatch, tmp_path):
    from dataclasses import replace

    from pagedchat.bench import kernels as B
    from pagedchat.kernels import triton_attention_configs as C

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "_fits", lambda torch_, nbytes: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setenv(C.CONFIGS_ENV, str(tmp_path / "configs.json"))
    monkeypatch.setattr(C, "device_key", lambda device: "cpu-test")
    monkeypatch.setattr(C, "decode_candidates", lambda d, t: [C.default_decode(d, t), C.DecodeConfig(16, 4, 2, 2, 1)])
    monkeypatch.setattr(C, "prefill_candidates", lambda d, t, s: [C.default_prefill(d, t, s),
                                                                   C.PrefillConfig(32, 16, 4, 2)])
    C.forget_measured()
    timer, tiny = _CpuTimer(), replace(B.HEADLINE, batch=2, context=40, q_heads=4, kv_heads=2, head_dim=32)
    rows = B.bench_decode(torch, timer, tiny, "batch", torch.float32, 1000.0, None)
    rows += B.bench_prefill(torch, timer, 1, 24, 24, torch.float32, 100.0)
    assert [r["impl"] for r in rows] == ["v1", "v2", "v1", "v2"] and all(r["vs_sdpa"] > 0 for r in rows)
    goals = B.goal_rows([dict(kernel="decode", batch=64, context=4096, new_tokens=None, block_size=16, kv_heads=8,
                              impl="v2", copy_frac=0.9, vs_sdpa=0.9)])
    assert {(g["figure"], g["met"]) for g in goals} == {("copy_frac", True), ("vs_sdpa", False)}
    monkeypatch.setattr(B, "HEADLINE", tiny)  # the prefill cases' shape
    tuned = B.tune(torch, timer, torch.float32, [tiny], [(1, 24, 24)])
    assert tuned[-1]["classes"] == 2 and (tmp_path / "configs.json").exists()
    assert C.decode_config(32, 2, 16, torch.float32, "batch8", torch.device("cpu")) == \
        C.DecodeConfig(**next(r for r in tuned if "decode" in r.get("shape_class", ""))["config"])
    C.forget_measured()


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("kv_dtype", QUANT_DTYPES, ids=["int8", "fp8"])
def test_gpu_quantized_pools(compiled, kv_dtype):
    check_quantized_write_and_copy(kv_dtype, 8, 128, 16, "cuda")
    lens, new = [0, 1, 16, 1000, 4097], [0, 1, 16, 129, 300]
    for q_dtype in (torch.bfloat16, torch.float32):
        check_quantized("decode", lens, None, 16, 8, 4, 128, kv_dtype, q_dtype, seed=1, device="cuda")
        check_quantized("prefill", lens, new, 16, 8, 4, 128, kv_dtype, q_dtype, seed=2, device="cuda")
    check_quantized("decode", lens, None, 16, 2, 4, 128, kv_dtype, torch.bfloat16, seed=3, device="cuda",
                    sliding_window=100, softcap=30.0)


# ---------------------------------------------------------------------------------------------------
# Compiled for Hopper (sm_90) on this machine: what the interpreter cannot see (a construct only the compiler
# rejects, registers spilled). The whole table: python scripts/kernel_resources.py
# ---------------------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("case", [
    ("decode", 128, 4, 16, torch.bfloat16, "batch64", None, False),        # the headline, whole pages per tile
    ("decode", 32, 1, 16, torch.float32, "batch8", None, False),           # the Qwen2 shape (IEEE fp32 dots)
    ("decode", 64, 2, 24, torch.bfloat16, "batch1", torch.int8, True),     # per-token table, quantized, window
    ("prefill", 128, 4, 16, torch.bfloat16, "long", None, True),           # every masking phase
    ("prefill", 128, 4, 128, torch.bfloat16, "extend64", torch.float8_e4m3fn, False),
    ("prefill", 128, 4, 16, torch.float32, "long", None, False),           # IEEE fp32 dots (FMA units)
], ids=["decode-headline", "decode-qwen2-fp32", "decode-int8-window-page24", "prefill-window-softcap",
        "prefill-fp8-page128", "prefill-fp32"])
def test_v2_compiles_for_sm90_without_spills(case):
    from pagedchat.bench import kernel_resources as R

    kind, head_dim, group, block, dtype, size, kv_dtype, window_softcap = case
    c = R.Case(kind, head_dim, group, block, dtype, size, kv_dtype, window_softcap)
    try:
        rows = list(R.resource_rows([c]))
    except R.Unavailable as exc:
        pytest.skip(str(exc))
    for row in rows:
        assert row["resources"].spill_stores == row["resources"].spill_loads == 0, R.markdown_row(row)


@needs_triton
def test_compiled_kernels_keep_their_constexpr_parameters():
    """The compiled-mode kernel (its helpers jitted into a copy of the function) declares the same constexprs as
    the source: Triton reads them from the annotations, and without them a GPU launch fails to specialize."""
    import importlib
    import inspect

    from pagedchat.kernels._launch import compiled

    checked = 0
    for module_name in ("triton_attention_v1", "triton_attention_v2", "triton_cache", "triton_gguf", "triton_int4",
                        "triton_moe", "triton_fused"):
        module = importlib.import_module(f"pagedchat.kernels.{module_name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            annotated = {p for p, a in fn.__annotations__.items() if "constexpr" in str(a)}
            if fn.__module__ != module.__name__ or not annotated:
                continue
            jit = compiled(fn)
            assert {p.name for p in jit.params if p.is_constexpr} == annotated, name
            checked += 1
    assert checked >= 8
