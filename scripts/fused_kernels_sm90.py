"""Compile the fused layer kernels (kernels/triton_fused.py) for sm_90 on a machine without a GPU and report
registers, spills and shared memory per configuration, from ptxas -v (Triton's bundled ptxas).

    python scripts/fused_kernels_sm90.py [--json]
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from pagedchat.kernels import triton_fused as tf

TARGET = GPUTarget("cuda", 90, 32)


def _ptxas() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    newest = sorted(glob.glob(os.path.join(folder, "ptxas*")), key=lambda p: "blackwell" not in p)
    return newest[0]


def _report(fn, signature: dict, constants: dict, **options) -> dict:
    for name in constants:
        signature[name] = "constexpr"
    compiled = triton.compile(triton.compiler.ASTSource(triton.jit(fn), signature, constants), target=TARGET,
                              options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, out)) else None  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared_bytes": number(r"(\d+) bytes smem") or 0}


def main() -> None:
    rows = []
    for dt in ("bf16", "fp16", "fp32"):
        for block, warps in ((2048, 4), (8192, 8)):
            sig = {n: f"*{dt}" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}
            sig.update(n_cols="i32", eps="fp32", stride_x="i64", stride_r="i64", stride_o="i64", stride_s="i64")
            rows.append({"kernel": "add_rms_norm", "dtype": dt, "config": f"BLOCK={block} warps={warps}",
                         **_report(tf._add_rms_norm_kernel, sig, dict(HAS_RESIDUAL=True, ROUND_NORMED=dt != "fp32",
                                                                       BLOCK=block), num_warps=warps)})
        sig = {"gu_ptr": f"*{dt}", "out_ptr": f"*{dt}", "n_cols": "i32", "stride_gu": "i64", "stride_o": "i64"}
        rows.append({"kernel": "silu_and_mul", "dtype": dt, "config": "BLOCK=1024 warps=4",
                     **_report(tf._silu_and_mul_kernel, sig, dict(BLOCK=1024), num_warps=4)})
        for head_dim, block_h, qk_norm in ((64, 16, False), (128, 8, True), (128, 8, False), (256, 4, True)):
            sig = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "q_out_ptr")}
            sig.update(pos_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
                       qw_ptr=f"*{dt}" if qk_norm else "*fp32", kw_ptr=f"*{dt}" if qk_norm else "*fp32",
                       num_q_heads="i32", num_kv_heads="i32", eps="fp32")
            sig.update({n: "i64" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                           "stride_vh", "stride_ot", "stride_oh", "stride_table", "stride_cb",
                                           "stride_ct", "stride_ch")})
            const = dict(HEAD_DIM=head_dim, ROT_DIM=head_dim, BLOCK_SIZE=16, BLOCK_H=block_h, BLOCK_D=head_dim,
                         Q_BLOCKS=2, QK_NORM=qk_norm)
            rows.append({"kernel": "rope_write_kv", "dtype": dt,
                         "config": f"D={head_dim} BLOCK_H={block_h} qk_norm={qk_norm} warps=4",
                         **_report(tf._rope_write_kv_kernel, sig, const, num_warps=4, enable_fp_fusion=False)})
    if "--json" in sys.argv:
        import datetime

        from pagedchat.bench.common import machine_description

        print(json.dumps({"command": "python scripts/fused_kernels_sm90.py --json",
                          "date": datetime.date.today().isoformat(), "machine": machine_description(),
                          "target": "sm_90a", "triton": triton.__version__, "rows": rows}, indent=1))
        return
    for r in rows:
        print(f"{r['kernel']:14s} {r['dtype']:5s} {r['config']:36s} regs {r['registers']:4} "
              f"spills {r['spill_stores']}/{r['spill_loads']} smem {r['shared_bytes']}")


if __name__ == "__main__":
    main()
