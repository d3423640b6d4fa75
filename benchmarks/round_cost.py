"""What one round of N sequences costs in llama_decode, through llama-cpp-python and in llama.cpp's own
llama-batched-bench, on the same model and shape (issue 30: is a slot round slower than llama-server's?).

Through llama-cpp-python (the model opened by ggufspec's `load.open_model`, as `serve --parallel N` opens
it: one unified KV cache of --ctx cells for N sequences): each sequence gets a prompt of --pp tokens,
then --tg rounds put one token of every sequence into one batch, timed round by round. Then, with
--per-seq, rounds with m tokens of every sequence (m = 1, 2, 3, 4, 6: what drafts add to a full batch),
interleaved and cut back after each, their median against m = 1. With --batched-bench, llama.cpp's
llama-batched-bench runs the same shape (-npp, -ntg, -npl, -kvu) right after, in the same run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/round_cost.py --npl 4 --pp 45 --tg 128 --per-seq --batched-bench

Prints one line per measurement (stdout); the CPU as lscpu names it.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import ROOT, cpu_name  # noqa: E402


class Rounds:
    """One llama context holding `npl` sequences, fed batches of (token, position, sequence, logits)."""

    def __init__(self, model: str, npl: int, ctx: int, threads: int, separate_caches: bool = False):
        from ggufspec.load import LoadParams, open_model
        params = LoadParams(n_ctx=ctx, n_threads=threads, n_seq=npl, kv_unified=not separate_caches)
        self.llm = open_model(model, "target", params)
        self.ctx, self.npl = self.llm._ctx.ctx, npl
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(512, 0, npl)

    def decode(self, items) -> float:
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        started = time.perf_counter()
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    def prompts(self, pp: int) -> float:
        return sum(self.decode([(1000 + i % 50, i, seq, i == pp - 1) for i in range(pp)]) for seq in range(self.npl))

    def round(self, pos: int, m: int = 1) -> float:
        return self.decode([(2000 + (pos + j) % 100, pos + j, seq, True) for seq in range(self.npl) for j in range(m)])

    def cut(self, pos: int) -> None:
        for seq in range(self.npl):
            llama_cpp.llama_memory_seq_rm(self.memory, seq, pos, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF (default: the demo pair's target).")
    parser.add_argument("--npl", type=int, default=4, help="Sequences in a round.")
    parser.add_argument("--pp", type=int, default=45, help="Prompt tokens per sequence.")
    parser.add_argument("--tg", type=int, default=128, help="Rounds of one token per sequence.")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-seq", action="store_true", help="Also time rounds of m tokens per sequence.")
    parser.add_argument("--batched-bench", action="store_true", help="Then llama.cpp's llama-batched-bench.")
    parser.add_argument("--separate-caches", action="store_true",
                        help="A KV cache per sequence (llama.cpp's kv_unified=false) instead of the unified one.")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from ggufspec import store
        model = str(store.demo_pair_paths(progress=False)[0])
    print(f"CPU: {cpu_name()}, {args.threads} threads; {Path(model).name}; {args.npl} sequences, "
          f"prompts {args.pp}, {args.tg} rounds")
    rounds = Rounds(model, args.npl, args.ctx, args.threads, args.separate_caches)
    prompt_s = rounds.prompts(args.pp)
    times = [rounds.round(args.pp + r) for r in range(args.tg)]
    print(f"llama-cpp-python: prompts {prompt_s:.2f} s; a round of {args.npl} tokens: median "
          f"{1000 * statistics.median(times):.1f} ms, mean {1000 * statistics.mean(times):.1f} ms "
          f"({args.npl * args.tg / sum(times):.2f} tok/s)")
    if args.per_seq:
        pos, per_m = args.pp + args.tg, {m: [] for m in (1, 2, 3, 4, 6)}
        for _ in range(6):
            for m, seconds in per_m.items():
                seconds.append(rounds.round(pos, m))
                rounds.cut(pos)
        base = statistics.median(per_m[1])
        for m, seconds in per_m.items():
            print(f"  {m} per sequence ({args.npl * m} tokens): {1000 * statistics.median(seconds):.0f} ms "
                  f"= {statistics.median(seconds) / base:.2f}x the round of one each")
    if args.batched_bench:
        rounds.llm.close()
        binary = ROOT / "third_party/llama.cpp/build/bin/llama-batched-bench"
        out = subprocess.run([str(binary), "-m", model, "-c", str(args.ctx), "-b", "512", "-ub", "512",
                              "-t", str(args.threads), "-npp", str(args.pp), "-ntg", str(args.tg),
                              "-npl", str(args.npl), "-kvu"], capture_output=True, text=True, check=True).stdout
        row = [line for line in out.splitlines() if line.startswith("|") and line.split("|")[1].strip().isdigit()][-1]
        t_tg = float(row.split("|")[7])
        print(f"llama-batched-bench: a round of {args.npl} tokens: mean {1000 * t_tg / args.tg:.1f} ms  ({row.strip()})")


if __name__ == "__main__":
    main()
