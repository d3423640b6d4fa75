"""Speculation on a recurrent (Mamba) target: --no-draft vs --draft K vs auto, interleaved, with the
target tokens each evaluated (rollback restores a saved state and re-evaluates only kept tokens).

    .venv/bin/python benchmarks/memory_bench.py [--tokens 256] [--rounds 5] [--n-embd 256 --layers 8]

The models are written at run time with the `gguf` package (tests/tinymodels.py: a Mamba target and
its first 2 layers as the draft). Each round runs every configuration once on a fresh cache
(A B C, then C B A, ...); the best round of each is reported (interference only adds time), and the
median. tok/s counts generated tokens over decode time (the prompt is evaluated before).
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp  # noqa: F401  (before numpy, see ggufspec/__init__.py)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from ggufspec import SpeculativeDecoder  # noqa: E402
from tinymodels import make_mamba_pair  # noqa: E402


def run_one(dec, prompt, n, draft):
    for ctx in (dec.target, dec.draft):
        ctx.keep(0)
    before = dec.target.n_evaluated, dec.target.n_replayed
    kwargs = dict(use_draft=False) if draft == "none" else dict(n_draft=draft)
    t0 = time.perf_counter()
    out = dec.generate(prompt, n_predict=n, temperature=0, **kwargs)
    seconds = out.stats.decode_seconds or (time.perf_counter() - t0)
    return dict(tps=len(out.tokens) / seconds, tokens=len(out.tokens),
                evaluated=dec.target.n_evaluated - before[0], replayed=dec.target.n_replayed - before[1],
                drafted=out.stats.n_drafted, accepted=out.stats.n_accept)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft", default="3", help="comma-separated K values")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    configs = ["none"] + [int(k) for k in args.draft.split(",")] + ["auto"]
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = make_mamba_pair(Path(tmp), n_layer=args.layers, n_embd=args.n_embd, eos_bias=None)
        prompt = [1, 260, 261, 262, 263, 264, 265, 266]
        with SpeculativeDecoder(target, draft, n_ctx=args.tokens + 64, n_threads=args.threads) as dec:
            run_one(dec, prompt, 16, 3)  # warm up graphs; auto measures its costs on first use
            run_one(dec, prompt, 16, "auto")
            results = {c: [] for c in configs}
            for r in range(args.rounds):
                for c in (configs if r % 2 == 0 else configs[::-1]):
                    results[c].append(run_one(dec, prompt, args.tokens, c))
            costs = dec.costs.get("model")
    base = max(x["tps"] for x in results["none"])
    print(f"Mamba target {args.layers} layers x {args.n_embd}, draft its first 2 layers; {args.tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} threads")
    print("| config | tok/s (best) | tok/s (median) | vs target alone | target tokens evaluated | "
          "re-evaluated after restore | accepted / drafted |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        runs = results[c]
        best = max(runs, key=lambda x: x["tps"])
        name = {"none": "--no-draft", "auto": "--draft auto"}.get(c, f"--draft {c}")
        print(f"| {name} | {best['tps']:.0f} | {statistics.median(x['tps'] for x in runs):.0f} | "
              f"{best['tps'] / base:.2f}x | {best['evaluated']} | {best['replayed']} | "
              f"{best['accepted']} / {best['drafted']} |")
    if costs is not None:
        print("auto's costs:", costs.summary())


if __name__ == "__main__":
    main()
