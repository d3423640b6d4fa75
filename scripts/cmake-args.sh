#!/usr/bin/env bash
# Prints the CMAKE_ARGS that scripts/install uses to build llama-cpp-python, or nothing.
#
# Why: some virtual machines advertise CPU features (AMX) that fault when used, so llama.cpp's
# default native build crashes in llama_decode. On a VM ("hypervisor" in /proc/cpuinfo) we build
# without -march=native and switch on exactly the x86 extensions this CPU reports, never AMX.
# Elsewhere (bare metal, macOS/Metal, a user's own CMAKE_ARGS such as -DGGML_CUDA=on) we print
# nothing and llama-cpp-python builds its default way. GGUFSPEC_NATIVE_BUILD=1 forces that too.
set -euo pipefail
[ "${GGUFSPEC_NATIVE_BUILD:-0}" = 1 ] && exit 0
[ -r /proc/cpuinfo ] || exit 0
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
case "$flags" in *" hypervisor "*) ;; *) exit 0 ;; esac
has() { case "$flags" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
args="-DGGML_NATIVE=OFF"
has avx && args="$args -DGGML_AVX=ON"
has avx2 && args="$args -DGGML_AVX2=ON"
has fma && args="$args -DGGML_FMA=ON"
has f16c && args="$args -DGGML_F16C=ON"
has bmi2 && args="$args -DGGML_BMI2=ON"
has avx512f && args="$args -DGGML_AVX512=ON"
has avx512vbmi && args="$args -DGGML_AVX512_VBMI=ON"
has avx512_vnni && args="$args -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && args="$args -DGGML_AVX512_BF16=ON"
has avx_vnni && args="$args -DGGML_AVX_VNNI=ON"
echo "$args"
