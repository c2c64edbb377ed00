"""Sliding-window and soft-capped paged attention (Gemma 2/3): the torch twin against a dense oracle, the
Triton kernels under the interpreter against the twin in float64, and neither reading a block before the
window (the pool releases those)."""

import pytest
import torch

from pagedchat import kernels as K


def dense_oracle(q, k, v, scale, positions, window, softcap):
    """Plain attention over one sequence's contiguous keys [L, Hkv, D] for queries at `positions`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key = torch.arange(k.shape[0])[None, :]
    visible = key <= positions[:, None]
    if window:
        visible &= key > positions[:, None] - window
    return torch.einsum("hml,lhd->mhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def paged_case(lens, block_size=8, kv_heads=2, group=2, dim=16, seed=0, poison_before=None):
    """Random caches and shuffled tables; blocks wholly before `poison_before[i]` get NaN K/V and id -1."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 2
    kc = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g, dtype=torch.float64)
    vc = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g, dtype=torch.float64)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(per_seq)), 0, dtype=torch.int32)
    contiguous = []
    for i, n in enumerate(lens):
        own = [ids.pop() for _ in range(per_seq[i])]
        tables[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
        contiguous.append((kc[own].flatten(0, 1)[:n].clone(), vc[own].flatten(0, 1)[:n].clone()))
        if poison_before is not None:
            for b in range(poison_before[i] // block_size):
                kc[own[b]], vc[own[b]] = float("nan"), float("nan")
                tables[i, b] = -1
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g, dtype=torch.float64) * 3
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), contiguous


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (24, 3.0), (None, 2.0), (1, None), (500, None)])
def test_windowed_twin_equals_dense_oracle_and_never_reads_before_the_window(window, softcap):
    lens = [1, 7, 30, 77, 100]
    poison = [max(0, n - window) for n in lens] if window else None
    q, kc, vc, tables, seq_lens, contiguous = paged_case(lens, poison_before=poison)
    out = K.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, sliding_window=window, softcap=softcap,
                                   backend="torch")
    for i, (k, v) in enumerate(contiguous):
        expected = dense_oracle(q[i:i + 1], k, v, 0.3, torch.tensor([lens[i] - 1]), window, softcap)
        torch.testing.assert_close(out[i:i + 1], expected)
    # prefill: the last few tokens of each sequence as a chunk
    chunks = [1, 3, 16, 7, 33]
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), q.shape[1], q.shape[2], dtype=torch.float64)
    if window:  # the chunk's first query still sees `window` keys back: poison only before that
        q_, kc, vc, tables, seq_lens, _ = paged_case(lens, poison_before=[max(0, n - c - window + 1)
                                                                          for n, c in zip(lens, chunks)])
    out = K.paged_prefill_attention(qp, kc, vc, tables, cu, seq_lens, 0.3, sliding_window=window, softcap=softcap,
                                    backend="torch")
    for i, (k, v) in enumerate(contiguous):
        positions = torch.arange(lens[i] - chunks[i], lens[i])
        expected = dense_oracle(qp[cu[i]:cu[i + 1]], k, v, 0.3, positions, window, softcap)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], expected)


@pytest.mark.parametrize("window,softcap,dtype", [(5, None, torch.float32), (24, 3.0, torch.float32),
                                                  (None, 2.0, torch.float32), (40, 50.0, torch.float16),
                                                  (17, None, torch.bfloat16)])
@pytest.mark.parametrize("impl", ["v1", "v2"])
def test_triton_window_and_softcap_match_the_twin_under_the_interpreter(monkeypatch, window, softcap, dtype, impl):
    if not K.HAS_TRITON:
        pytest.skip("triton not installed")
    from kernel_cases import split_options

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lens = [1, 7, 30, 77, 100]
    poison = [max(0, n - window) for n in lens] if window else None
    q, kc, vc, tables, seq_lens, _ = paged_case(lens, poison_before=poison, seed=1)
    tol = {torch.float32: (1e-3, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    expected = K.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, sliding_window=window, softcap=softcap,
                                        backend="torch")
    for splits in (1, 3):
        out = K.paged_decode_attention_triton(q.to(dtype), kc.to(dtype), vc.to(dtype), tables, seq_lens, 0.3,
                                              sliding_window=window, softcap=softcap, **split_options(impl, splits))
        torch.testing.assert_close(out.double(), expected, rtol=tol[0], atol=tol[1])
    chunks = [1, 3, 16, 7, 33]
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    poison = [max(0, n - c - window + 1) for n, c in zip(lens, chunks)] if window else None
    _, kc, vc, tables, seq_lens, _ = paged_case(lens, poison_before=poison, seed=2)
    qp = torch.randn(int(cu[-1]), q.shape[1], q.shape[2], dtype=torch.float64)
    expected = K.paged_prefill_attention(qp, kc, vc, tables, cu, seq_lens, 0.3, sliding_window=window,
                                         softcap=softcap, backend="torch")
    out = K.paged_prefill_attention(qp.to(dtype), kc.to(dtype), vc.to(dtype), tables, cu, seq_lens, 0.3,
                                    sliding_window=window, softcap=softcap, backend="triton", impl=impl)
    torch.testing.assert_close(out.double(), expected, rtol=tol[0], atol=tol[1])
