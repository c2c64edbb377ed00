"""Registers, spills and shared memory of the attention kernels' configurations and of the GGUF weight matmuls,
compiled for Hopper (sm_90).

Needs no GPU: Triton compiles for a named target on any machine, and the ptxas bundled with it reports each
kernel's registers and spills (`ptxas -v`); Triton's own metadata says how much shared memory it allocates.
The launches compiled are the ones the wrappers build for real calls (decode_launches / prefill_launches /
gguf_launch on small CPU tensors of the right dtypes and layouts), so the table describes exactly what runs.

    python scripts/kernel_resources.py [--all-candidates | --gguf] > table.md   (rows print as they compile)
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SM90 = ("cuda", 90, 32)
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


class Unavailable(RuntimeError):
    """This Triton build cannot compile for sm_90 here (no CUDA backend, no ptxas)."""


@dataclass(frozen=True)
class Resources:
    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


def _signature(jit, launch) -> tuple[dict, dict, dict]:
    """Triton's view of a launch: argument types, constexprs, 16-divisibility hints (as the runtime makes them)."""
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    # The runtime finds constexprs in the kernel's annotations, not here: a launch must agree with them, or what
    # compiles here is not what a GPU runs.
    declared = {p.name for p in jit.params if p.is_constexpr}
    assert declared == set(launch.constexprs), f"{jit.fn.__name__}: constexprs {sorted(declared)} in the kernel, " \
        f"{sorted(launch.constexprs)} in the launch"
    for i, (name, value) in enumerate(zip(jit.arg_names, launch.args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            specialized = not jit.params[i].do_not_specialize   # (kernels' varies_per_step)
            if specialized and value == 1:  # the runtime turns integer arguments equal to 1 into constants
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if specialized and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot describe {type(value).__name__} to Triton")
    for name in launch.constexprs:
        signature[name] = "constexpr"
    return signature, constexprs, attrs


def _ptxas() -> str:
    """The ptxas Triton itself uses for sm_90 (recent Tritons bundle two; the older one rejects their PTX)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise Unavailable(f"no ptxas for sm_90 in this Triton build ({exc})") from exc


def compile_launch(launch) -> Resources:
    """Compile one launch for sm_90 and read its resources."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        raise Unavailable(f"triton cannot compile here ({exc})") from exc
    from pagedchat.kernels._launch import compiled

    jit = compiled(launch.fn)
    signature, constexprs, attrs = _signature(jit, launch)
    try:
        kernel = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=GPUTarget(*SM90),
                                options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    except (ImportError, KeyError, RuntimeError) as exc:  # a build without the NVIDIA backend
        if "backend" in str(exc).lower() or isinstance(exc, (ImportError, KeyError)):
            raise Unavailable(f"this Triton build cannot target sm_90 ({exc})") from exc
        raise
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
                                capture_output=True, text=True)
    if report.returncode:
        raise RuntimeError(f"ptxas failed: {report.stderr[-2000:]}")
    report = report.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return Resources(launch.fn.__name__, registers, int(spills.group(1)), int(spills.group(2)),
                     int(kernel.metadata.shared))


# ---------------------------------------------------------------------------------------------------
# The configurations in the table
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    kernel: str          # "decode" or "prefill"
    head_dim: int
    group: int
    block_size: int
    dtype: torch.dtype   # the queries' (and a float pool's) dtype
    size: str            # the size class (decode: batch bucket; prefill: new tokens per sequence)
    kv_dtype: torch.dtype | None = None  # a quantized pool's dtype (int8 / float8_e4m3fn)
    window_softcap: bool = False         # a sliding window and soft-capping (Gemma 2/3's layers)


def table_cases() -> list[Case]:
    """Every head dim in both kernels and the half / full dtypes, the GQA groups that change the row tiling,
    the page sizes that change the tile shape (part of a page, several pages, a non-power-of-two page)."""
    cases = []
    for kernel, sizes in (("decode", ("batch64",)), ("prefill", ("extend64", "long"))):
        for head_dim in (32, 40, 48, 64, 80, 96, 128, 256):
            for dtype in (torch.bfloat16, torch.float32):
                for size in sizes:
                    cases.append(Case(kernel, head_dim, 4, 16, dtype, size))
        for group in (1, 8, 32):
            cases.append(Case(kernel, 128, group, 16, torch.bfloat16, sizes[-1]))
        for block_size in (8, 24, 128):
            cases.append(Case(kernel, 128, 4, block_size, torch.bfloat16, sizes[-1]))
        cases.append(Case(kernel, 128, 4, 16, torch.float16, sizes[-1]))
        for kv_dtype in (torch.int8, torch.float8_e4m3fn):
            cases.append(Case(kernel, 128, 4, 16, torch.bfloat16, sizes[-1], kv_dtype))
        cases.append(Case(kernel, 256, 2, 16, torch.bfloat16, sizes[-1], window_softcap=True))
    return cases


_SIZE_SHAPES = {"batch1": 1, "batch8": 8, "batch64": 64, "batch256": 256, "extend64": (4, 64), "chunk1k": (2, 512),
                "long": (1, 2048)}


def case_launches(case: Case, config=None) -> list:
    """The launches a real call of this case builds (on CPU tensors: nothing runs)."""
    from pagedchat.kernels.triton_attention_v2 import decode_launches, prefill_launches

    num_kv_heads = 2
    pool = torch.empty(4, case.block_size, num_kv_heads, case.head_dim, dtype=case.kv_dtype or case.dtype)
    scales = {}  # and the other keyword options of the call
    if case.kv_dtype is not None:
        scale = torch.empty(pool.shape[:3], dtype=torch.float16)
        scales = dict(k_scale=scale, v_scale=scale)
    if case.window_softcap:
        scales.update(sliding_window=512, softcap=50.0)
    heads = num_kv_heads * case.group
    if case.kernel == "decode":
        batch = _SIZE_SHAPES[case.size]
        q = torch.empty(batch, heads, case.head_dim, dtype=case.dtype)
        table, lens = torch.zeros(batch, 4, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)
        return decode_launches(q, pool, pool, table, lens, 0.1, torch.empty_like(q), config=config, num_sms=132,
                               **scales)
    batch, new = _SIZE_SHAPES[case.size]
    q = torch.empty(batch * new, heads, case.head_dim, dtype=case.dtype)
    table, lens = torch.zeros(batch, 4, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    return prefill_launches(q, pool, pool, table, cu, lens, 0.1, torch.empty_like(q), config=config, **scales)


def case_config(case: Case):
    from pagedchat.kernels import triton_attention_configs as C

    if case.kernel == "decode":
        return C.default_decode(case.head_dim, case.kv_dtype or case.dtype, case.dtype if case.kv_dtype else None)
    return C.default_prefill(case.head_dim, case.kv_dtype or case.dtype, case.size,
                             case.dtype if case.kv_dtype else None)


def resource_rows(cases: list[Case], all_candidates: bool = False):
    """One row per compiled kernel, as each compiles: the case, its configuration, registers, spills, shared
    memory."""
    from pagedchat.kernels import triton_attention_configs as C

    for case in cases:
        configs = [case_config(case)]
        if all_candidates:
            pool, q = case.kv_dtype or case.dtype, case.dtype if case.kv_dtype else None
            configs = (C.decode_candidates(case.head_dim, pool, q) if case.kernel == "decode"
                       else C.prefill_candidates(case.head_dim, pool, case.size, q))
        for config in configs:
            for launch in case_launches(case, config):
                yield dict(case=case, config=config, launch=launch, resources=compile_launch(launch))


HEADER = ["| kernel | head dim | group | page | dtype | size class | tiling | warps | stages | registers | "
          "spills (bytes st/ld) | shared memory |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def markdown_row(row: dict) -> str:
    case, cfg, launch, res = row["case"], row["config"], row["launch"], row["resources"]
    if res.kernel == "_decode_kernel":
        tiling = f"{cfg.tile} keys; split plan {cfg.programs_per_sm}/SM, >= {cfg.min_tiles} tiles"
    elif res.kernel == "_decode_merge_kernel":
        tiling = "(merge of the splits)"
    else:
        tiling = f"{cfg.rows} rows x {cfg.tile} keys"
    return (f"| {res.kernel.strip('_').removesuffix('_kernel')} | {case.head_dim} | {case.group} | "
            f"{case.block_size} | {_dtype_name(case)} | {case.size} | {tiling} | {launch.num_warps} | "
            f"{launch.num_stages} | {res.registers} | {res.spill_stores}/{res.spill_loads} | "
            f"{res.shared_bytes // 1024} KiB |")


def _dtype_name(case: Case) -> str:
    name = str(case.dtype).removeprefix("torch.")
    name = name if case.kv_dtype is None else f"{str(case.kv_dtype).removeprefix('torch.')} KV, {name} q"
    return name + (", window + softcap" if case.window_softcap else "")


# ---------------------------------------------------------------------------------------------------
# The GGUF weight matmuls (kernels/triton_gguf.py)
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFCase:
    qtype: str           # GGML type name
    rows: int            # activation rows: 1 (batch-1 decode), 4 (a small batch), 16 (a decode batch), 512 (prefill)
    out_features: int = 2048
    in_features: int = 2048
    dtype: torch.dtype = torch.bfloat16


def gguf_cases() -> list[GGUFCase]:
    """Every type at every size class (Llama-3.2-1B's 2048 x 2048 layer, bf16): each kind of kernel and row
    tile; and fp32 prefill (IEEE dots, their own tile) for a few types."""
    from pagedchat.kernels.triton_gguf import FORMATS

    return ([GGUFCase(qtype, rows) for qtype in FORMATS for rows in (1, 4, 16, 512)]
            + [GGUFCase(qtype, 512, dtype=torch.float32) for qtype in ("Q4_K", "Q6_K", "Q8_0")])


def gguf_resource_rows(cases: list[GGUFCase]):
    """One row per case as it compiles: its launch (the default configuration of an H100's 132 SMs) and
    resources."""
    from pagedchat.kernels.triton_gguf import FORMATS, gguf_launch

    for case in cases:
        values, size, _ = FORMATS[case.qtype]
        x = torch.empty(case.rows, case.in_features, dtype=case.dtype)
        raw = torch.empty(case.out_features, case.in_features // values * size, dtype=torch.uint8)
        launch = gguf_launch(x, raw, case.qtype, torch.empty(case.rows, case.out_features, dtype=case.dtype),
                             num_sms=132)
        yield dict(case=case, launch=launch, resources=compile_launch(launch))


GGUF_HEADER = ["| kernel | weight type | dtype | rows | tiling | warps | stages | registers | spills (bytes st/ld) | "
               "shared memory |",
               "|---|---|---|---|---|---|---|---|---|---|"]


def gguf_markdown_row(row: dict) -> str:
    case, launch, res = row["case"], row["launch"], row["resources"]
    c = launch.constexprs
    tiling = f"{c['BLOCK_M']} x {c['BLOCK_N']} x {c['BLOCK_U'] * 2 * c['RUN']}"   # rows x features x inputs
    return (f"| {res.kernel.strip('_')} | {case.qtype} | {str(case.dtype).removeprefix('torch.')} | {case.rows} | "
            f"{tiling} | {launch.num_warps} | {launch.num_stages} | {res.registers} | "
            f"{res.spill_stores}/{res.spill_loads} | {res.shared_bytes // 1024} KiB |")
