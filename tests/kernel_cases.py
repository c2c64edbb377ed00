"""Builders and checks shared by the kernel tests: NaN-poisoned paged pools, the float64 oracle comparison,
the decode / prefill checks both Triton implementations run through."""

from __future__ import annotations

import os

import pytest
import torch

from pagedchat import kernels as K

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the interpreter runs a kernel's programs one by one in Python: wide sweeps run with PAGEDCHAT_SLOW=1
SLOW = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("PAGEDCHAT_SLOW") != "1",
                                             reason="slow: set PAGEDCHAT_SLOW=1")]

# Kernel-vs-oracle tolerances. fp32 must meet the 1e-3 relative bar; half precision is limited by
# rounding the softmax weights to the input dtype before the P @ V dot (as flash attention does).
TOL = {torch.float32: (1e-3, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


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


def make_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3, release_before=None):
    """A pool where only the slots inside each sequence hold data: every other slot is NaN.

    A kernel that reads past a sequence's end, a padded table entry or a masked tail and lets it reach
    the output (even as 0 * NaN) produces NaN. release_before[i]: sequence i's blocks wholly before that
    token are released as a sliding window's are (NaN content, table entry -1: never to be read).
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
    for i, first_kept in enumerate(release_before or []):
        for b in range(max(0, first_kept) // block_size):
            k_cache[table[i, b].long()] = v_cache[table[i, b].long()] = float("nan")
            table[i, b] = -1
    return k_cache, v_cache, table


def assert_matches_oracle(out, ref64, dtype):
    """out (kernel, `dtype`) against the float64 twin run on the same rounded inputs."""
    assert out.dtype == dtype
    assert not out.isnan().any(), "NaN in the output"
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
    torch.testing.assert_close(out.double(), ref64, rtol=rtol, atol=atol * scale)


def split_options(impl, splits):
    """Options of paged_decode_attention_triton that cut sequences into `splits` (v1) or about as many (v2:
    a split plan on 4 SMs that splits down to single 16-key tiles) pieces."""
    from pagedchat.kernels.triton_attention_configs import DecodeConfig

    if impl == "v1":
        return dict(impl="v1", num_splits=splits)
    if splits == 1:
        return dict(impl="v2", config=DecodeConfig(16, 4, 2, programs_per_sm=1, min_tiles=1 << 20))
    return dict(impl="v2", config=DecodeConfig(16, 4, 2, programs_per_sm=splits, min_tiles=1), num_sms=4)


def check_decode(seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, num_splits=None,
                 device="cpu", impl=None, **options):
    gen = torch.Generator().manual_seed(seed)
    window, softcap = options.get("sliding_window"), options.get("softcap")
    released = [n - window for n in seq_lens] if window else None
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen,
                                        release_before=released)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    if window or softcap:
        ref = K.paged_decode_attention_windowed_ref(q.double(), k_cache.double(), v_cache.double(), table, lens,
                                                    scale, window, softcap)
    else:
        ref = K.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, lens, scale)
    args = [x.to(device) for x in (q, k_cache, v_cache, table, lens)]
    out = torch.full_like(args[0], float("nan"))  # every row must be written
    if num_splits is None:
        got = K.paged_decode_attention(*args, scale, out=out, backend="triton", impl=impl, **options)
    else:
        got = K.paged_decode_attention_triton(*args, scale, out, **split_options(impl or "v2", num_splits),
                                              **options)
    assert got.data_ptr() == out.data_ptr()
    assert_matches_oracle(out.cpu(), ref, dtype)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert (out[b] == 0).all(), "a zero-length sequence attends to nothing: zeros"


def check_prefill(seq_lens, new_tokens, block_size, num_kv_heads, group, head_dim, dtype, seed,
                  device="cpu", impl=None, **options):
    gen = torch.Generator().manual_seed(seed)
    window, softcap = options.get("sliding_window"), options.get("softcap")
    released = [n - m - window + 1 for n, m in zip(seq_lens, new_tokens)] if window else None
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen,
                                        release_before=released)
    cu = torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    if window or softcap:
        ref = K.paged_prefill_attention_windowed_ref(q.double(), k_cache.double(), v_cache.double(), table, cu,
                                                     lens, scale, window, softcap)
    else:
        ref = K.paged_prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, cu, lens,
                                            scale)
    args = [x.to(device) for x in (q, k_cache, v_cache, table, cu, lens)]
    out = torch.full_like(args[0], float("nan"))
    got = K.paged_prefill_attention(*args, scale, out=out, backend="triton", impl=impl, **options)
    assert got.data_ptr() == out.data_ptr()
    assert_matches_oracle(out.cpu(), ref, dtype)




def quantize_case(k_cache, v_cache, kv_dtype):
    """A float case's caches as a quantized pool (kv_quant's layout): values, scales, and the float64 caches
    they dequantize to (the oracle's input). Slots that held NaN get a NaN scale: a kernel that reads one
    makes NaN, as in the float pools."""
    from pagedchat.kernels.kv_quant import dequantize_kv, quantize_kv

    out = []
    for cache in (k_cache, v_cache):
        unused = cache.isnan().any(dim=-1)
        values, scales = quantize_kv(torch.nan_to_num(cache.float()), kv_dtype)
        scales[unused] = float("nan")
        out.append((values, scales, dequantize_kv(values, scales, torch.float64)))
    (kq, ks, k64), (vq, vs, v64) = out
    return kq, vq, ks, vs, k64, v64


def check_quantized(kind, seq_lens, new_tokens, block_size, num_kv_heads, group, head_dim, kv_dtype, q_dtype, seed,
                    device="cpu", **options):
    """v2 decode or prefill on a quantized pool against the float64 twin on the caches it dequantizes to."""
    gen = torch.Generator().manual_seed(seed)
    window, softcap = options.get("sliding_window"), options.get("softcap")
    k_cache, v_cache, table = make_case(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    kq, vq, ks, vs, k64, v64 = quantize_case(k_cache, v_cache, kv_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    if kind == "decode":
        q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(q_dtype)
        ref = K.paged_decode_attention_windowed_ref(q.double(), k64, v64, table, lens, scale, window, softcap)
        args = [q, kq, vq, table, lens]
    else:
        cu = torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32)
        q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(q_dtype)
        ref = K.paged_prefill_attention_windowed_ref(q.double(), k64, v64, table, cu, lens, scale, window, softcap)
        args = [q, kq, vq, table, cu, lens]
    args = [x.to(device) for x in args]
    ks, vs = ks.to(device), vs.to(device)
    out = torch.full_like(args[0], float("nan"))
    run = K.paged_decode_attention if kind == "decode" else K.paged_prefill_attention
    run(*args, scale, out=out, backend="triton", impl="v2", k_scale=ks, v_scale=vs, **options)
    assert_matches_oracle(out.cpu(), ref, q_dtype)


def check_quantized_write_and_copy(kv_dtype, num_kv_heads, head_dim, block_size, device):
    """write_kv and copy_blocks on a quantized pool, bit for bit against kv_quant.quantize_kv."""
    from pagedchat.kernels.kv_quant import qmax, quantize_kv

    gen = torch.Generator().manual_seed(head_dim)
    shape = (12, block_size, num_kv_heads, head_dim)
    kq, vq = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    ks, vs = torch.full(shape[:3], float("nan"), dtype=torch.float16), torch.full(shape[:3], 7.0, dtype=torch.float16)
    kv = torch.randn(9, 2, num_kv_heads, head_dim, generator=gen) * 3
    kv[0, 0, 0] = 0.0  # a head of zeros: scale 0, values 0
    # values that land exactly between two steps after scaling: rounding ties (to even in both dtypes)
    top = qmax(kv_dtype)
    kv[1, 1, 0, :4] = torch.tensor([top, 2.5, -0.5, 12.5]) if kv_dtype == torch.int8 else \
        torch.tensor([top, 12.5, -100.0, 0.0048828125 * 3])
    slots = torch.tensor([3, -1, 5 * block_size + 2, 17, -1, 40, 11 * block_size + block_size - 1, 0, 1])
    want = [t.clone() for t in (kq, vq, ks, vs)]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for x, values, scales in ((kv[i, 0], want[0], want[2]), (kv[i, 1], want[1], want[3])):
            q_values, q_scales = quantize_kv(x, kv_dtype)
            values[slot // block_size, slot % block_size] = q_values
            scales[slot // block_size, slot % block_size] = q_scales
    for t in want:  # copy-on-write of three blocks, scales with them
        raw = t.view(torch.uint8) if t.element_size() == 1 else t
        raw[[7, 8, 9]] = raw[[0, 5, 11]]
    kq, vq, ks, vs, kv, slots = (x.to(device) for x in (kq, vq, ks, vs, kv, slots))
    K.write_kv(kv[:, 0], kv[:, 1], kq, vq, slots, backend="triton", k_scale=ks, v_scale=vs)
    K.copy_blocks(kq, vq, [0, 5, 11], [7, 8, 9], backend="triton", k_scale=ks, v_scale=vs)
    for got, expected in zip((kq, vq, ks, vs), want):
        got = got.cpu()
        raw = (lambda t: t.view(torch.uint8)) if got.element_size() == 1 else (lambda t: t)
        torch.testing.assert_close(raw(got), raw(expected), rtol=0, atol=0, equal_nan=True)
