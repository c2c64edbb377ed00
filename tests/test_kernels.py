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
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedchat import kernels as K

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the interpreter runs a kernel's programs one by one in Python: wide sweeps run with PAGEDCHAT_SLOW=1
SLOW = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("PAGEDCHAT_SLOW") != "1",
                                             reason="slow: set PAGEDCHAT_SLOW=1")]

def bounded(examples: int):
    """Hypothesis settings for interpreter tests: few examples (the interpreter is slow), reproducible."""
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Kernel-vs-oracle tolerances. fp32 must meet the 1e-3 relative bar; half precision is limited by
# rounding the softmax weights to the input dtype before the P @ V dot (as flash attention does).
TOL = {torch.float32: (1e-3, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------

def make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache


def make_tables(seq_lens, block_size, num_blocks, gen, pad_blocks=1):
    """Random distinct physical blocks per sequence; unused table entries are -1 (must be ignored)."""
    need = [-(-n // block_size) for n in seq_lens]
    width = max(need + [0]) + pad_blocks
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return table


def make_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3):
    """A pool where only the slots inside each sequence hold data: every other slot is NaN.

    A kernel that reads past a sequence's end, a padded table entry or a masked tail and lets it reach
    the output (even as 0 * NaN) produces NaN.
    """
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare_blocks
    table = make_tables(seq_lens, block_size, num_blocks, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, n in enumerate(seq_lens):
        for t in range(n):
            block, offset = int(table[i, t // block_size]), t % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, table


def assert_matches_oracle(out, ref64, dtype):
    """out (kernel, `dtype`) against the float64 twin run on the same rounded inputs."""
    assert out.dtype == dtype
    assert not out.isnan().any(), "NaN in the output"
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
    torch.testing.assert_close(out.double(), ref64, rtol=rtol, atol=atol * scale)


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

def check_decode(seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, num_splits=None,
                 device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = K.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, lens, scale)
    args = [x.to(device) for x in (q, k_cache, v_cache, table, lens)]
    out = torch.full_like(args[0], float("nan"))  # every row must be written
    if num_splits is None:
        got = K.paged_decode_attention(*args, scale, out=out, backend="triton")
    else:
        got = K.paged_decode_attention_triton(*args, scale, out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    assert_matches_oracle(out.cpu(), ref, dtype)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert (out[b] == 0).all(), "a zero-length sequence attends to nothing: zeros"


@needs_triton
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_head_dims(interpret, head_dim):
    check_decode([37, 0, 130], 16, 2, 4, head_dim, torch.float32, seed=head_dim, num_splits=2)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_decode_block_sizes(interpret, block_size):
    # lengths: one token, a whole block, one past a block, and a long ragged one
    lens = [1, block_size, block_size + 1, 2 * block_size + 75]
    check_decode(lens, block_size, 2, 2, 64, torch.float32, seed=block_size)


@needs_triton
@pytest.mark.parametrize("num_kv_heads,group", [(4, 1), (2, 4), (2, 8), (1, 16), (1, 80)],
                         ids=["mha", "gqa4", "gqa8", "mqa16", "mqa80-two-head-tiles"])
def test_decode_gqa(interpret, num_kv_heads, group):
    check_decode([70, 3], 16, num_kv_heads, group, 64, torch.float32, seed=group, num_splits=3)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_splits(interpret, num_splits):
    # 16 splits of a 150-token sequence: most are empty and must merge to nothing
    check_decode([150, 64, 0, 9], 16, 2, 4, 64, torch.float32, seed=num_splits, num_splits=num_splits)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(interpret, dtype):
    check_decode([90, 17, 0], 16, 2, 4, 128, dtype, seed=11, num_splits=2)


@needs_triton
def test_decode_all_empty_and_long(interpret):
    check_decode([0, 0, 0], 16, 2, 4, 64, torch.float32, seed=1)
    check_decode([0, 0, 0], 16, 2, 4, 64, torch.float32, seed=1, num_splits=4)
    check_decode([700], 16, 1, 8, 64, torch.float32, seed=2)  # B=1: the heuristic splits it


@needs_triton
def test_decode_and_prefill_fp32_queries_over_bf16_cache(interpret):
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
def test_decode_split_heuristic():
    cpu = torch.device("cpu")
    n = K.triton_attention.choose_num_splits
    assert n(batch=1, programs_per_seq=8, max_len=32768, block_n=64, device=cpu) > 1
    assert n(batch=256, programs_per_seq=8, max_len=32768, block_n=64, device=cpu) == 1
    assert n(batch=1, programs_per_seq=1, max_len=64, block_n=64, device=cpu) == 1  # one tile: no split
    assert n(batch=1, programs_per_seq=1, max_len=10**7, block_n=64, device=cpu) <= 64


# ---------------------------------------------------------------------------------------------------
# Triton prefill under the interpreter
# ---------------------------------------------------------------------------------------------------

def check_prefill(seq_lens, new_tokens, block_size, num_kv_heads, group, head_dim, dtype, seed,
                  device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    cu = torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = K.paged_prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, cu, lens,
                                        scale)
    args = [x.to(device) for x in (q, k_cache, v_cache, table, cu, lens)]
    out = torch.full_like(args[0], float("nan"))
    got = K.paged_prefill_attention(*args, scale, out=out, backend="triton")
    assert got.data_ptr() == out.data_ptr()
    assert_matches_oracle(out.cpu(), ref, dtype)


@needs_triton
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_prefill_head_dims(interpret, head_dim):
    # a full prompt, a chunk over a cached prefix, a single new token
    check_prefill([20, 45, 33], [20, 9, 1], 16, 2, 2, head_dim, torch.float32, seed=head_dim)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_prefill_block_sizes(interpret, block_size):
    check_prefill([block_size + 3, 2 * block_size], [5, block_size], block_size, 2, 1, 64, torch.float32,
                  seed=block_size)


@needs_triton
@pytest.mark.parametrize("num_kv_heads,group", [(3, 1), (2, 3), (2, 4), (1, 8), (1, 32)],
                         ids=["mha", "gqa3", "gqa4", "gqa8", "mqa32"])
def test_prefill_gqa(interpret, num_kv_heads, group):
    # the 70-token chunk spans several query tiles (tile = 128 rows / padded group)
    check_prefill([90, 12], [70, 12], 16, num_kv_heads, group, 64, torch.float32, seed=group)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(interpret, dtype):
    check_prefill([50, 30], [50, 7], 16, 2, 4, 128, dtype, seed=5)


@needs_triton
def test_prefill_sequence_without_new_tokens(interpret):
    # a sequence in the middle of the batch contributes no query rows
    check_prefill([25, 40, 9], [4, 0, 9], 8, 2, 2, 64, torch.float32, seed=3)


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


@needs_triton
@pytest.mark.parametrize("dtype,forks", [(torch.float32, False), (torch.bfloat16, True),
                                         pytest.param(torch.bfloat16, False, marks=SLOW),
                                         pytest.param(torch.float32, True, marks=SLOW)],
                         ids=["fp32-batch4", "bf16-forks4", "bf16-batch4", "fp32-forks4"])
def test_qwen2_shape_decode(interpret, h200_sms, dtype, forks):
    check_qwen2_decode(dtype, forks)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen2_shape_prefill_long_prefix_short_chunks(interpret, dtype):
    # chunked prefill's last chunks over ~1,600-token prefixes, one token, and a short whole prompt
    check_prefill([1600, 1601, 1234, 40], [64, 17, 1, 40], QWEN2["block_size"], QWEN2["num_kv_heads"],
                  QWEN2["group"], QWEN2["head_dim"], dtype, seed=1600)


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
def test_gpu_decode_bf16(compiled, head_dim, block_size, num_kv_heads, group):
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
def test_gpu_prefill_bf16(compiled, head_dim, block_size, num_kv_heads, group):
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
def test_gpu_qwen2_shape_decode(compiled, dtype, forks, graph):
    check_qwen2_decode(dtype, forks, device="cuda", graph=graph)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen2_shape_prefill_write_and_copy(compiled, dtype):
    check_prefill([1600, 1601, 1234, 40], [64, 17, 1, 40], QWEN2["block_size"], QWEN2["num_kv_heads"],
                  QWEN2["group"], QWEN2["head_dim"], dtype, seed=1600, device="cuda")
    check_prefill([1600, 700], [1600, 700], QWEN2["block_size"], QWEN2["num_kv_heads"], QWEN2["group"],
                  QWEN2["head_dim"], dtype, seed=1601, device="cuda")
    check_write_and_copy(QWEN2["num_kv_heads"], QWEN2["head_dim"], QWEN2["block_size"], dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_decode_is_cuda_graph_capturable(compiled):
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
