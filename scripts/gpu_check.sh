#!/usr/bin/env bash
# One command measures the GPU: the GPU tests, batch-1 decode and TTFT, 256-request throughput and the kernel
# benchmark, each step under its own time limit, all in under 10 minutes on one H100/H200. Writes
# OUTDIR/gpu-check.json (date, git revision, GPU, driver, versions, every figure, each step's status) and prints a
# short table. Needs CUDA torch, triton and transformers; installs this project without network access. The
# batch-1 row of the model's shape as a Q4_K_M GGUF file (against the model in bf16) also needs gguf-py (`gguf`,
# pure Python: where it is missing, install its wheel first); without it that row is an error and the rest runs.
#
#   scripts/gpu_check.sh [OUTDIR]            run it (default OUTDIR: gpu-check-DATE)
#   scripts/gpu_check.sh --dry-run [OUTDIR]  the plan, the JSON and the table on CPU (no GPU needed)
#
# PYTHON picks the interpreter (default: python3). Steps and limits: pagedchat/bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pagedchat.bench.gpu "$@"
