#!/usr/bin/env bash
# Measure what docs/benchmarks.md reports, on this machine, and fill its tables. Each result goes to
# docs/bench-results/NAME.json with its exact command, date and machine; timed CPU results are named by this
# CPU's vector ISA (-avx512, -avx2, -other: the numbers of one do not hold on another), counts are not.
# Then scripts/bench_report.py writes the page's tables from the files (no number in them is typed by hand).
#
#   scripts/run_benchmarks.sh                 # every group (about 50 minutes on a 2-core CPU)
#   ONLY=throughput scripts/run_benchmarks.sh # one group: memory | throughput | chat | serve | spec | accuracy | real | web | gpu
#   ONLY=real-avx2 AVX2_LLAMA_CPP=DIR scripts/run_benchmarks.sh   # the AVX2 builds of both systems (only on request)
#
# Run it on a quiet machine: every comparison alternates the systems in one run, but a busy neighbour still
# moves the ratios. The llama.cpp rows need llama-cpp-python (without it they are left out, with a note).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/bench-results
mkdir -p "$OUT" docs/img
want() { [[ -z "${ONLY:-}" || "$ONLY" == "$1" ]]; }
run() {  # run NAME -- COMMAND...: stdout (one JSON object) to $OUT/NAME.json, atomically
    local name=$1; shift 2
    echo "== $name: $*" >&2
    "$@" > "$OUT/$name.json.tmp" || { rm -f "$OUT/$name.json.tmp"; return 1; }
    mv "$OUT/$name.json.tmp" "$OUT/$name.json"
}
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then ISA=avx512
elif grep -qw avx2 /proc/cpuinfo 2>/dev/null; then ISA=avx2
else ISA=other; fi

if want memory; then     # block counts: the same on every machine
    run memory -- pagedchat bench memory --beams 8 --json
    run memory-shared -- pagedchat bench memory --shared-prefix 200 --no-window --json --plot docs/img/memory.png
    run kv-dtype -- python scripts/kv_dtype_bench.py --json -   # pool sizes per KV dtype at the same budget
fi
if want throughput; then # batch-1 rows (with llama.cpp) and 16 prompts end to end
    run "throughput-cpu-$ISA" -- pagedchat bench throughput --random llama --random-size small \
        --systems pagedchat,hf-generate --requests 16 --max-tokens 64 --repeats 3 --peer llama.cpp --threads 1 --json
    run "cpu-sweep-$ISA" -- pagedchat bench cpu-sweep --random llama --random-size small --peer llama.cpp \
        --threads 1 --json
    run "cpu-sweep-int8-$ISA" -- pagedchat bench cpu-sweep --random llama --random-size small --quantize int8 \
        --batches 1,4,16 --peer llama.cpp --threads 1 --json
    run "cpu-sweep-int4-$ISA" -- pagedchat bench cpu-sweep --random llama --random-size small --quantize int4 \
        --batches 1,4,16 --peer llama.cpp --threads 1 --json
    # a 1B model: its weights come from memory, not the last-level cache
    run "cpu-1b-int8-$ISA" -- pagedchat bench cpu-sweep --random llama --random-size 1b --quantize int8 \
        --batches 1 --skip native,torch,transformers --peer llama.cpp --threads 1 --json
    run "cpu-1b-int4-$ISA" -- pagedchat bench cpu-sweep --random llama --random-size 1b --quantize int4 \
        --batches 1 --skip native,torch,transformers --peer llama.cpp --threads 1 --json
fi
if want chat; then
    run "chat-cpu-$ISA" -- pagedchat bench chat --random llama --random-size small --device cpu \
        --history 1024,2048,4096 --json --plot docs/img/chat.png
    run beams-chat -- pagedchat bench chat --random llama --random-size small --history 1024 --repeats 1 \
        --variants 2 --beams 8 --beam-prompts 1024,2048 --beam-tokens 64 --json --plot docs/img/bench-chat.png
fi
if want serve; then
    run "serve-search-$ISA" -- pagedchat bench serve --json
    run "serve-lognormal-$ISA" -- pagedchat bench serve --rates 2,3,4,5,6,8,10,12,14,16 --requests 60 \
        --pool-blocks 56 --mean-output 32 --json --plot docs/img/bench-serve-lognormal.png
    run "serve-chat-$ISA" -- pagedchat bench serve --workload chat --system-tokens 256 --mean-prompt 32 \
        --mean-output 32 --pool-blocks 96 --rates 1,1.5,2,3,4,5,6,8,10 --requests 60 --json \
        --plot docs/img/bench-serve-chat.png
fi
if want spec; then
    run "spec-demo-$ISA" -- pagedchat bench spec -m demo --batch 16 --max-tokens 96 --repeats 5 --json
fi
if want accuracy; then   # not a timing, but the native int8 path differs per ISA in its rounding
    run accuracy-demo -- pagedchat bench accuracy -m demo --modes fp,int8,int4,kv-int8 --peer llama.cpp \
        --threads 1 --json
    run accuracy-small -- pagedchat bench accuracy --random llama --random-size small --init-std 0.02 \
        --modes fp,int8,int4,kv-int8 --prompts 8 --tokens 256 --threads 1 --json
fi
if want real; then        # the published GGUF files against llama.cpp on the same file (fetched on first use)
    run "real-models-$ISA" -- python scripts/bench_real_models.py --threads 1 --repeats 3 --json
    run "real-models-2threads-$ISA" -- python scripts/bench_real_models.py --threads 2 --repeats 3 --json
fi
# The AVX2 paths of both systems on a CPU with AVX-512: pagedchat's native step built for haswell, and a
# llama-cpp-python built without AVX-512 or VNNI into AVX2_LLAMA_CPP (a folder for PYTHONPATH), as with
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
#     -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF" pip install --no-deps --target DIR llama-cpp-python==0.3.36
if [[ "${ONLY:-}" == real-avx2 ]]; then
    [[ -n "${AVX2_LLAMA_CPP:-}" ]] || { echo "real-avx2 needs AVX2_LLAMA_CPP (see above)" >&2; exit 2; }
    avx2=(env PAGEDCHAT_NATIVE_CFLAGS=-march=haswell PAGEDCHAT_NATIVE_CACHE="${TMPDIR:-/tmp}/pagedchat-avx2-native"
          PYTHONPATH="$AVX2_LLAMA_CPP${PYTHONPATH:+:$PYTHONPATH}")
    run real-models-avx2-builds -- "${avx2[@]}" python scripts/bench_real_models.py --threads 1 --repeats 3 \
        --llama-1b --json
    run real-models-2threads-avx2-builds -- "${avx2[@]}" python scripts/bench_real_models.py --threads 2 \
        --repeats 5 --llama-1b --json
fi
if want web; then         # the chat page in Debian's chromium (apt install chromium chromium-driver)
    run "web-$ISA" -- python scripts/bench_web.py --repeats 5 --json
fi
if want gpu; then         # what a CPU can measure of the CUDA path: launches per step, sm_90 registers
    run launches-fused-cpu -- pagedchat bench launches --device cpu --json
    run launches-fused-cpu-qwen3 -- pagedchat bench launches --device cpu --random qwen3 --json
    run fused-kernels-sm90 -- python scripts/fused_kernels_sm90.py --json
    run "host-step-$ISA" -- pagedchat bench host-step --repeats 5 --json   # what a GPU waits for between steps
fi
if want gpu && python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [[ -x scripts/gpu_check.sh ]]; then
        scripts/gpu_check.sh "$OUT"       # writes $OUT/gpu-check.json
    fi
    run kernels-gpu -- pagedchat bench kernels --json --plot docs/img/kernels-gpu.png \
        || echo "bench kernels failed; see above" >&2
fi
python scripts/bench_report.py
