#!/usr/bin/env bash
# Regenerate every number and picture in docs/benchmarks.md: the CPU runs always, the GPU runs when CUDA is
# present. Each JSON result carries its exact command, date and machine; docs/benchmarks.md is written from
# them by scripts/bench_report.py (no number in it is typed by hand).
#
#   scripts/run_benchmarks.sh            # everything (about 10 minutes on a 2-core CPU)
#   ONLY=memory scripts/run_benchmarks.sh   # one group: memory | throughput | chat | gpu
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

if want memory; then
    run memory -- pagedchat bench memory --json
    run memory-shared -- pagedchat bench memory --shared-prefix 200 --no-window --json --plot docs/img/memory.png
fi
if want throughput; then
    run throughput-cpu-small -- pagedchat bench throughput --random llama --random-size small --device cpu \
        --requests 16 --max-tokens 64 --repeats 3 --profile --json --plot docs/img/throughput.png
    run throughput-cpu-tiny -- pagedchat bench throughput --random llama --random-size tiny --device cpu \
        --requests 16 --max-tokens 128 --repeats 3 --profile --json
fi
if want chat; then
    run chat-cpu-small -- pagedchat bench chat --random llama --random-size small --device cpu \
        --history 1024,2048,4096 --json --plot docs/img/chat.png
    run chat-cpu-tiny -- pagedchat bench chat --random llama --random-size tiny --device cpu --json
fi
if want gpu && python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    run throughput-gpu-1b -- pagedchat bench throughput --random llama --random-size 1b --device cuda \
        --requests 256 --max-tokens 256 --repeats 3 --profile --json --plot docs/img/throughput-gpu.png
    run chat-gpu-1b -- pagedchat bench chat --random llama --random-size 1b --device cuda --json \
        --plot docs/img/chat-gpu.png
    run kernels-gpu -- pagedchat bench kernels --json --plot docs/img/kernels-gpu.png \
        || echo "bench kernels failed; see above" >&2
fi
python scripts/bench_report.py "$OUT" > docs/benchmarks.md.tmp
mv docs/benchmarks.md.tmp docs/benchmarks.md
echo "wrote docs/benchmarks.md" >&2
