#!/usr/bin/env bash
# Prints the CMAKE_ARGS that scripts/install (llama-cpp-python) and scripts/build-llamacpp.sh (llama.cpp's
# own tools) build with. `scripts/cmake-args.sh --backend` prints only the GPU backend chosen:
# cuda, metal or cpu. Nothing here builds anything: tests/test_install.py runs it with fake tools.
#
# The backend:
# - CUDA when nvcc is found (on PATH, or $CUDA_HOME/bin/nvcc) AND an NVIDIA GPU answers `nvidia-smi -L`,
#   for that GPU's compute capability (several GPUs: each one's). A CUDA toolkit without a GPU (a CI box,
#   a container built for later) builds for the CPU unless GGUFSPEC_CUDA=1 says otherwise; then the
#   architecture is the GPU's if one answers, else "native" (the build machine's).
# - Metal on Apple Silicon: llama.cpp's default there, nothing to set.
# - GGUFSPEC_CPU_ONLY=1: the CPU only, whatever is found (-DGGML_METAL=OFF on a Mac).
#
# The CPU part: some virtual machines advertise CPU features (AMX) that fault when used, so llama.cpp's
# default native build crashes in llama_decode. On a VM ("hypervisor" in /proc/cpuinfo) we build without
# -march=native and switch on exactly the x86 extensions this CPU reports, never AMX. Elsewhere the CPU
# part is llama.cpp's default (native); GGUFSPEC_NATIVE_BUILD=1 forces that on a VM too.
set -euo pipefail

nvcc_path() {
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc
  elif [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then echo "$CUDA_HOME/bin/nvcc"
  fi
}

gpu_visible() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# "9.0\n8.6" -> "90;86" (each GPU's compute capability, once), or "native" when none answers
cuda_architectures() {
  local caps=""
  if gpu_visible; then
    caps="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | grep -E '^[0-9]+$' \
      | sort -u | paste -sd ';' || true)"
  fi
  echo "${caps:-native}"
}

backend() {
  if [ "${GGUFSPEC_CPU_ONLY:-0}" = 1 ]; then echo cpu
  elif [ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ]; then echo metal
  elif [ -n "$(nvcc_path)" ] && { [ "${GGUFSPEC_CUDA:-0}" = 1 ] || gpu_visible; }; then echo cuda
  else echo cpu
  fi
}

backend_args() {
  case "$1" in
    cuda)
      local args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(cuda_architectures)"
      # found through CUDA_HOME only: tell CMake where the compiler is
      command -v nvcc >/dev/null 2>&1 || args="$args -DCMAKE_CUDA_COMPILER=$(nvcc_path)"
      echo "$args" ;;
    cpu) [ "$(uname -s)" = Darwin ] && echo "-DGGML_METAL=OFF" || true ;;
  esac
}

cpu_args() {
  [ "${GGUFSPEC_NATIVE_BUILD:-0}" = 1 ] && return 0
  [ -r /proc/cpuinfo ] || return 0
  local flags args
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  case "$flags" in *" hypervisor "*) ;; *) return 0 ;; esac
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
}

chosen="$(backend)"
if [ "${1:-}" = --backend ]; then
  echo "$chosen"
  exit 0
fi
args="$(cpu_args) $(backend_args "$chosen")"
echo $args  # unquoted on purpose: one line, single spaces, nothing when both parts are empty
