"""`pagedchat bench kernels`: the paged kernels against the machine's own ceilings, measured in the same run.

Every number is a ratio against a peer timed in this process on this device:
* decode attention, write_kv, copy_blocks: bytes moved / time, as a fraction of a large device-to-device copy
  (`copy_frac`); decode also against torch SDPA over the same K/V laid out contiguously (`vs_sdpa`, > 1 means
  the paged kernel is faster) and, when this torch has it, compiled FlexAttention (`vs_flex`, batch sweep);
* prefill attention: FLOP/s as a fraction of a large bf16 matmul (`matmul_frac`) and against causal SDPA
  (flash) on contiguous K/V for whole prompts.

Both Triton implementations (`--impls v1,v2`) are measured in one run, each row naming its `impl`. Kernel times
are device times: the call is captured in a CUDA graph and replayed (L2 flushed before each replay), so the
host path of a call does not count; calls that cannot be captured (v1 prefill reads the lengths on the host)
are timed eagerly, host path included, and say so (`timed: eager`). The host path is measured apart (`host`
rows: microseconds of CPU per call of a tiny decode / prefill, back to back).

Sweeps around the headline case (B=64, context 4096, 32 query / 8 KV heads, D=128, bf16, block 16): batch
1..256, context 128..32k at batch 8, batch 1 at 4k..128k, block size 8..128, GQA ratio 1..32. GPU only.
`--tune` first times each shape class's candidate configurations of v2 and caches the fastest
(pagedchat/kernels/triton_attention_configs.py), then measures with them. The `goals` entry of the result
compares the rows with the targets the kernels are built for (GOALS).
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, replace

from pagedchat.bench.common import machine_description, print_table, report_partial, save_figure
from pagedchat.errors import UserError

# Sizes are chosen so the timed kernels move at least tens of MB (L2 is flushed before every launch anyway).
COPY_BYTES = 2 << 30
MATMUL_N = 8192
L2_FLUSH_BYTES = 256 << 20
DEVICE = "cuda"  # where the cases are built (a CPU smoke test of this module sets "cpu" and the interpreter)


@dataclass(frozen=True)
class Shape:
    batch: int = 64
    context: int = 4096
    block_size: int = 16
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    def kv_bytes(self, elt: int) -> int:
        """K and V of all sequences: what decode must read at least once."""
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * elt


HEADLINE = Shape()
DECODE_SWEEPS = {
    "batch": [replace(HEADLINE, batch=b) for b in (1, 4, 16, 64, 256)],
    "context": [replace(HEADLINE, batch=8, context=c) for c in (128, 512, 2048, 8192, 32768)],
    "long": [replace(HEADLINE, batch=1, context=c) for c in (4096, 32768, 131072)],
    "block_size": [replace(HEADLINE, block_size=s) for s in (8, 16, 32, 64, 128)],
    "gqa": [replace(HEADLINE, kv_heads=h) for h in (32, 8, 4, 1)],
}
SWEEP_AXIS = {"batch": "batch", "context": "context", "long": "context", "block_size": "block_size",
              "gqa": "kv_heads"}
IMPLS = ("v1", "v2")
# What the kernels are built for (bf16, same GPU, same run): (kernel, batch, context, new tokens) -> the floor
# of each figure; the `goals` entry of the result says which rows reach them.
GOALS = [
    ("decode", 64, 4096, None, "copy_frac", 0.85), ("decode", 64, 4096, None, "vs_sdpa", 1.0),
    ("decode", 256, 4096, None, "copy_frac", 0.85), ("decode", 256, 4096, None, "vs_sdpa", 1.0),
    ("decode", 16, 4096, None, "copy_frac", 0.75), ("decode", 8, 32768, None, "copy_frac", 0.75),
    ("decode", 1, 32768, None, "copy_frac", 0.60),
    ("prefill", 1, 4096, 4096, "vs_sdpa", 0.8), ("prefill", 1, 16384, 16384, "vs_sdpa", 0.8),
    ("prefill", 8, 4096, 256, "matmul_frac", 0.5),
]
# (batch, context, new tokens per sequence): whole prompts, a chunk over history, short multi-turn messages
PREFILL_CASES = [(1, 1024, 1024), (1, 4096, 4096), (4, 4096, 4096), (1, 16384, 16384), (8, 4096, 256),
                 (32, 2048, 64)]
WRITE_KV_TOKENS = (64, 4096, 65536)
COPY_BLOCK_PAIRS = (1, 64, 1024)


def _require_gpu():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        raise UserError("pagedchat bench kernels needs torch with CUDA") from exc
    if not torch.cuda.is_available():
        raise UserError("pagedchat bench kernels needs a CUDA GPU (none is visible); the kernels are tested on "
                        "CPU with `TRITON_INTERPRET=1 pytest tests/test_kernels.py`, but their speed can only be "
                        "measured on a GPU")
    from pagedchat import kernels
    if not kernels.HAS_TRITON:
        raise UserError("pagedchat bench kernels needs triton (pip install 'pagedchat[gpu]')")
    return torch


# -- timing ------------------------------------------------------------------------------------------------
class Timer:
    """Median device time of a callable; L2 is flushed before each launch so small cases are not cache hits.

    The callable is captured in a CUDA graph and replayed, so its host path is not timed; one that cannot be
    captured (a host sync inside) is timed eagerly. `last_mode` says which ("graph" or "eager")."""

    def __init__(self, torch, warmup: int, iters: int):
        self.torch, self.warmup, self.iters = torch, warmup, iters
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self.last_mode = "eager"

    def __call__(self, fn, graph: bool = True) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        run, self.last_mode = fn, "eager"
        if graph:
            replay = self._captured(fn)
            if replay is not None:
                run, self.last_mode = replay, "graph"
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        times.sort()
        return times[len(times) // 2]

    def _captured(self, fn):
        torch = self.torch
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                fn()
        except Exception:  # noqa: BLE001 - a host sync (or anything else) inside: time it eagerly
            torch.cuda.synchronize()
            return None
        g.replay()  # the first replay uploads the graph
        torch.cuda.synchronize()
        return g.replay


def host_time(torch, fn, calls: int = 200) -> float:
    """CPU seconds per call of `fn` issued back to back (a tiny case, so the GPU keeps up with the host)."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def measure_ceilings(torch, timer: Timer, dtype) -> tuple[float, float]:
    """(device copy GB/s counting read + write, matmul TFLOP/s) on this device, now."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=dtype)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=dtype)
    mm_s = timer(lambda: a @ b)
    return 2 * COPY_BYTES / copy_s / 1e9, 2 * MATMUL_N ** 3 / mm_s / 1e12


# -- data --------------------------------------------------------------------------------------------------
def paged_pool(torch, shape: Shape, lens: list[int], dtype, seed: int = 0):
    """Caches holding every sequence's tokens in randomly permuted blocks, and the matching block tables."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    need = [math.ceil(n / shape.block_size) for n in lens]
    num_blocks = sum(need) + 1
    cache_shape = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype, generator=gen)
    v_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n]
        used += n
    return k_cache, v_cache, tables


def contiguous_kv(torch, cache, tables, length: int):
    """[B, Hkv, L, D] copy of the first `length` tokens of every sequence (all of equal length here)."""
    batch = tables.shape[0]
    blocks = math.ceil(length / cache.shape[1])
    kv = cache[tables[:, :blocks].long()].flatten(1, 2)[:, :length]  # [B, L, Hkv, D]
    return kv.transpose(1, 2).contiguous().view(batch, cache.shape[2], length, cache.shape[3])


def _fits(torch, nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.6 * free


# -- decode ------------------------------------------------------------------------------------------------
def _flex_decode(torch):
    """Compiled FlexAttention, or None where this torch lacks it or cannot compile it."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
        return torch.compile(flex_attention, dynamic=False)
    except Exception:  # noqa: BLE001 - optional peer
        return None


def bench_decode(torch, timer: Timer, shape: Shape, sweep: str, dtype, copy_gbps: float, flex,
                 impls=IMPLS) -> list[dict]:
    """One row per implementation (the same pool, the same peers)."""
    from pagedchat import kernels

    elt = torch.empty((), dtype=dtype).element_size()
    base = dict(kernel="decode", sweep=sweep, **shape.__dict__, dtype=str(dtype).removeprefix("torch."))
    if not _fits(torch, 3 * shape.kv_bytes(elt) + L2_FLUSH_BYTES):  # pool + gather + contiguous copy
        return [dict(base, impl=impl, skipped="does not fit in free device memory") for impl in impls]
    lens = [shape.context] * shape.batch
    k_cache, v_cache, tables = paged_pool(torch, shape, lens, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    out = torch.empty_like(q)
    scale = shape.head_dim ** -0.5
    nbytes = shape.kv_bytes(elt) + 2 * q.numel() * elt
    rows = []
    for impl in impls:
        ours = timer(lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                                                            impl=impl))
        rows.append(dict(base, impl=impl, timed=timer.last_mode, time_us=ours * 1e6, gbps=nbytes / ours / 1e9,
                         copy_frac=nbytes / ours / 1e9 / copy_gbps))

    k = contiguous_kv(torch, k_cache, tables, shape.context)
    v = contiguous_kv(torch, v_cache, tables, shape.context)
    del k_cache, v_cache
    q4 = q.view(shape.batch, shape.q_heads, 1, shape.head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_s = timer(lambda: sdpa(q4, k, v, scale=scale, enable_gqa=True))
    peers = dict(sdpa_us=sdpa_s * 1e6)
    if flex is not None:
        try:
            peers["flex_us"] = timer(lambda: flex(q4, k, v, scale=scale, enable_gqa=True), graph=False) * 1e6
        except Exception as exc:  # noqa: BLE001 - optional peer
            peers["flex_error"] = f"{type(exc).__name__}: {exc}"[:200]
    for row in rows:
        row.update(peers, vs_sdpa=peers["sdpa_us"] / row["time_us"])
        if "flex_us" in peers:
            row["vs_flex"] = peers["flex_us"] / row["time_us"]
    return rows


# -- prefill -----------------------------------------------------------------------------------------------
def bench_prefill(torch, timer: Timer, batch: int, context: int, new: int, dtype, matmul_tflops: float,
                  impls=IMPLS) -> list[dict]:
    from pagedchat import kernels

    shape = replace(HEADLINE, batch=batch, context=context)
    elt = torch.empty((), dtype=dtype).element_size()
    base = dict(kernel="prefill", sweep="prefill", **shape.__dict__, new_tokens=new,
                dtype=str(dtype).removeprefix("torch."))
    if not _fits(torch, 3 * shape.kv_bytes(elt) + L2_FLUSH_BYTES):
        return [dict(base, impl=impl, skipped="does not fit in free device memory") for impl in impls]
    k_cache, v_cache, tables = paged_pool(torch, shape, [context] * batch, dtype)
    seq_lens = torch.tensor([context] * batch, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch * new, shape.q_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    out = torch.empty_like(q)
    scale = shape.head_dim ** -0.5
    # Query j of a chunk sees (context - new + j + 1) keys; QK^T and PV are 2 flops per multiply-add each.
    visible = batch * (new * (context - new) + new * (new + 1) / 2)
    flops = 4 * visible * shape.q_heads * shape.head_dim
    rows = []
    for impl in impls:
        # v1 prefill reads the chunk lengths on the host: it cannot be captured, so it is timed eagerly
        ours = timer(lambda: kernels.paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, scale,
                                                             out=out, impl=impl), graph=impl != "v1")
        rows.append(dict(base, impl=impl, timed=timer.last_mode, time_us=ours * 1e6, tflops=flops / ours / 1e12,
                         matmul_frac=flops / ours / 1e12 / matmul_tflops))
    if new == context:  # a whole prompt: causal SDPA on contiguous K/V is the like-for-like peer
        k = contiguous_kv(torch, k_cache, tables, context)
        v = contiguous_kv(torch, v_cache, tables, context)
        del k_cache, v_cache
        qc = q.view(batch, new, shape.q_heads, shape.head_dim).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa_s = timer(lambda: sdpa(qc, k, v, scale=scale, is_causal=True, enable_gqa=True))
        for row in rows:
            row.update(sdpa_us=sdpa_s * 1e6, vs_sdpa=sdpa_s * 1e6 / row["time_us"])
    return rows


def bench_host(torch, dtype, impls=IMPLS) -> list[dict]:
    """CPU microseconds per call on tiny cases (the GPU keeps up): what eager decode pays per layer."""
    from pagedchat import kernels

    shape = replace(HEADLINE, batch=1, context=128)
    k_cache, v_cache, tables = paged_pool(torch, shape, [shape.context], dtype)
    seq_lens = torch.tensor([shape.context], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, shape.q_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    qp = torch.randn(16, shape.q_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    out, outp = torch.empty_like(q), torch.empty_like(qp)
    rows = []
    for impl in impls:
        decode = host_time(torch, lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1,
                                                                         out=out, impl=impl))
        prefill = host_time(torch, lambda: kernels.paged_prefill_attention(qp, k_cache, v_cache, tables, cu,
                                                                           seq_lens, 0.1, out=outp, impl=impl))
        rows.append(dict(kernel="host", impl=impl, decode_us=decode * 1e6, prefill_us=prefill * 1e6))
    return rows


# -- cache movers ------------------------------------------------------------------------------------------
def bench_write_kv(torch, timer: Timer, tokens: int, dtype, copy_gbps: float) -> dict:
    from pagedchat import kernels

    shape = HEADLINE
    elt = torch.empty((), dtype=dtype).element_size()
    num_blocks = max(2 * tokens // shape.block_size, 1024)
    cache_shape = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.zeros(cache_shape, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(tokens, shape.kv_heads, shape.head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * shape.block_size, device=DEVICE)[:tokens]
    t = timer(lambda: kernels.write_kv(k, v, k_cache, v_cache, slots))
    nbytes = 2 * 2 * k.numel() * elt + slots.numel() * 8  # read and write both K and V
    return dict(kernel="write_kv", sweep="tokens", tokens=tokens, dtype=str(dtype).removeprefix("torch."),
                time_us=t * 1e6, gbps=nbytes / t / 1e9, copy_frac=nbytes / t / 1e9 / copy_gbps)


def bench_copy_blocks(torch, timer: Timer, pairs: int, dtype, copy_gbps: float) -> dict:
    from pagedchat import kernels

    shape = HEADLINE
    elt = torch.empty((), dtype=dtype).element_size()
    cache_shape = (2 * pairs, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    src = torch.arange(pairs, device=DEVICE)
    dst = src + pairs
    t = timer(lambda: kernels.copy_blocks(k_cache, v_cache, src, dst))
    nbytes = 2 * 2 * pairs * k_cache[0].numel() * elt
    return dict(kernel="copy_blocks", sweep="pairs", pairs=pairs, dtype=str(dtype).removeprefix("torch."),
                time_us=t * 1e6, gbps=nbytes / t / 1e9, copy_frac=nbytes / t / 1e9 / copy_gbps)


# -- tuning ------------------------------------------------------------------------------------------------
def tune(torch, timer: Timer, dtype, decode_shapes: list[Shape], prefill_cases: list[tuple]) -> list[dict]:
    """Time v2's candidate configurations on one representative shape per shape class; cache the fastest."""
    from pagedchat.kernels import triton_attention_configs as C
    from pagedchat.kernels.triton_attention_v2 import paged_decode_attention_v2, paged_prefill_attention_v2

    elt = torch.empty((), dtype=dtype).element_size()
    classes: dict[str, tuple] = {}
    for shape in decode_shapes:  # the largest shape of each class that fits
        if not _fits(torch, 2 * shape.kv_bytes(elt) + L2_FLUSH_BYTES):
            continue
        name = C.shape_class("decode", shape.head_dim, shape.q_heads // shape.kv_heads, shape.block_size, dtype,
                             C.decode_size_class(shape.batch))
        if name not in classes or shape.kv_bytes(1) > classes[name][1].kv_bytes(1):
            classes[name] = ("decode", shape)
    for batch, context, new in prefill_cases:
        shape = replace(HEADLINE, batch=batch, context=context)
        if _fits(torch, 2 * shape.kv_bytes(elt) + L2_FLUSH_BYTES):
            name = C.shape_class("prefill", shape.head_dim, shape.q_heads // shape.kv_heads, shape.block_size,
                                 dtype, C.prefill_size_class(batch * new, batch))
            classes.setdefault(name, ("prefill", shape, new))
    rows, winners = [], {}
    for name, (kind, shape, *rest) in classes.items():
        k_cache, v_cache, tables = paged_pool(torch, shape, [shape.context] * shape.batch, dtype)
        lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=DEVICE)
        scale = shape.head_dim ** -0.5
        if kind == "decode":
            q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=DEVICE, dtype=dtype)
            candidates = C.decode_candidates(shape.head_dim, dtype)
            call = lambda cfg: paged_decode_attention_v2(q, k_cache, v_cache, tables, lens, scale, out, config=cfg)  # noqa: E731
        else:
            new = rest[0]
            q = torch.randn(shape.batch * new, shape.q_heads, shape.head_dim, device=DEVICE, dtype=dtype)
            cu = torch.arange(0, (shape.batch + 1) * new, new, dtype=torch.int32, device=DEVICE)
            candidates = C.prefill_candidates(shape.head_dim, dtype, C.prefill_size_class(shape.batch * new,
                                                                                          shape.batch))
            call = lambda cfg: paged_prefill_attention_v2(q, k_cache, v_cache, tables, cu, lens, scale, out,  # noqa: E731
                                                          config=cfg)
        out = torch.empty_like(q)
        times = {}
        for cfg in candidates:
            try:
                times[cfg] = timer(lambda: call(cfg))
            except Exception as exc:  # noqa: BLE001 - a candidate this GPU cannot run (shared memory)
                rows.append(dict(kernel="tune", shape_class=name, config=cfg.__dict__, error=str(exc)[:200]))
        if times:
            best = min(times, key=times.get)
            winners[name] = best
            default = candidates[0]
            rows.append(dict(kernel="tune", shape_class=name, config=best.__dict__, time_us=times[best] * 1e6,
                             default_us=times.get(default, math.nan) * 1e6, candidates=len(times)))
        torch.cuda.empty_cache()
    if winners:
        path = C.save_measured(torch.device(DEVICE), winners)
        rows.append(dict(kernel="tune", saved=str(path), classes=len(winners)))
    return rows


def goal_rows(rows: list[dict]) -> list[dict]:
    """Each goal against the rows that measure it, per implementation."""
    out = []
    for kernel, batch, context, new, figure, floor in GOALS:
        for row in rows:
            if (row.get("kernel") == kernel and row.get("batch") == batch and row.get("context") == context
                    and row.get("new_tokens") == new and row.get("block_size") == HEADLINE.block_size
                    and row.get("kv_heads") == HEADLINE.kv_heads and figure in row):
                out.append(dict(kernel=kernel, batch=batch, context=context, new_tokens=new, impl=row.get("impl"),
                                figure=figure, goal=floor, measured=row[figure], met=row[figure] >= floor))
    return list({(g["kernel"], g["batch"], g["context"], g["figure"], g["impl"]): g for g in out}.values())


# -- driver ------------------------------------------------------------------------------------------------
def run_kernel_bench(sweeps=tuple(DECODE_SWEEPS), kernels=("decode", "prefill", "write_kv", "copy_blocks"),
                     dtype: str = "bfloat16", warmup: int = 3, iters: int = 20, flex: bool = True,
                     show: bool = True, plot_path=None, impls=IMPLS, tune_first: bool = False) -> dict:
    """Run the kernel benchmark: {"measurements": one dict per measurement (the first two are the device
    ceilings), "goals": each goal against its rows}.

    sweeps: subset of DECODE_SWEEPS; kernels: which kernels to time; impls: the Triton implementations
    measured side by side ("v1", "v2"); tune_first: time v2's candidate configurations and cache the fastest
    before measuring. show prints rich tables; plot_path saves a PNG of the decode sweeps.
    """
    torch = _require_gpu()
    unknown = set(sweeps) - set(DECODE_SWEEPS)
    if unknown:
        raise UserError(f"unknown sweep(s) {sorted(unknown)}; choose from {sorted(DECODE_SWEEPS)}")
    bad = set(impls) - set(IMPLS)
    if bad:
        raise UserError(f"unknown implementation(s) {sorted(bad)}; choose from {list(IMPLS)}")
    torch_dtype = getattr(torch, dtype)
    timer = Timer(torch, warmup, iters)
    copy_gbps, matmul_tflops = measure_ceilings(torch, timer, torch_dtype)
    stamp = dict(date=_dt.date.today().isoformat(), machine=machine_description())
    rows = []

    def add(new: list[dict]) -> None:   # each row also goes to stderr as it comes (a run cut short keeps them)
        rows.extend(new)
        for row in new:
            report_partial(row)

    add([dict(kernel="device_copy", gbps=copy_gbps, **stamp), dict(kernel="matmul", tflops=matmul_tflops,
                                                                   dtype=dtype, **stamp)])
    decode_shapes = [shape for sweep in sweeps for shape in DECODE_SWEEPS[sweep]]
    if tune_first:
        add(tune(torch, Timer(torch, 2, 5), torch_dtype, decode_shapes if "decode" in kernels else [],
                 PREFILL_CASES if "prefill" in kernels else []))
    if "decode" in kernels:
        flex_fn = _flex_decode(torch) if flex else None
        for sweep in sweeps:
            for shape in DECODE_SWEEPS[sweep]:
                # Flex compiles once per shape and dynamo stops recompiling after a few shapes (then runs
                # eagerly, a misleading peer): time it on the batch sweep only, which holds the headline.
                peer = flex_fn if sweep == "batch" else None
                add(bench_decode(torch, timer, shape, sweep, torch_dtype, copy_gbps, peer, impls))
                torch.cuda.empty_cache()
    if "prefill" in kernels:
        for batch, context, new in PREFILL_CASES:
            add(bench_prefill(torch, timer, batch, context, new, torch_dtype, matmul_tflops, impls))
            torch.cuda.empty_cache()
    if "decode" in kernels or "prefill" in kernels:
        add(bench_host(torch, torch_dtype, impls))
    if "write_kv" in kernels:
        add([bench_write_kv(torch, timer, n, torch_dtype, copy_gbps) for n in WRITE_KV_TOKENS])
    if "copy_blocks" in kernels:
        add([bench_copy_blocks(torch, timer, n, torch_dtype, copy_gbps) for n in COPY_BLOCK_PAIRS])
    goals = goal_rows(rows)
    if show:
        print_rows(rows, goals)
    if plot_path is not None:
        plot_rows(rows, plot_path)
    return {"measurements": rows, "goals": goals}


def print_rows(rows: list[dict], goals: list[dict] = ()) -> None:
    copy_row, mm_row = rows[0], rows[1]
    caption = (f"{copy_row['machine']}, {copy_row['date']}: device copy {copy_row['gbps']:,.0f} GB/s, "
               f"{mm_row['dtype']} matmul {mm_row['tflops']:,.0f} TFLOP/s")

    def table(title, kernels_, keys, headers, picked=None):
        picked = picked if picked is not None else [r for r in rows if r["kernel"] in kernels_]
        if picked:
            cells = [[r.get(k, r.get("skipped") if k == "time_us" else None) for k in keys] for r in picked]
            print_table(title, headers, cells, caption)

    table("decode attention (paged) vs copy bandwidth, SDPA / FlexAttention on contiguous K/V", ("decode",),
          ["sweep", "impl", "batch", "context", "block_size", "q_heads", "kv_heads", "time_us", "gbps", "copy_frac",
           "vs_sdpa", "vs_flex"],
          ["sweep", "impl", "B", "ctx", "blk", "Hq", "Hkv", "us", "GB/s", "x copy", "vs SDPA", "vs Flex"])
    table("prefill attention (paged, causal) vs matmul rate and causal SDPA", ("prefill",),
          ["impl", "batch", "context", "new_tokens", "time_us", "timed", "tflops", "matmul_frac", "vs_sdpa"],
          ["impl", "B", "ctx", "new", "us", "timed", "TFLOP/s", "x matmul", "vs SDPA"])
    table("host path per call (CPU, tiny case)", ("host",), ["impl", "decode_us", "prefill_us"],
          ["impl", "decode us", "prefill us"])
    table("cache writes and copy-on-write vs copy bandwidth", ("write_kv", "copy_blocks"),
          ["kernel", "tokens", "pairs", "time_us", "gbps", "copy_frac"],
          ["kernel", "tokens", "pairs", "us", "GB/s", "x copy"])
    table("tuned configurations (v2)", ("tune",), ["shape_class", "config", "time_us", "default_us", "saved"],
          ["shape class", "fastest", "us", "default us", "cache"])
    table("goals", (), ["kernel", "batch", "context", "new_tokens", "impl", "figure", "goal", "measured", "met"],
          ["kernel", "B", "ctx", "new", "impl", "figure", "goal", "measured", "met"], picked=list(goals))


def plot_rows(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [s for s in DECODE_SWEEPS if any(r.get("sweep") == s and "time_us" in r for r in rows)]
    if not sweeps:
        return
    copy_gbps = rows[0]["gbps"]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4 * len(sweeps), 3.2), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        data = [r for r in rows if r.get("sweep") == sweep and "time_us" in r]
        axis = SWEEP_AXIS[sweep]
        for impl in dict.fromkeys(r.get("impl") for r in data):
            mine = [r for r in data if r.get("impl") == impl]
            ax.plot([r[axis] for r in mine], [r["copy_frac"] for r in mine], "o-",
                    label=f"paged decode (Triton {impl})")
        data = [r for r in data if r.get("impl") == data[0].get("impl")]  # the peers once
        xs = [r[axis] for r in data]
        # SDPA reads the same bytes from contiguous K/V: its fraction of copy bandwidth on the same scale
        ax.plot(xs, [r["copy_frac"] / r["vs_sdpa"] if r.get("vs_sdpa") else math.nan
                     for r in data], "s--", label="SDPA, contiguous")
        if any(r.get("vs_flex") for r in data):
            ax.plot(xs, [r["copy_frac"] / r["vs_flex"] if r.get("vs_flex") else math.nan for r in data], "^:",
                    label="FlexAttention, contiguous")
        ax.axhline(0.8, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(axis)
        ax.set_title(f"decode: {sweep} sweep")
        ax.set_ylim(0, 1.1)
    axes[0][0].set_ylabel(f"fraction of copy bandwidth ({copy_gbps:,.0f} GB/s)")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)
