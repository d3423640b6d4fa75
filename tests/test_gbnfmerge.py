"""Two grammars as one (ggufspec/gbnfmerge.py: a request's tool calls beside its response format): the rules
renamed apart, and at every position of random walks llama.cpp's own sampler allows exactly what either
grammar alone still allows."""
import random
from types import SimpleNamespace

import numpy as np

from ggufspec import tools as toolkit
from ggufspec.gbnfmerge import either, prefixed
from ggufspec.grammar import Grammar

EOS = 2  # the tiny vocabulary's </s>: a grammar allows it where its text is complete

WRITE = [{"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["n"]}}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 12]}}, "required": ["ok"]}


def grammar(vocab, text: str) -> Grammar:
    return Grammar(vocab, SimpleNamespace(grammar=text, grammar_root="root", grammar_patterns=(),
                                          grammar_trigger_tokens=()))


def test_rules_are_renamed_where_defined_and_used_never_in_literals_classes_counts_or_comments():
    gbnf = ('root ::= space "root space" [a-z]{0,4} item # root here is a comment\n'
            'space ::= " "?\nitem ::= "[" space "]" | [\\]root]\n')
    assert prefixed(gbnf, "p-") == ('p-root ::= p-space "root space" [a-z]{0,4} p-item # root here is a comment\n'
                                    'p-space ::= " "?\np-item ::= "[" p-space "]" | [\\]root]\n')


def test_counts_and_token_references_stay_though_rules_are_named_like_them(tiny_vocab):
    """A schema's property "4" makes a rule named 4: `{0,4}` was renamed `{0,answer-4}` (a review)."""
    gbnf = 'root ::= a{0,4} 4 <think> !<[5]>\n4 ::= "x"\na ::= "y"\nthink ::= "z"\n'
    assert prefixed(gbnf, "p-") == 'p-root ::= p-a{0,4} p-4 <think> !<[5]>\np-4 ::= "x"\np-a ::= "y"\np-think ::= "z"\n'
    schema = {"type": "object", "properties": {"4": {"enum": ["a", "b"]}, "s": {"type": "string", "maxLength": 4}},
              "required": ["4", "s"]}
    fmt = toolkit.detect_format("{{ '<tool_call>' }}")
    grammar(tiny_vocab, either(toolkit.plan_tools(WRITE, "auto", None, fmt).grammar, toolkit.schema_grammar(schema))).close()


def walk(vocab, merged: Grammar, parts: list[Grammar], rng: random.Random, n_vocab: int) -> bytes:
    """One random walk: at every position the merged grammar allows what the parts still alive allow."""
    ids, text, alive = np.arange(n_vocab), b"", [True] * len(parts)
    zeros = np.zeros(n_vocab, np.float32)
    while True:
        allowed = merged.allows(ids, zeros)
        each = [part.allows(ids, zeros) if live else np.zeros(n_vocab, bool) for part, live in zip(parts, alive)]
        assert (allowed == np.logical_or.reduce(each)).all(), text
        choices = np.flatnonzero(allowed)
        if len(choices) == 0:
            return text
        # toward a text's end now and then, so that walks finish
        token = EOS if allowed[EOS] and rng.random() < 0.3 else int(rng.choice(list(choices)))
        if token == EOS:
            return text
        merged.accept(token)
        for i, part in enumerate(parts):
            alive[i] = alive[i] and bool(each[i][token])
            if alive[i]:
                part.accept(token)
        text += merged._piece(token)


def test_either_allows_exactly_what_a_call_or_the_answer_allows(tiny_vocab, plain_target):
    fmt = toolkit.detect_format("{{ '<tool_call>' }}")  # hermes: <tool_call>{"name": ...}</tool_call>
    calls = toolkit.plan_tools(WRITE, "auto", None, fmt).grammar
    answer = toolkit.schema_grammar(ANSWER)
    rng, ends = random.Random(3), set()
    for _ in range(40):
        walked = [grammar(tiny_vocab, text) for text in (either(calls, answer), calls, answer)]
        try:
            text = walk(tiny_vocab, walked[0], walked[1:], rng, plain_target.n_vocab())
        finally:
            for g in walked:
                g.close()
        ends.add(text[:1])
    assert {b"<", b"{"} <= ends  # both kinds of answer were walked
