"""An enum written as a tree (ggufspec/gbnftrie.py) allows, at every position, exactly the tokens the flat
enum llama.cpp's converter writes allows, checked by llama.cpp's own grammar sampler on the tiny
vocabulary; and its first position no longer costs a check per value."""
import json
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ggufspec.gbnftrie import MAX_NESTING
from ggufspec.grammar import Grammar
from ggufspec.schemafollow import BoundedConverter, grammar_for

EOS = 2  # the tiny vocabulary's </s>: the grammar allows it where a value is complete


def flat_enum(values) -> str:
    """The enum as llama.cpp's converter writes it: one alternative per value."""
    literal = BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)._format_literal
    return "root ::= " + " | ".join(literal(json.dumps(value)) for value in values) + "\n"


def grammar(vocab, text: str) -> Grammar:
    return Grammar(vocab, SimpleNamespace(grammar=text, grammar_root="root", grammar_patterns=(),
                                          grammar_trigger_tokens=()))


def random_words(rng: random.Random, n: int) -> list[str]:
    """Words over a small alphabet, so that many share beginnings (and some are others' prefixes)."""
    return ["".join(rng.choice("ab-\"\\é") for _ in range(rng.randint(0, 6))) for _ in range(n)]


ENUMS = {
    "shared prefixes": ["alpha-1", "alpha-2", "alpha-10", "beta", "alp"],
    "numbers and others": [1, 12, 123, -1, 1.5, True, False, None, "1"],
    "duplicates": ["x", "x", "xy", 3, 3],
    "quotes, backslashes, unicode": ['a"b', "a\\b", "a\\\\", "é", "éa", "\n", ""],
    f"deeper than {MAX_NESTING}": ["a" * i for i in range(1, 3 * MAX_NESTING)],
    "random": random_words(random.Random(0), 300),
}


def walk(vocab, tree: Grammar, flat: Grammar, rng: random.Random, n_vocab: int) -> bytes:
    """One random walk, the two grammars' masks compared at every position; the text walked."""
    ids, text = np.arange(n_vocab), b""
    while True:
        allowed = tree.allows(ids, np.zeros(n_vocab, np.float32))
        assert (allowed == flat.allows(ids, np.zeros(n_vocab, np.float32))).all(), text
        choices = np.flatnonzero(allowed)
        if len(choices) == 0:
            return text
        token = int(rng.choice(list(choices)))
        if token == EOS:
            return text
        tree.accept(token), flat.accept(token)
        text += tree._piece(token)


@pytest.mark.parametrize("name", ENUMS)
def test_an_enum_as_a_tree_allows_exactly_what_the_flat_enum_allows(tiny_vocab, plain_target, name):
    values = ENUMS[name]
    texts = {json.dumps(value).encode() for value in values}
    tree_text = grammar_for({"enum": values})
    rng = random.Random(1)
    walked = set()
    for _ in range(60):
        tree, flat = grammar(tiny_vocab, tree_text), grammar(tiny_vocab, flat_enum(values))
        try:
            text = walk(tiny_vocab, tree, flat, rng, plain_target.n_vocab())
        finally:
            tree.close(), flat.close()
        assert text in texts
        walked.add(text)
    assert len(walked) > min(5, len(texts) - 1)


def test_shared_beginnings_are_written_once():
    assert grammar_for({"enum": ["alpha-1", "alpha-2", "beta"]}).splitlines()[0] == \
        'root ::= "\\"" ("alpha-" ("1\\"" | "2\\"") | "beta\\"")'
    assert grammar_for({"anyOf": [{"const": "on"}, {"const": "off"}, {"enum": [1]}]}).splitlines()[0] == \
        'root ::= ("\\"o" ("n\\"" | "ff\\"") | "1")'
    assert grammar_for({"enum": ["x"]}).splitlines()[0] == 'root ::= "\\"x\\""'


def first_mask_seconds(vocab, text: str, n_vocab: int) -> float:
    best = float("inf")
    for _ in range(3):
        g = grammar(vocab, text)
        start = time.perf_counter()
        g.allows(np.arange(n_vocab), np.zeros(n_vocab, np.float32))
        best = min(best, time.perf_counter() - start)
        g.close()
    return best


def test_a_large_enums_first_position_costs_far_less_than_a_check_per_value(tiny_vocab, plain_target):
    """2,000 values: the flat enum is 2,000 stacks at its first position, the tree one (the quote they share)."""
    values = [f"item-{i:04d}" for i in range(2000)]
    n_vocab = plain_target.n_vocab()
    flat = first_mask_seconds(tiny_vocab, flat_enum(values), n_vocab)
    tree = first_mask_seconds(tiny_vocab, grammar_for({"enum": values}), n_vocab)
    assert tree < flat / 5, (tree, flat)
