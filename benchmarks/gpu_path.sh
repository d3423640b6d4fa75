#!/usr/bin/env bash
# The GPU path, measured on a GPU machine set up with ../shared/gpu (README.md there), in one call:
#   bash .gpukit/device-setup.sh 480 >/dev/null 2>&1; bash benchmarks/gpu_path.sh
# (about 10 minutes: on round 20's H200, 7.7 of setup with the 7B-wide target, and 2 of this).
# Real-shaped random-weight models (~/gpukit/t15.gguf: the demo target's shape and size; d05.gguf:
# the draft's). Random weights time a forward pass as real ones do; they never agree with each other
# (a never-agreeing draft), and a model drafting for itself agrees except at near-ties. The steps, most wanted first:
#   1. plan's estimate before anything is measured (a fresh GGUFSPEC_HOME: no remembered costs)
#   2. target alone / --draft 3 / --draft auto (never-agreeing draft) vs llama.cpp's own decode
#      (llama-completion) and llama-speculative-simple at K = 3, same build, the planned offload
#   3. self-drafting K = 3 (t15 drafts for itself) vs llama-speculative-simple doing the same
#   4. plan again, now from the costs bench remembered
#   5. 1, 2, 4 and 8 streams at once on the 7B-wide target, the target alone and auto (issue 30)
#   6. llama-bench's batch curves, both targets: what a verification of K + 1 tokens costs
#   7. the streams of step 5 on t15
#   8. the per-token loop: a bare llama_decode + argmax loop through llama-cpp-python against
#      ggufspec's target alone (benchmarks/loop_overhead.py)
# TARGET=~/gpukit/t7.gguf runs steps 1-4 with the 7B-wide target the kit also makes (on the H200 a
# batch of 4 still cost 1.78 of its tokens). N_PREDICT / STREAM_TOKENS shorten the runs.
# Results: $OUT (or ./gpu-path-out), at most 8 files: one JSON per step, and steps.log (the machine first).
# Round 12's H100 run (its steps by hand) and round 20's H200 run (all of it) are in
# docs/benchmarks.md.
set -u
G=${GPUKIT_DIR:-$HOME/gpukit}
OUT=${OUT:-$PWD/gpu-path-out}; mkdir -p "$OUT"
[ -f "$G/env.sh" ] && source "$G/env.sh"
export GGUFSPEC_HOME=${GGUFSPEC_HOME:-$(mktemp -d)}
T=${TARGET:-$G/t15.gguf} D=${DRAFT:-$G/d05.gguf} T7=${TARGET7:-$G/t7.gguf}
SS=${SPEC_SIMPLE:-$(command -v llama-speculative-simple)}
LB=${LLAMA_BENCH:-$(dirname "$SS")/llama-bench}
N=${N_PREDICT:-256} NS=${STREAM_TOKENS:-128}
PROMPTS=benchmarks/gpu-path-prompts.jsonl
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))" >&2
         echo "== $name: $*" >>"$OUT/steps.log"
         timeout "$limit" "$@" >>"$OUT/$name.json" 2>>"$OUT/steps.log"; echo "   rc=$? ($(date +%T))" >&2; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c 'import llama_cpp; print("gpu offload:", llama_cpp.llama_supports_gpu_offload())'; } >"$OUT/steps.log" 2>&1
cat "$OUT/steps.log" >&2
PY=$(dirname "$(command -v ggufspec)")/python; [ -x "$PY" ] || PY=python3
# The brief's four measurements first (a call may end before the rest), then issue 30's streams on the
# 7B-wide target (bound by its bytes), then the t15 extras. $OUT takes at most 8 files: plan.json holds
# both plans (estimated, then measured), llama-bench.json both models' batch curves.
step plan 60 ggufspec plan -m "$T" -md "$D" --json
step bench-never-agreeing 240 ggufspec bench -m "$T" -md "$D" --prompts $PROMPTS --draft 3,auto -n "$N" --repeat 2 \
     --against-llamacpp "$SS" --json
step bench-self-draft 150 ggufspec bench -m "$T" -md "$T" --prompts $PROMPTS --draft 3 -n "$N" --repeat 1 \
     --against-llamacpp "$SS" --json
step plan 60 ggufspec plan -m "$T" -md "$D" --json
[ -f "$T7" ] && step streams-t7 180 ggufspec bench -m "$T7" -md "$D" --prompts benchmarks/held-out-prompts.jsonl \
     --streams 1,2,4,8 -n "$NS" --json
step llama-bench 90 "$LB" -m "$T" $([ -f "$T7" ] && echo -m "$T7") -p 1,2,3,4,5,8,9,16 -n 64 -ngl 99 -r 3 -o json
step streams 180 ggufspec bench -m "$T" -md "$D" --prompts benchmarks/held-out-prompts.jsonl --streams 1,2,4,8 \
     -n "$NS" --json
step loop 90 "$PY" benchmarks/loop_overhead.py --model "$T" --ngl 99 --tokens "$N" --rounds 5 --json
tail -n 20 "$OUT/steps.log" >&2
