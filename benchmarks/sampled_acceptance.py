"""How many drafts sampling keeps: the position-tied draw (`sampling.Draws`) against the rejection rule.

Runs the demo pair over held-out chat prompts at several temperatures and seeds, with the draft model
at a fixed K and with n-gram drafts, and prints drafted / kept per condition as JSON lines. Run it
once with this checkout and once with an older one on PYTHONPATH to compare the rules side by side:

    PYTHONPATH=. python benchmarks/sampled_acceptance.py --label draws > new.jsonl
    PYTHONPATH=/path/to/old/checkout python benchmarks/sampled_acceptance.py --label rejection > old.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ggufspec import SpeculativeDecoder, store

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--prompts", default=str(HERE / "held-out-prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("-k", "--draft", type=int, default=3)
    parser.add_argument("-n", "--n-predict", type=int, default=64)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    target, draft = store.demo_pair_paths(progress=False)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.limit]
    with SpeculativeDecoder(target, draft, n_ctx=2048, n_threads=args.threads) as decoder:
        for row in rows:
            prompt = decoder.render_chat(([{"role": "system", "content": row["system"]}] if row.get("system") else [])
                                         + [{"role": "user", "content": row["prompt"]}])
            for temperature in map(float, args.temperatures.split(",")):
                for drafter in ("model", "lookup"):
                    drafted = kept = 0
                    for seed in map(int, args.seeds.split(",")):
                        out = decoder.generate(prompt, n_predict=args.n_predict, n_draft=args.draft, drafter=drafter,
                                               temperature=temperature, seed=seed)
                        drafted += out.stats.n_drafted
                        kept += out.stats.n_accept
                    print(json.dumps({"rule": args.label, "prompt": row["id"], "temperature": temperature,
                                      "drafter": drafter, "drafted": drafted, "kept": kept}), flush=True)


if __name__ == "__main__":
    main()
