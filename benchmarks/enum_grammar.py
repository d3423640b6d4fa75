"""What a JSON enum costs a generation: the enum as llama.cpp's converter writes it (one alternative per value,
`flat`) against ggufspec's tree (`ggufspec/gbnftrie.py`), in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/enum_grammar.py [--sizes 100,1000,5000] [--json out.json]

Two measures, the demo target's vocabulary (151,936 tokens) for both:
- `mask_ms`: llama.cpp's grammar sampler masking the whole vocabulary at each of a value's first positions
  (what a position costs where the best tokens are not allowed, or under sampling without top-k);
- `answer_s`: the demo pair answering a classification prompt with `{"enum": labels}`, greedy and sampled
  (temperature 1, top_k 0, seed 1), seconds an answer (best of 2), and whether flat and tree gave the same text.
"""
import argparse
import json
import random
import time
from types import SimpleNamespace

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

from ggufspec import SpeculativeDecoder
from ggufspec.grammar import Grammar
from ggufspec.processing import Constraints
from ggufspec.schemafollow import BoundedConverter, grammar_for

PROMPT = ("<|im_start|>user\nWhich product category fits 'wireless noise-cancelling headphones'? Answer with one "
          "label.<|im_end|>\n<|im_start|>assistant\n")


def labels(n: int) -> list[str]:
    rng = random.Random(0)
    parts = ["audio", "home", "garden", "kitchen", "sports", "outdoor", "office", "toys", "books", "tools", "beauty",
             "health", "auto", "pets", "music", "video", "games", "baby", "fashion", "travel"]
    out = {"audio/headphones"}
    while len(out) < n:
        out.add(f"{rng.choice(parts)}/{rng.choice(parts)}-{rng.randint(0, 999)}")
    return sorted(out)


def flat(values) -> str:
    literal = BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)._format_literal
    return "root ::= " + " | ".join(literal(json.dumps(v)) for v in values) + "\nspace ::= \" \"?\n"


def mask_ms(vocab, n_vocab: int, text: str, value: str, tokenize) -> list[float]:
    g = Grammar(vocab, SimpleNamespace(grammar=text, grammar_root="root", grammar_patterns=(), grammar_trigger_tokens=()))
    out = []
    for token in tokenize(json.dumps(value))[:4]:
        start = time.perf_counter()
        allowed = g.allows(np.arange(n_vocab), np.zeros(n_vocab, np.float32))
        out.append(round((time.perf_counter() - start) * 1e3, 1))
        assert allowed[token]
        g.accept(token)
    g.close()
    return out


def answer(decoder, text: str, **sampling) -> tuple[float, str]:
    best, out = float("inf"), None
    for _ in range(2):
        start = time.perf_counter()
        out = decoder.generate(PROMPT, n_predict=24, constraints=Constraints(grammar=text), **sampling).text
        best = min(best, time.perf_counter() - start)
    return round(best, 2), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,1000,5000")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from server_bench import demo_pair
    target, draft = demo_pair()
    results = []
    with SpeculativeDecoder(str(target), str(draft), n_ctx=512, n_threads=args.threads) as decoder:
        vocab = llama_cpp.llama_model_get_vocab(decoder.target.llm._model.model)
        n_vocab = decoder.target.llm.n_vocab()

        def tokenize(s):
            return decoder.target.llm.tokenize(s.encode(), add_bos=False, special=False)
        for n in [int(s) for s in args.sizes.split(",")]:
            values = labels(n)
            row = {"values": n}
            for form, text in (("flat", flat(values)), ("tree", grammar_for({"enum": values}))):
                row[f"{form}_mask_ms"] = mask_ms(vocab, n_vocab, text, values[0], tokenize)
                row[f"{form}_greedy_s"], row[f"{form}_greedy"] = answer(decoder, text, temperature=0)
                row[f"{form}_sampled_s"], row[f"{form}_sampled"] = answer(decoder, text, temperature=1.0, top_k=0,
                                                                          top_p=1.0, min_p=0.0, seed=1)
            row["same_text"] = row["flat_greedy"] == row["tree_greedy"] and row["flat_sampled"] == row["tree_sampled"]
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
