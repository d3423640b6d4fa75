"""What a verification costs on this machine: T(n), a batch of n tokens at a given depth, with the logits of
its last row only (what llama-bench's prompt tests time) and with every row's (what verifying n - 1 drafts
needs: the output layer runs n times). Ratios to T(1), for `agent_replay.py replay --ratios`.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/verify_cost.py --depth 1000 --json tn-all-logits.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_replay.py replay benchmarks/results/agent-inventory-turns.json \\
        --ratios tn-all-logits.json

Each size is timed `--repeat` times, alternating the two kinds, after a random prompt of `--depth` tokens;
the least time counts (interference only adds time).
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufspec.native import Context  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="The target (default: the demo pair's).")
    parser.add_argument("--depth", type=int, default=1000)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="on")
    parser.add_argument("--json", default=None, help="Write {n: T(n) / T(1)} with every row's logits here.")
    args = parser.parse_args()
    if args.model is None:
        import agent_bench
        args.model = str(agent_bench.demo_pair()[0])
    sizes = [int(n) for n in args.sizes.split(",")]
    llm = llama_cpp.Llama(args.model, n_ctx=args.depth + max(sizes) + 16, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, verbose=False, flash_attn=args.flash_attn == "on")
    ctx, rng = Context(llm, "target"), random.Random(0)
    ctx.decode([rng.randrange(1000, 20000) for _ in range(args.depth)])
    least: dict[tuple[int, str], float] = {}
    for _ in range(args.repeat):
        for n in sizes:
            for kind, n_logits in (("last", 1), ("all", n)):
                ctx.keep(args.depth)
                started = time.perf_counter()
                ctx.decode([rng.randrange(1000, 20000) for _ in range(n)], n_logits=n_logits)
                ctx.synchronize()
                seconds = time.perf_counter() - started
                least[n, kind] = min(seconds, least.get((n, kind), seconds))
    one = least[1, "last"]
    print(f"T(1) = {1e3 * one:.1f} ms at depth {args.depth}, {args.threads} threads ({Path(args.model).name})")
    print("| n | T(n)/T(1), last row's logits | every row's | every row's / last row's |\n|---:|---:|---:|---:|")
    for n in sizes:
        print(f"| {n} | {least[n, 'last'] / one:.2f} | {least[n, 'all'] / one:.2f} | {least[n, 'all'] / least[n, 'last']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): least[n, "all"] / one for n in sizes}))


if __name__ == "__main__":
    main()
