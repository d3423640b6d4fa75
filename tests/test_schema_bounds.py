"""Integer bounds in JSON schemas, followed by the grammar (schemafollow.int_range_rule, ported from
llama.cpp's build_min_max_int): the rule matches exactly the integers in range, written as JSON writes
them (no leading zeros), checked against every integer in a window around the bounds; and a
served answer under such a schema is one of them."""
import json
import re

import pytest

from ggufspec.schemafollow import INT64_MAX, INT64_MIN, int_range_rule


def as_regex(rule: str) -> re.Pattern:
    """The rule's GBNF (quoted literals, [classes], {m,n}, groups, |) as a Python regex."""
    pieces = re.findall(r'"[^"]*"|\[[^\]]*\]|\{[0-9,]*\}|[()|]|\s+', rule)
    assert "".join(pieces) == rule, rule  # nothing else in it
    regex = "".join(re.escape(p[1:-1]) if p.startswith('"') else "(?:" if p == "(" else "" if p.isspace() else p
                    for p in pieces)
    return re.compile(regex)


BOUNDS = [(5, 9), (0, 0), (-9, -1), (-15, 250), (17, 1000), (-120, -15), (1, 99), (100, 100), (0, 1000),
          (10, 17), (-1, 0), (99, 101), (7, INT64_MAX), (0, INT64_MAX), (-35, INT64_MAX), (120, INT64_MAX),
          (INT64_MIN, 0), (INT64_MIN, 42), (INT64_MIN, -7), (INT64_MIN, 305)]


@pytest.mark.parametrize("least, most", BOUNDS)
def test_the_rule_matches_exactly_the_integers_in_range(least, most):
    pattern = as_regex(int_range_rule(least, most))
    for n in range(-1200, 1201):
        assert bool(pattern.fullmatch(str(n))) == (least <= n <= most), (least, most, n)
    for text in ("05", "00", "-05", "+5", "5.0", "007"):
        assert not pattern.fullmatch(text), (least, most, text)
    assert not pattern.fullmatch("-0") or least <= 0 <= most  # JSON's -0 is 0 (llama.cpp's rule allows it)


def test_a_served_integer_is_within_its_bounds(tiny_pair):
    from ggufspec import SpeculativeDecoder
    from ggufspec.processing import Constraints
    from ggufspec.tools import schema_grammar
    target, draft = tiny_pair
    grammar = schema_grammar({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5,
                                                                     "maximum": 12}}, "required": ["n"]})
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as decoder:
        for seed in range(6):
            out = decoder.generate("the", n_predict=40, n_draft=3, temperature=1.0, seed=seed,
                                   constraints=Constraints(grammar=grammar))
            if out.stats.stop_reason != "eos":
                continue  # cut off by n_predict: not a whole answer
            assert 5 <= json.loads(out.text)["n"] <= 12, out.text


def test_greedy_under_a_bounded_schema_is_the_target_alones(tiny_pair):
    """Lossless with the new grammar too: the drafts change nothing the target alone would write."""
    from ggufspec import SpeculativeDecoder
    from ggufspec.processing import Constraints
    from ggufspec.tools import schema_grammar
    target, draft = tiny_pair
    grammar = schema_grammar({"type": "array", "items": {"type": "integer", "minimum": -40, "maximum": 250},
                              "minItems": 2, "maxItems": 6})
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1, strict=True) as decoder:
        for prompt in ("the", "a cat", "1 2 3"):
            alone = decoder.generate(prompt, n_predict=48, n_draft=0, constraints=Constraints(grammar=grammar))
            for k in (2, "auto"):
                drafted = decoder.generate(prompt, n_predict=48, n_draft=k, constraints=Constraints(grammar=grammar))
                assert drafted.tokens == alone.tokens, (prompt, k)
