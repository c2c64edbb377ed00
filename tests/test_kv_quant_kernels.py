"""The kernels' entry points on a quantized pool (kernels/kv_quant.py: int8 / float8 values, a float16 scale per
slot and KV head): writes quantize, block copies carry the scales, and decode / prefill (windows and softcap
too) equal the float64 twin run on the dequantized caches. Slots no sequence owns have NaN scales, so a
read past a sequence's end (or before its window) shows up as NaN."""

from __future__ import annotations

import pytest
import torch

from pagedchat import kernels as K
from pagedchat.kernels.kv_quant import SCALE_DTYPE, dequantize_kv, quantize_kv

QDTYPES = [torch.int8, torch.float8_e4m3fn]
HKV, GROUP, DIM, BS = 2, 3, 16, 8


def quantized_case(lens, dtype, seed=0, poison_before=None):
    """Caches quantized from random K/V, written slot by slot through tables of shuffled blocks; every slot
    outside a sequence (or wholly before `poison_before[i]`, whose table entries become -1) has NaN scales."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BS) for n in lens]
    num_blocks = sum(per_seq) + 2
    shape = (num_blocks, BS, HKV, DIM)
    caches = [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)]
    scales = [torch.full(shape[:3], float("nan"), dtype=SCALE_DTYPE) for _ in range(2)]
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros((len(lens), max(per_seq)), dtype=torch.int32)
    for i, n in enumerate(lens):
        own = [ids.pop() for _ in range(per_seq[i])]
        tables[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
        slots = torch.tensor([own[p // BS] * BS + p % BS for p in range(n)])
        k = torch.randn(n, HKV, DIM, generator=g) * torch.logspace(-1, 1, HKV)[:, None]
        v = torch.randn(n, HKV, DIM, generator=g)
        K.write_kv(k, v, *caches, slots, k_scale=scales[0], v_scale=scales[1], backend="torch")
        for b in range((poison_before[i] if poison_before else 0) // BS):
            scales[0][own[b]] = scales[1][own[b]] = float("nan")
            tables[i, b] = -1
    return caches, scales, tables, torch.tensor(lens, dtype=torch.int32), g


def dequantized(caches, scales):
    return [dequantize_kv(c, s, torch.float64) for c, s in zip(caches, scales)]


@pytest.mark.parametrize("dtype", QDTYPES)
def test_write_kv_stores_each_heads_quantization_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(4, HKV, DIM, generator=g) * 5, torch.randn(4, HKV, DIM, generator=g)
    caches = [torch.zeros(3, BS, HKV, DIM, dtype=dtype) for _ in range(2)]
    scales = [torch.full((3, BS, HKV), -1.0, dtype=SCALE_DTYPE) for _ in range(2)]
    slots = torch.tensor([5, -1, 17, 3])
    K.write_kv(k, v, *caches, slots, k_scale=scales[0], v_scale=scales[1])
    for x, cache, scale in zip((k, v), caches, scales):
        want_values, want_scale = quantize_kv(x[[0, 2, 3]], dtype)
        flat_values, flat_scale = cache.flatten(0, 1), scale.flatten(0, 1)
        assert torch.equal(flat_values[[5, 17, 3]].view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(flat_scale[[5, 17, 3]], want_scale)
        untouched = torch.ones(3 * BS, dtype=torch.bool)
        untouched[[5, 17, 3]] = False
        assert torch.all(flat_scale[untouched] == -1), "a padding row (slot -1) was written"


def test_a_quantized_cache_without_scales_is_refused():
    caches = [torch.zeros(2, BS, HKV, DIM, dtype=torch.int8) for _ in range(2)]
    with pytest.raises(AssertionError, match="scales"):
        K.write_kv(torch.zeros(1, HKV, DIM), torch.zeros(1, HKV, DIM), *caches, torch.tensor([0]))


@pytest.mark.parametrize("dtype", QDTYPES)
def test_copy_blocks_carries_the_scales_with_the_values(dtype):
    caches, scales, *_ = quantized_case([16, 9], dtype)
    layers = [[c.clone() for c in caches] for _ in range(2)]
    layer_scales = [[s.clone() for s in scales] for _ in range(2)]
    src, dst = [0, 2], [3, 1]
    K.copy_blocks_all_layers([l[0] for l in layers], [l[1] for l in layers], src, dst,
                             k_scales=[s[0] for s in layer_scales], v_scales=[s[1] for s in layer_scales])
    for tensors in [*layers, *layer_scales]:
        for got, original in zip(tensors, caches if tensors[0].dtype == dtype else scales):
            assert torch.equal(got[dst].view(torch.uint8), original[src].view(torch.uint8))
            keep = [b for b in range(original.shape[0]) if b not in dst]
            assert torch.equal(got[keep].view(torch.uint8), original[keep].view(torch.uint8))


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("lens", [[1, 7, 30, 77], [40], [33, 35]])
def test_decode_reads_values_times_scales(dtype, lens):
    caches, scales, tables, seq_lens, g = quantized_case(lens, dtype)
    q = torch.randn(len(lens), HKV * GROUP, DIM, generator=g)
    out = K.paged_decode_attention(q, *caches, tables, seq_lens, 0.3, k_scale=scales[0], v_scale=scales[1])
    ref = K.paged_decode_attention_ref(q.double(), *dequantized(caches, scales), tables, seq_lens, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("chunks", [[1, 7, 30, 77], [1, 3, 2, 5], [4]])
def test_prefill_and_short_extends_read_values_times_scales(dtype, chunks):
    lens = [1, 7, 30, 77][:len(chunks)] if len(chunks) > 1 else [50]
    caches, scales, tables, seq_lens, g = quantized_case(lens, dtype)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), HKV * GROUP, DIM, generator=g)
    out = K.paged_prefill_attention(q, *caches, tables, cu, seq_lens, 0.3, k_scale=scales[0], v_scale=scales[1])
    ref = K.paged_prefill_attention_ref(q.double(), *dequantized(caches, scales), tables, cu, seq_lens, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("window,softcap", [(5, None), (24, 3.0), (None, 2.0)])
def test_windows_and_softcap_read_values_times_scales_and_nothing_before_the_window(dtype, window, softcap):
    lens, chunks = [1, 7, 30, 77], [1, 3, 16, 7]   # prefill: the last `chunks` tokens of each sequence
    poison = [max(0, n - c - window + 1) for n, c in zip(lens, chunks)] if window else None
    caches, scales, tables, seq_lens, g = quantized_case(lens, dtype, poison_before=poison)
    q = torch.randn(len(lens), HKV * GROUP, DIM, generator=g)
    options = dict(sliding_window=window, softcap=softcap)
    out = K.paged_decode_attention(q, *caches, tables, seq_lens, 0.3, k_scale=scales[0], v_scale=scales[1],
                                   **options)
    ref = K.paged_decode_attention(q.double(), *dequantized(caches, scales), tables, seq_lens, 0.3, **options)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), HKV * GROUP, DIM, generator=g)
    out = K.paged_prefill_attention(qp, *caches, tables, cu, seq_lens, 0.3, k_scale=scales[0], v_scale=scales[1],
                                    **options)
    ref = K.paged_prefill_attention(qp.double(), *dequantized(caches, scales), tables, cu, seq_lens, 0.3, **options)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_quantized_caches_take_triton_where_it_runs(monkeypatch):
    """The dispatch rule: int8 / float8 caches go to the (v2) Triton kernels wherever Triton runs (CUDA, or
    the interpreter) and to the twins elsewhere; test_kernels.py holds the Triton side to the twins."""
    for dtype in QDTYPES:
        caches, scales, *_ = quantized_case([9], dtype)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert K.resolve_backend(None, torch.zeros(1), caches[0]) == "torch"
        if K.HAS_TRITON:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            assert K.resolve_backend(None, torch.zeros(1), caches[0]) == "triton"
