#!/usr/bin/env bash
# CMAKE_ARGS for building llama.cpp (llama-cpp-python) for this machine's vector ISA: AVX2 everywhere, the
# AVX-512 extensions this CPU has, never AMX. -march=native is not used: these virtual machines list AMX but
# fault on its tile instructions (ggml then runs its AMX matmul and dies with SIGILL).
flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=$(has bmi2) \
-DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
