"""Where a verification batch's logits leave the single-token ones, and what making them equal costs.

For each load setting (weight repacking on/off: llama.cpp's --no-repack, i.e. use_extra_bufts; flash
attention on/off), on one model:
  - max |logits of N tokens evaluated in one batch - the same N evaluated one at a time|, over several
    prompts (0.0: a verification batch decides exactly what the target alone decides);
  - the time of a single-token step (decode speed) and of a batch of 4 (a K=3 verification), as
    medians over interleaved rounds (the machine is shared: the ratios hold, absolute times don't).

    python benchmarks/exact_batch.py [-m target.gguf] [-t 2] [--rounds 5]   # default: the demo target
"""
from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time

import numpy as np

from ggufspec.load import LoadParams, open_model, tokenize
from ggufspec.native import Context

PROMPTS = ["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]\n",
           "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy",
           "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n",
           "Once upon a time, in a small village at the edge of a great forest, there lived"]
N_BATCH = 6


def demo_target() -> str:
    from ggufspec import store
    return str(store.demo_pair_paths(progress=False)[0])


def open_context(path: str, threads: int, repack: bool, flash_attn: str) -> Context:
    llm = open_model(path, "target", LoadParams(n_ctx=512, n_threads=threads, flash_attn=flash_attn, repack=repack))
    return Context(llm, "target")


def batch_vs_single(ctx: Context, prompt: list[int]) -> float:
    """max |difference| between the logits of the prompt's last N_BATCH tokens in one batch and one at a time."""
    head, tail = prompt[:-N_BATCH], prompt[-N_BATCH:]
    ctx.keep(0)
    ctx.decode(head, n_logits=0)
    ctx.decode(tail, n_logits=N_BATCH)
    batched = np.array([ctx.logits(i) for i in range(N_BATCH)])
    ctx.keep(len(head))
    single = []
    for token in tail:
        ctx.decode([token], n_logits=1)
        single.append(ctx.logits(0).copy())  # a view of a buffer the next decode overwrites
    return float(np.abs(batched - np.array(single)).max())


def step_seconds(ctx: Context, prompt: list[int], n: int, repeats: int = 8) -> float:
    """Median seconds of a batch of n tokens after the prompt (cut back after each)."""
    ctx.keep(0)
    ctx.decode(prompt, n_logits=0)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        ctx.decode(prompt[-n:], n_logits=n)
        times.append(time.perf_counter() - t0)
        ctx.keep(len(prompt))
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = args.model or demo_target()
    settings = list(itertools.product([True, False], ["on", "off"]))
    contexts = {s: open_context(path, args.threads, *s) for s in settings}
    prompts = [tokenize(next(iter(contexts.values())).llm, p) for p in PROMPTS]
    diffs = {s: max(batch_vs_single(ctx, p) for p in prompts) for s, ctx in contexts.items()}
    times = {(s, n): [] for s in settings for n in (1, 4)}
    for _ in range(args.rounds):  # interleaved: each round times every setting
        for s, ctx in contexts.items():
            for n in (1, 4):
                times[s, n].append(step_seconds(ctx, prompts[0], n))
    t = {key: statistics.median(values) for key, values in times.items()}
    print(f"model {path}; {args.threads} threads; CPU {cpu_name()}")
    print("| repack | flash attn | max abs(batch - single) | T(1) ms | decode speed vs repack on, fa on | T(4)/T(1) |")
    print("|---|---|---:|---:|---:|---:|")
    for s in settings:
        print(f"| {'on' if s[0] else 'off'} | {s[1]} | {diffs[s]:.3g} | {t[s, 1] * 1e3:.1f} | "
              f"{t[(True, 'on'), 1] / t[s, 1]:.2f}x | {t[s, 4] / t[s, 1]:.2f} |")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = open("/proc/cpuinfo").read()
                return f"{name} ({'AVX512' if 'avx512f' in flags else 'AVX2'})"
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
