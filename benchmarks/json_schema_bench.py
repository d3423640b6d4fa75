"""Tokens/s with a JSON schema (grammar-constrained decoding) and without, the target alone against
speculative decoding (K = 3 and auto), and with the schema the drafts guided by it or not
(`processing.DraftGuide`), side by side in one run on the demo pair.

    .venv/bin/python benchmarks/json_schema_bench.py -n 128 --repeat 2 -t 1

Configurations are interleaved (each round runs all of them on every prompt, in alternating order).
Each configuration's text is compared with the target alone's under the same constraint (greedy).
"""
import argparse
import contextlib
import json
import time
from collections import defaultdict

from ggufspec import SpeculativeDecoder, store
from ggufspec.cli.constraint_options import schema_grammar
from ggufspec.processing import Constraints, TargetJudge

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "languages": {"type": "array", "items": {"type": "string"}}, "bio": {"type": "string"}},
          "required": ["name", "age", "languages", "bio"]}
PROMPTS = ["Describe a fictional software engineer as JSON: name, age, languages and a short bio.",
           "Give me a JSON record for a made-up data scientist (name, age, languages, bio)."]


@contextlib.contextmanager
def unguided():
    """Drafts as before DraftGuide: the draft model proposes from its own rows, whatever the grammar."""
    original = TargetJudge.draft_guide
    TargetJudge.draft_guide = lambda self: None
    try:
        yield
    finally:
        TargetJudge.draft_guide = original


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("-t", "--threads", type=int, default=1)
    args = parser.parse_args()
    target, draft = store.demo_pair_paths(progress=False)
    constraints = {"free": None, "json_schema": Constraints(grammar=schema_grammar(json.dumps(SCHEMA), "schema"))}
    configs = [(label, k, True) for label in constraints for k in (0, 3, "auto")]
    configs += [("json_schema", 3, False), ("json_schema", "auto", False)]
    totals = defaultdict(lambda: [0, 0.0, 0, 0, True])  # tokens, seconds, drafted, accepted, same text
    with SpeculativeDecoder(str(target), str(draft), n_ctx=2048, n_threads=args.threads) as decoder:
        texts = [decoder.render_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        references = {(label, i): decoder.generate(text, n_predict=args.n, n_draft=0, constraints=c).tokens
                      for label, c in constraints.items() for i, text in enumerate(texts)}
        for round_ in range(args.repeat):
            for config in (configs if round_ % 2 == 0 else configs[::-1]):
                label, k, guided = config
                for i, text in enumerate(texts):
                    decoder.ngram_pool = None  # an empty n-gram pool per run: a repeat would copy the last answer
                    with contextlib.nullcontext() if guided else unguided():
                        t0 = time.perf_counter()
                        out = decoder.generate(text, n_predict=args.n, n_draft=k, constraints=constraints[label])
                        seconds = time.perf_counter() - t0
                    total = totals[config]
                    total[0] += len(out.tokens)
                    total[1] += seconds
                    total[2] += out.stats.n_drafted
                    total[3] += out.stats.n_accept
                    total[4] &= out.tokens == references[(label, i)]
    alone = {label: totals[(label, 0, True)][0] / totals[(label, 0, True)][1] for label in constraints}
    print("| output | K | drafts | tokens/s | vs target alone, same output | accepted / drafted | same text as the target alone |")
    print("|---|---|---|---:|---:|---:|---|")
    for config in configs:
        label, k, guided = config
        tokens, seconds, drafted, accepted, same = totals[config]
        rate = tokens / seconds
        drafts = "-" if k == 0 else "guided" if guided and label != "free" else "unguided" if not guided else "free"
        print(f"| {label} | {k} | {drafts} | {rate:.2f} | {rate / alone[label]:.2f}x | {accepted} / {drafted} | "
              f"{'yes' if same else 'no'} |")
    print(f"\njson_schema vs free, target alone: {alone['json_schema'] / alone['free']:.2f}x")


if __name__ == "__main__":
    main()
