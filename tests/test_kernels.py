"""Tests of pagedchat.kernels: the torch twins against a naive per-token float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

from pagedchat import kernels as K


# ---------------------------------------------------------------------------------------------------
# Builders shared by all tests
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
    num_blocks = 64
    k_cache, v_cache = make_pool(num_blocks, block_size, num_kv_heads, head_dim, torch.float64, gen)
    table = make_tables(seq_lens, block_size, num_blocks, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.37)
    for b, n in enumerate(seq_lens):
        want = naive_attention_row(q[b], k_cache, v_cache, table[b], n, 0.37)
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_ref_matches_naive(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    block_size, num_kv_heads, group, head_dim = [(4, 2, 2, 8), (8, 1, 3, 16), (3, 2, 1, 4)][seed]
    seq_lens = [5, 9, 1, 12][: 2 + seed]
    new_tokens = [2, 9, 1, 4][: 2 + seed]  # 9 of 9: a plain prefill; others extend a cached prefix
    num_blocks = 64
    k_cache, v_cache = make_pool(num_blocks, block_size, num_kv_heads, head_dim, torch.float64, gen)
    table = make_tables(seq_lens, block_size, num_blocks, gen)
    cu = torch.tensor([0] + list(torch.tensor(new_tokens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    out = K.paged_prefill_attention_ref(q, k_cache, v_cache, table, cu,
                                        torch.tensor(seq_lens, dtype=torch.int32), 0.5)
    for b, (n, m) in enumerate(zip(seq_lens, new_tokens)):
        for j in range(m):
            want = naive_attention_row(q[cu[b] + j], k_cache, v_cache, table[b], n - m + j + 1, 0.5)
            torch.testing.assert_close(out[cu[b] + j], want, rtol=1e-10, atol=1e-10)


def test_ref_keeps_dtype_and_zero_length():
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        k_cache, v_cache = make_pool(8, 4, 2, 8, dtype, gen)
        q = torch.randn(2, 4, 8, generator=gen).to(dtype)
        table = torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32)
        out = K.paged_decode_attention_ref(q, k_cache, v_cache, table, torch.tensor([6, 0], dtype=torch.int32), 0.3)
        assert out.dtype == dtype and out.shape == q.shape
        assert not out.isnan().any() and (out[1] == 0).all()


def test_write_kv_and_copy_blocks_ref():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = make_pool(6, 4, 2, 8, torch.float32, gen)
    k = torch.randn(4, 2, 8, generator=gen)
    v = torch.randn(4, 2, 8, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    K.write_kv_ref(k, v, k_cache, v_cache, torch.tensor([5, -1, 17, 3]))
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for i, slot in [(0, 5), (2, 17), (3, 3)]:
        expect_k[slot // 4, slot % 4], expect_v[slot // 4, slot % 4] = k[i], v[i]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    K.copy_blocks_ref(k_cache, v_cache, [1, 4], [5, 0])
    expect_k[5], expect_k[0], expect_v[5], expect_v[0] = expect_k[1], expect_k[4], expect_v[1], expect_v[4]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
