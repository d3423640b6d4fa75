"""What `--exact` costs, and what it buys: batch vs single-token logits, and batch times, per mode.

Modes, each in a process of its own (llama.cpp reads its tiled-matmul switch once per process):
  default  llama.cpp's CPU kernels (weights repacked, tiled K-quant matmul from 8 rows up)
  exact    --exact: neither (load.exact_kernels), flash attention on
  strict   --strict: micro-batches of one token (n_ubatch = 1)
For each: max |logits of n tokens in one batch - the same n one at a time| (n = 3, 8, 17), and the
median time of a batch of n tokens after a short prompt, n = 1, 4, 9, 17, 65 (verifications of
K = 0, 3, 8, 16, 64) and 256 (a prompt). Rounds interleave the modes (the machine is shared: the
ratios hold, the absolute times don't).

    python benchmarks/exact_batch.py [-m target.gguf] [-t 2] [--rounds 2]   # default: the demo target
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = (1, 4, 9, 17, 65, 256)
MODES = ("default", "exact", "strict")
TEXT = ("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]\n"
        "    left = [x for x in arr if x < pivot]\n    right = [x for x in arr if x > pivot]\n"
        "    return quicksort(left) + [pivot] + quicksort(right)\n")


def batch_minus_single(ctx, tokens: list[int], sizes) -> dict:
    """For each n of `sizes`: max |logits of the last n tokens decoded in one batch - the same n decoded one at
    a time| (a native.Context; tests/test_exact_batch.py runs it too)."""
    import numpy as np
    worst = {}
    for n in sizes:
        head, tail = tokens[:-n], tokens[-n:]
        ctx.keep(0)
        ctx.decode(head, n_logits=0)
        ctx.decode(tail, n_logits=n)
        batched = np.array([ctx.logits(i) for i in range(n)])
        ctx.keep(len(head))
        single = []
        for token in tail:
            ctx.decode([token], n_logits=1)
            single.append(ctx.logits(0).copy())
        worst[n] = float(np.abs(batched - np.array(single)).max())
    return worst


def measure(path: str, mode: str, threads: int) -> dict:
    """One mode, in this process: the logit differences and the batch times."""
    from ggufspec.load import LoadParams, open_model, tokenize
    from ggufspec.native import Context
    llm = open_model(path, "target", LoadParams(n_ctx=1024, n_threads=threads, exact=mode == "exact"),
                     strict=mode == "strict")
    ctx = Context(llm, "target")
    tokens = tokenize(llm, TEXT)
    worst = batch_minus_single(ctx, tokens, (3, 8, 17))
    times = {}
    for n in SIZES:
        runs = []
        for _ in range(4):
            ctx.keep(0)
            ctx.decode(tokens[:16], n_logits=0)
            t0 = time.perf_counter()
            ctx.decode((tokens * 8)[:n], n_logits=1)
            runs.append(time.perf_counter() - t0)
        times[n] = statistics.median(runs[1:])
    return {"diff": worst, "seconds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a mode in this process
    args = parser.parse_args()
    if args.model is None:
        from ggufspec import store
        args.model = str(store.demo_pair_paths(progress=False)[0])
    if args.one:
        print(json.dumps(measure(args.model, args.one, args.threads)))
        return
    results = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            done = subprocess.run([sys.executable, __file__, "--one", mode, "-m", args.model, "-t", str(args.threads)],
                                  capture_output=True, text=True, check=True)
            results[mode].append(json.loads(done.stdout.splitlines()[-1]))
    print(f"model {args.model}; {args.threads} threads; CPU {cpu_name()}")
    print("| mode | max abs(batch - single), n = 3 / 8 / 17 | " + " | ".join(f"T({n}) ms" for n in SIZES) + " |")
    print("|---|---|" + "---:|" * len(SIZES))
    for mode, runs in results.items():
        diff = " / ".join(f"{runs[0]['diff'][str(n)]:.3g}" for n in (3, 8, 17))
        cells = [statistics.median(r["seconds"][str(n)] for r in runs) * 1e3 for n in SIZES]
        print(f"| {mode} | {diff} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


def cpu_name() -> str:
    text = open("/proc/cpuinfo").read()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'AVX512' if 'avx512f' in text else 'AVX2'})"


if __name__ == "__main__":
    main()
