"""How often a sampled draft token is kept: the position's draw (`sampling.Draws`) against the rejection rule.

On the demo pair, over held-out chat prompts: the target writes a continuation; then target and draft
evaluate prompt + continuation in one batch each, which gives p (target) and q (draft) at every
position, filtered as `--temp T` with the default top-k/top-p/min-p. At each position:
  - the rejection rule (keep with min(1, p/q), else resample) keeps a draft token drawn from q with
    probability sum_x min(p(x), q(x)) = 1 - TV(p, q): the most any rule can keep;
  - the position's draw keeps it when the draft's race and the target's race (same E = -log U per
    token) pick the same token: estimated over SEEDS seeds at each position.
The mean over positions is a K=1 acceptance; a step of K keeps the run of agreeing positions.
n-gram proposals are one token with certainty (q a point mass): both rules keep them with
probability p(x), so they are not measured here.

    python benchmarks/sampled_acceptance.py [--limit 6] [--temperatures 0.7,0.8,1.0] [-n 64]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ggufspec import SamplingParams, SpeculativeDecoder, store
from ggufspec.sampling import Draws, distribution

HERE = Path(__file__).parent
SEEDS = 400


def rows_of(decoder, ctx, tokens: list[int], first: int) -> np.ndarray:
    """The context's logits after each of tokens[first - 1:-1]: the distributions at positions first.."""
    ctx.keep(0)
    ctx.decode(tokens[:-1], n_logits=len(tokens) - first)
    return np.array([ctx.logits(i).copy() for i in range(len(tokens) - first)])


def agreement(p: np.ndarray, q: np.ndarray, position: int) -> float:
    """The fraction of seeds whose draws pick the same token from p and from q at this position."""
    return float(np.mean([Draws(seed).pick(p, position) == Draws(seed).pick(q, position) for seed in range(SEEDS)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=str(HERE / "held-out-prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--temperatures", default="0.7,0.8,1.0")
    parser.add_argument("-n", "--n-predict", type=int, default=64)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    target, draft = store.demo_pair_paths(progress=False)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.limit]
    totals: dict[float, list] = {}
    with SpeculativeDecoder(target, draft, n_ctx=2048, n_threads=args.threads) as decoder:
        for row in rows:
            messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
                {"role": "user", "content": row["prompt"]}]
            prompt = decoder.tokenize(decoder.render_chat(messages))
            text = decoder.generate(prompt, n_predict=args.n_predict, n_draft=0, temperature=0.8, seed=1).tokens
            tokens = prompt + text
            p_logits = rows_of(decoder, decoder.target, tokens, len(prompt))
            q_logits = rows_of(decoder, decoder.draft, tokens, len(prompt))
            for temperature in map(float, args.temperatures.split(",")):
                params = SamplingParams(temperature=temperature)
                kept_best = kept_draw = 0.0
                for i, (pl, ql) in enumerate(zip(p_logits, q_logits)):
                    p, q = distribution(pl, params), distribution(ql, params)
                    kept_best += np.minimum(p, q).sum()
                    kept_draw += agreement(p, q, len(prompt) + i)
                n = len(p_logits)
                totals.setdefault(temperature, []).append((kept_best, kept_draw, n))
                print(json.dumps({"prompt": row["id"], "temperature": temperature, "positions": n,
                                  "rejection_rule": round(kept_best / n, 3), "position_draw": round(kept_draw / n, 3)}),
                      flush=True)
    print("| temperature | positions | rejection rule keeps | position's draw keeps | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for temperature, parts in totals.items():
        best, draw, n = (sum(x) for x in zip(*parts))
        print(f"| {temperature} | {n} | {best / n:.3f} | {draw / n:.3f} | {draw / best:.2f} |")


if __name__ == "__main__":
    main()
