#!/usr/bin/env bash
# The GPU path, measured on a GPU machine set up with ../shared/gpu (README.md there):
#   bash .gpukit/device-setup.sh 450 && bash benchmarks/gpu_path.sh
# Real-shaped random-weight models (~/gpukit/t15.gguf: the demo target's shape and size; d05.gguf:
# the draft's). Random weights time a forward pass as real ones do; they never agree with each
# other (a never-agreeing draft), and a model drafting for itself agrees except at near-ties.
#   1. plan's estimate before anything is measured (fresh GGUFSPEC_HOME: no remembered costs)
#   2. target alone / --draft 3 / --draft auto (never-agreeing draft) vs llama.cpp's own decode
#      (llama-completion) and llama-speculative-simple at K = 3, same build, same offload
#   3. self-drafting K = 3 (t15 drafts for itself) vs llama-speculative-simple doing the same
#   4. plan again, now from the costs bench remembered
# Results: $OUT (or ./gpu-path-out): one JSON per step, steps.log, machine.txt (at most 8 files). Each step has its own time limit.
set -u
G=${GPUKIT_DIR:-$HOME/gpukit}
OUT=${OUT:-$PWD/gpu-path-out}; mkdir -p "$OUT"
[ -f "$G/env.sh" ] && source "$G/env.sh"
export GGUFSPEC_HOME=${GGUFSPEC_HOME:-$(mktemp -d)}
T=${TARGET:-$G/t15.gguf} D=${DRAFT:-$G/d05.gguf}
SS=${SPEC_SIMPLE:-$(command -v llama-speculative-simple)}
N=${N_PREDICT:-256}
PROMPTS=benchmarks/gpu-path-prompts.jsonl
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))" >&2
         echo "== $name: $*" >>"$OUT/steps.log"
         timeout "$limit" "$@" >"$OUT/$name.json" 2>>"$OUT/steps.log"; echo "   rc=$? ($(date +%T))" >&2; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c 'import llama_cpp; print("gpu offload:", llama_cpp.llama_supports_gpu_offload())'; } >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" >&2
step plan-estimated 60 ggufspec plan -m "$T" -md "$D" --json
step bench-never-agreeing 240 ggufspec bench -m "$T" -md "$D" --prompts $PROMPTS --draft 3,auto -n "$N" --repeat 2 \
     --against-llamacpp "$SS" --json
step bench-self-draft 150 ggufspec bench -m "$T" -md "$T" --prompts $PROMPTS --draft 3 -n "$N" --repeat 1 \
     --against-llamacpp "$SS" --json
step plan-measured 60 ggufspec plan -m "$T" -md "$D" --json
tail -n 20 "$OUT/steps.log" >&2
