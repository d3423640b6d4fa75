"""Tokens/s with a JSON schema (grammar-constrained decoding) and without, the target alone against
speculative decoding (K = 3 and auto), side by side in one run on the demo pair.

    .venv/bin/python benchmarks/json_schema_bench.py -n 128 --repeat 2 -t 1

Each configuration's text is compared with the target alone's under the same constraint (greedy).
"""
import argparse
import json
import time

from ggufspec import SpeculativeDecoder, store
from ggufspec.cli.constraint_options import schema_grammar
from ggufspec.processing import Constraints

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "languages": {"type": "array", "items": {"type": "string"}}, "bio": {"type": "string"}},
          "required": ["name", "age", "languages", "bio"]}
PROMPTS = ["Describe a fictional software engineer as JSON: name, age, languages and a short bio.",
           "Give me a JSON record for a made-up data scientist (name, age, languages, bio)."]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("-t", "--threads", type=int, default=1)
    args = parser.parse_args()
    target, draft = store.demo_pair_paths(progress=False)
    constraints = {"free": None, "json_schema": Constraints(grammar=schema_grammar(json.dumps(SCHEMA), "schema"))}
    with SpeculativeDecoder(str(target), str(draft), n_ctx=2048, n_threads=args.threads) as decoder:
        rows = []
        for label, c in constraints.items():
            for k in (0, 3, "auto"):
                tokens = seconds = drafted = accepted = 0
                same = True
                for prompt in PROMPTS:
                    text = decoder.render_chat([{"role": "user", "content": prompt}])
                    reference = decoder.generate(text, n_predict=args.n, n_draft=0, constraints=c).tokens
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        out = decoder.generate(text, n_predict=args.n, n_draft=k, constraints=c)
                        seconds += time.perf_counter() - t0
                        tokens += len(out.tokens)
                        drafted, accepted = drafted + out.stats.n_drafted, accepted + out.stats.n_accept
                        same &= out.tokens == reference
                rows.append((label, k, tokens / seconds, accepted, drafted, same))
    alone = {label: rate for label, k, rate, *_ in rows if k == 0}
    print("| output | K | tokens/s | vs target alone, same output | accepted / drafted | same text as the target alone |")
    print("|---|---|---:|---:|---:|---|")
    for label, k, rate, accepted, drafted, same in rows:
        print(f"| {label} | {k} | {rate:.2f} | {rate / alone[label]:.2f}x | {accepted} / {drafted} | {'yes' if same else 'no'} |")
    print(f"\njson_schema vs free, target alone: {alone['json_schema'] / alone['free']:.2f}x")


if __name__ == "__main__":
    main()
