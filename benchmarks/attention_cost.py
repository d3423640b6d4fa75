"""What flash attention costs a verification on this machine: the same model in two contexts, flash attention
on and off, each filled with the same `--depth` tokens; then batches of n tokens with every row's logits (what
verifying n - 1 drafts needs), timed alternately in the two contexts, the least of `--repeat` counting
(interference only adds time). Also each context's prefill of the depth (one run: a prompt's cost), and how
far each setting's batches round a row away from the same token alone.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/attention_cost.py --depth 1500 --json attention-cost.json

Why: llama.cpp's CPU flash attention takes a tiled kernel from 64 query rows of a sequence; below that it
walks the cache once per row, where without flash attention the rows share one matrix product. `-fa auto`
(ggufspec's) is off where the CPU computes every layer: `load.resolved_flash_attn`.
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufspec.native import Context  # noqa: E402


def filled_context(model: str, flash_attn: bool, depth: int, threads: int) -> tuple:
    llm = llama_cpp.Llama(model, n_ctx=depth + 80, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          verbose=False, flash_attn=flash_attn)
    ctx = Context(llm, "target")
    started = time.perf_counter()
    ctx.decode([random.Random(0).randrange(1000, 20000) for _ in range(depth)])
    ctx.synchronize()
    return llm, ctx, time.perf_counter() - started


def batch_rounding(ctx, depth: int, rng: random.Random, trials: int = 8) -> float:
    """How far a verification's rounding moves a row: the last row of a batch of 4 against the same token
    evaluated alone after the same 3 (the largest logit difference, median over trials)."""
    differences = []
    for _ in range(trials):
        tokens = [rng.randrange(1000, 20000) for _ in range(4)]
        ctx.keep(depth)
        ctx.decode(tokens, n_logits=4)
        batched = np.array(ctx.logits(3), dtype=np.float64)
        ctx.keep(depth + 3)
        ctx.decode(tokens[3:], n_logits=1)
        differences.append(float(np.abs(batched - np.array(ctx.logits(0), dtype=np.float64)).max()))
    return float(np.median(differences))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Default: the demo pair's target.")
    parser.add_argument("--depth", type=int, default=1500)
    parser.add_argument("--sizes", default="1,2,4,8,16,32")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        import agent_bench
        args.model = str(agent_bench.demo_pair()[0])
    sizes = [int(n) for n in args.sizes.split(",")]
    contexts = {fa: filled_context(args.model, fa, args.depth, args.threads) for fa in (True, False)}
    least: dict[tuple[int, bool], float] = {}
    rng = random.Random(1)
    for _ in range(args.repeat):
        for n in sizes:
            for fa, (_, ctx, _) in contexts.items():
                ctx.keep(args.depth)
                tokens = [rng.randrange(1000, 20000) for _ in range(n)]
                started = time.perf_counter()
                ctx.decode(tokens, n_logits=n)
                ctx.synchronize()
                seconds = time.perf_counter() - started
                least[n, fa] = min(seconds, least.get((n, fa), seconds))
    rounding = {fa: batch_rounding(ctx, args.depth, rng) for fa, (_, ctx, _) in contexts.items()}
    print(f"{Path(args.model).name}, depth {args.depth}, {args.threads} threads; prefill of the depth: "
          f"{contexts[True][2]:.2f} s with flash attention, {contexts[False][2]:.2f} s without")
    print("| n | flash attention on, ms | off, ms | on / off |\n|---:|---:|---:|---:|")
    for n in sizes:
        print(f"| {n} | {1e3 * least[n, True]:.1f} | {1e3 * least[n, False]:.1f} | {least[n, True] / least[n, False]:.2f} |")
    print(f"batch rounding (a batch of 4's last row against the same token alone, largest logit difference, "
          f"median of 8): {rounding[True]:.4f} with flash attention, {rounding[False]:.4f} without")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "depth": args.depth, "threads": args.threads,
            "batch_rounding": {"on": rounding[True], "off": rounding[False]},
            "prefill_s": {"on": contexts[True][2], "off": contexts[False][2]},
            "batch_s": {str(n): {"on": least[n, True], "off": least[n, False]} for n in sizes}}, indent=1))


if __name__ == "__main__":
    main()
