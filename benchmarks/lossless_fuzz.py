"""A differential fuzz of the lossless promise: random prompts, samplers, constraints and drafters on the tiny
models of five architectures, each answer with drafts (alone, or several in the slots at once) against the same
request with none (the target alone), under `strict` (no batch rounding: any difference is a bug). Round 31's audit found a segfault (DRY with a lazy
grammar rejected after its trigger) and a slots DecodeError (a draft shorter than draft_min) this way; neither
changed a text, both ended a generation.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lossless_fuzz.py [--trials 200] [--seed 0] [--archs llama,mamba]

Prints each violation as a JSON line (tokens, text, stop reason, log-probabilities, or a repeat that differs;
an error in one run and not the other), then a summary; exits 1 where there was one.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from ggufspec import SpeculativeDecoder
from ggufspec.processing import Constraints
from ggufspec.tinymodels import Shape, make_gemma2_pair, make_lfm2_pair, make_mamba_pair, make_moe_pair, make_pair
from ggufspec.tools import schema_grammar

PAIRS = {"llama": lambda d: make_pair(d, seed=0, shape=Shape(eos_bias=2.0)), "mamba": lambda d: make_mamba_pair(d),
         "gemma2": lambda d: make_gemma2_pair(d, window=16), "lfm2": lambda d: make_lfm2_pair(d),
         "moe": lambda d: make_moe_pair(d)}
GRAMMARS = ['root ::= pair+\npair ::= (" the" | " a") (" cat" | " dog" | " mat")\n', 'root ::= [a-z ]+\n',
            'root ::= (" the" | " cat" | " sat" | " on" | " mat")+ " ."\n']
SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
            "required": ["a"]}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
           {"type": "object", "properties": {"pet": {"enum": ["the cat", "the dog", "a cat", 1, 12, None]}},
            "required": ["pet"]}]  # an enum's tree (gbnftrie)
WORDS = range(259, 281)  # the tiny vocabulary's words (tinymodels.WORDS)


def maybe(rng: random.Random, chance: float, **choices) -> dict:
    """With probability `chance`, each option at one of its values."""
    return {name: rng.choice(values) for name, values in choices.items()} if rng.random() < chance else {}


def sampling(rng: random.Random) -> dict:
    options = {"temperature": rng.choice([0, 0, 0.5, 0.8, 1.5, 3.0]), "seed": rng.randrange(10 ** 6),
               **maybe(rng, 0.4, top_k=[0, 1, 5, 40]), **maybe(rng, 0.4, top_p=[0.5, 0.9]),
               **maybe(rng, 0.4, min_p=[0.05, 0.2]), **maybe(rng, 0.2, typical_p=[0.5, 0.9]),
               **maybe(rng, 0.2, top_n_sigma=[0.5, 2.0]), **maybe(rng, 0.1, min_keep=[1, 3]),
               **maybe(rng, 0.2, dynatemp_range=[0.3, 0.8], dynatemp_exponent=[0.5, 2.0]),
               **maybe(rng, 0.15, mirostat=[1, 2], mirostat_tau=[3.0, 5.0], mirostat_eta=[0.1, 0.5]),
               **maybe(rng, 0.15, logprobs=[0, 3])}
    if rng.random() < 0.2:
        options.update(maybe(rng, 1.0, xtc_probability=[0.3, 1.0], xtc_threshold=[0.05, 0.3]))
    elif rng.random() < 0.1:
        options.update(maybe(rng, 1.0, adaptive_target=[0.1, 0.7], adaptive_decay=[0.5, 0.9]))
    constraints = constraint_options(rng)
    return {**options, "constraints": Constraints(**constraints)} if constraints else options


def constraint_options(rng: random.Random) -> dict:
    found = {**maybe(rng, 0.3, repeat_penalty=[0.8, 1.5], repeat_last_n=[-1, 4, 64]),
             **maybe(rng, 0.3, presence_penalty=[0.5, -0.5], frequency_penalty=[0.5, 1.0]),
             **maybe(rng, 0.25, dry_multiplier=[0.5, 3.0], dry_base=[1.5, 3.0], dry_allowed_length=[1, 3],
                     dry_penalty_last_n=[-1, 8, 64]), **maybe(rng, 0.2, ignore_eos=[True])}
    if rng.random() < 0.3:
        found["logit_bias"] = {rng.choice(WORDS): rng.choice([-100.0, 2.0, 5.0]) for _ in range(rng.randint(1, 3))}
    chance = rng.random()
    if chance < 0.12:
        found["grammar"] = rng.choice(GRAMMARS)
    elif chance < 0.2:
        found["grammar"] = schema_grammar(rng.choice(SCHEMAS))
    if "grammar" in found and rng.random() < 0.4:  # lazy: from a word on (one the grammar may reject)
        found["grammar_trigger_tokens"] = (rng.choice(WORDS),)
    return found


def drafting(rng: random.Random) -> dict:
    k = rng.choice([1, 2, 3, 5, 8, "auto"])
    return {"n_draft": k, "drafter": rng.choice(["model", "model", "lookup", "hybrid"]),
            **maybe(rng, 0.2, draft_p_min=[0.3, 0.8]), **maybe(rng, 0.1, draft_min=[1, 2]),
            **(maybe(rng, 0.5, draft_max=[2, 8, 16]) if k == "auto" else {})}


def prompt(rng: random.Random) -> list[int]:
    n = rng.randint(1, 20)
    if rng.random() < 0.3:  # repetitive: n-gram drafts
        return [1] + ([rng.choice(WORDS) for _ in range(rng.randint(2, 5))] * 8)[:n + 8]
    return [1] + [rng.choice(WORDS) for _ in range(n)]


def answer(decoder, tokens: list[int], **options):
    """What a run gives back, or the error it ended with."""
    try:
        pieces = list(decoder.stream(tokens, **options))
    except Exception as exc:  # noqa: BLE001  (an error is an answer to compare too)
        return ("error", type(exc).__name__)
    return ([p.token for p in pieces], "".join(p.text for p in pieces), decoder.last_stats.stop_reason,
            [p.logprob for p in pieces] if options.get("logprobs") is not None else None)


def many(decoder, prompts: list[list[int]], **options) -> list:
    """generate_many's answers in the slots (as `answer` gives them), or the error it ended with."""
    try:
        return [(g.tokens, g.text, g.stats.stop_reason) for g in decoder.generate_many(prompts, **options)]
    except Exception as exc:  # noqa: BLE001
        return [("error", type(exc).__name__)]


def trial(rng: random.Random, decoders: dict) -> dict | None:
    """One request with drafts and without (and again with, now and then), or a few in the slots at once
    against each alone: the violation, if any."""
    (arch, n_ctx, slots), decoder = rng.choice(sorted(decoders.items(), key=lambda item: item[0]))
    options, drafts = {"n_predict": rng.choice([-1, 1, 8, 32, 64]), **sampling(rng)}, drafting(rng)
    if slots:
        options.pop("logprobs", None)
        prompts = [prompt(rng) for _ in range(rng.randint(2, 4))]
        alone = [answer(decoder, tokens, n_draft=0, **options)[:3] for tokens in prompts]
        drafted = again = many(decoder, prompts, **drafts, **options)
        if drafted[0][0] == "error" and drafted[0] in alone:  # the slots end at the first prompt's error
            drafted = again = alone
    else:
        prompts = prompt(rng)
        alone, drafted = answer(decoder, prompts, n_draft=0, **options), answer(decoder, prompts, **drafts, **options)
        again = answer(decoder, prompts, **drafts, **options) if rng.random() < 0.3 else drafted
    if alone == drafted == again:
        return None
    shown = {k: (repr(v) if k == "constraints" else v) for k, v in options.items()}
    return {"arch": arch, "n_ctx": n_ctx, "slots": slots, "prompt": prompts, "options": shown, "drafts": drafts,
            "alone": alone, "drafted": drafted, "again": again if again is not drafted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--archs", default=",".join(PAIRS))
    args = parser.parse_args()
    rng, found = random.Random(args.seed), 0
    with tempfile.TemporaryDirectory() as folder:
        decoders = {}
        for arch in args.archs.split(","):
            (Path(folder) / arch).mkdir()
            target, draft = PAIRS[arch](Path(folder) / arch)
            for n_ctx, slots in ((48, 1), (256, 1), (256, 3)):  # 48: many answers meet the context's end
                decoders[(arch, n_ctx, slots > 1)] = SpeculativeDecoder(target, draft, n_ctx=n_ctx, n_threads=1,
                                                                        strict=True, n_parallel=slots)
        for _ in range(args.trials):
            violation = trial(rng, decoders)
            if violation is not None:
                found += 1
                print(json.dumps(violation, default=str), flush=True)
        for decoder in decoders.values():
            decoder.close()
    print(f"{args.trials} trials, {found} violations", file=sys.stderr)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
