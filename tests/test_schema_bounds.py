"""Integer bounds in JSON schemas, followed by the grammar (schemaints.int_range_rule, ported from
llama.cpp's build_min_max_int): the rule matches exactly the integers in range, written as JSON writes
them (no leading zeros), checked against every integer in a window around the bounds; and a
served answer under such a schema is one of them. A number's bounds, whole or not (0.5, -273.15), as
plain decimals: exactly those within them, checked around each bound. Lengths and item counts of any size, written as
llama.cpp's parser takes them (schemafollow.repetition): exactly the counts in range, and a server
given an agent's write_file tool (maxLength 100,000) answers instead of overflowing its stack."""
import json
import re

import pytest

from ggufspec.schemafollow import repetition
from ggufspec.schemaints import INT64_MAX, INT64_MIN, int_range_rule


def as_regex(rule: str) -> re.Pattern:
    """The rule's GBNF (quoted literals, [classes], {m,n}, groups, |) as a Python regex."""
    pieces = re.findall(r'"[^"]*"|\[[^\]]*\]|\{[0-9,]*\}|[()|?*+]|\s+', rule)
    assert "".join(pieces) == rule, rule  # nothing else in it
    regex = "".join(re.escape(p[1:-1]) if p.startswith('"') else "(?:" if p == "(" else "" if p.isspace() else p
                    for p in pieces)
    return re.compile(regex)


BOUNDS = [(5, 9), (0, 0), (-9, -1), (-15, 250), (17, 1000), (-120, -15), (1, 99), (100, 100), (0, 1000),
          (10, 17), (-1, 0), (99, 101), (7, INT64_MAX), (0, INT64_MAX), (-35, INT64_MAX), (120, INT64_MAX),
          (INT64_MIN, 0), (INT64_MIN, 42), (INT64_MIN, -7), (INT64_MIN, 305),
          # a first digit followed by zeros (the rule for a minimum of 100 took 10)
          (100, INT64_MAX), (1000, INT64_MAX), (2000, INT64_MAX), (1001, INT64_MAX), (105, INT64_MAX),
          (INT64_MIN, -100), (INT64_MIN, -1000), (-100, INT64_MAX)]


@pytest.mark.parametrize("least, most", BOUNDS)
def test_the_rule_matches_exactly_the_integers_in_range(least, most):
    pattern = as_regex(int_range_rule(least, most))
    for n in range(-1200, 1201):
        assert bool(pattern.fullmatch(str(n))) == (least <= n <= most), (least, most, n)
    for text in ("05", "00", "-05", "+5", "5.0", "007"):
        assert not pattern.fullmatch(text), (least, most, text)
    assert not pattern.fullmatch("-0") or least <= 0 <= most  # JSON's -0 is 0 (llama.cpp's rule allows it)


NUMBER_BOUNDS = [{"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0}, {"minimum": 0}, {"maximum": 0},
                 {"exclusiveMaximum": 0}, {"minimum": -5, "exclusiveMaximum": -2}, {"exclusiveMinimum": -3, "maximum": 7},
                 {"minimum": 3, "maximum": 3}, {"minimum": -1, "maximum": 1, "exclusiveMaximum": 1},
                 {"minimum": 2.0, "exclusiveMinimum": 2, "maximum": 10}]


@pytest.mark.parametrize("bounds", NUMBER_BOUNDS)
def test_a_number_rule_matches_exactly_the_decimals_within_whole_bounds(bounds):
    """pydantic's Field(ge=0, le=1) on a float: a plain decimal matches where its value is within the
    bounds (every bound, the tighter of two on one side), for integer parts around them and fractions
    that are zero, nonzero, or nearly the next integer."""
    from decimal import Decimal
    from operator import ge, gt, le, lt
    from ggufspec.schemaints import number_range, number_range_rule
    pattern = as_regex(number_range_rule(*number_range(bounds, "#")))
    checks = {"minimum": ge, "maximum": le, "exclusiveMinimum": gt, "exclusiveMaximum": lt}
    for whole in range(-12, 13):
        for fraction in ("", ".0", ".00", ".5", ".05", ".999", ".10", "." + "0" * 15 + "1", "." + "9" * 16):
            text = f"{whole}{fraction}"
            for shown in ([text, "-" + text] if whole == 0 else [text]):
                if Decimal(shown) == 0 and shown.startswith("-"):
                    continue  # -0: the rule writes 0
                within = all(checks[key](Decimal(shown), Decimal(value)) for key, value in bounds.items())
                assert bool(pattern.fullmatch(shown)) == within, (bounds, shown)
    assert not pattern.fullmatch("0." + "1" * 17) and not pattern.fullmatch("1." + "0" * 17)  # 16 digits at most


FRACTIONAL_BOUNDS = [{"minimum": 0.5}, {"maximum": -273.15}, {"exclusiveMinimum": 0.1}, {"maximum": 99.99},
                     {"minimum": 1e-3}, {"exclusiveMinimum": 1e-3, "maximum": 1}, {"minimum": -0.5, "maximum": 0.5},
                     {"exclusiveMinimum": -0.5, "exclusiveMaximum": 0.5}, {"minimum": 2.5, "maximum": 2.75},
                     {"exclusiveMinimum": 2.5, "exclusiveMaximum": 2.75}, {"minimum": 2.5, "maximum": 2.5},
                     {"minimum": -2.75, "exclusiveMaximum": -2.5}, {"minimum": 0.05, "exclusiveMaximum": 0.5},
                     {"exclusiveMaximum": -0.001}, {"minimum": 0.0999, "maximum": 0.1},
                     {"exclusiveMinimum": 0.9999999999999999}, {"minimum": -1.5, "exclusiveMaximum": 12.25, "maximum": 13},
                     {"minimum": 0.5, "exclusiveMinimum": 0.5}, {"exclusiveMinimum": -1e-16},
                     {"exclusiveMinimum": -1e-16, "exclusiveMaximum": 1e-16}, {"minimum": -1e-20, "maximum": 3},
                     {"minimum": 0.0000000000000001, "maximum": 0.9999999999999999}]


def near(value: float) -> set[str]:
    """Plain decimals around a bound: it, written with trailing zeros too; 1 off in its last place and in
    the places before (to 16 decimals); and integer parts either side."""
    from decimal import Decimal
    bound, texts = Decimal(repr(value)), set()
    for step in ("1e-16", "1e-5", "1e-4", "1e-3", "1e-2", "1e-1", "0.5", "1", "2"):
        for moved in (bound, bound + Decimal(step), bound - Decimal(step), bound.to_integral_value() + Decimal(step)):
            text = format(moved.normalize(), "f")
            texts |= {text, *(text + zeros if "." in text else f"{text}.{zeros}" for zeros in ("0", "00"))}
    return {t for t in texts if len(t.partition(".")[2]) <= 16 and t.lstrip("-") not in ("0", "0.0", "0.00")} | {"0"}


@pytest.mark.parametrize("bounds", FRACTIONAL_BOUNDS)
def test_a_number_rule_matches_exactly_the_decimals_within_any_bounds(bounds):
    """minimum 0.5, maximum -273.15, exclusiveMinimum 0.1: the integer parts between the bounds' take any
    fraction, a bound's own the fractions on its side, compared as decimals (.5 = .50 < .51); around
    every bound, a plain decimal matches exactly where its value is within them all."""
    from decimal import Decimal
    from operator import ge, gt, le, lt
    from ggufspec.schemaints import number_range, number_range_rule
    rule = number_range_rule(*number_range(bounds, "#"))
    pattern, checks = as_regex(rule), {"minimum": ge, "maximum": le, "exclusiveMinimum": gt, "exclusiveMaximum": lt}
    assert len(rule) < 2000, rule
    for text in set().union(*map(near, bounds.values())) | {"-0.5", "5", "-5", "12.5", "-1"}:
        within = all(checks[key](Decimal(text), Decimal(repr(value))) for key, value in bounds.items())
        assert bool(pattern.fullmatch(text)) == within, (bounds, text)
    for text in ("-0", "-0.0", "00.5", "0.5e1", ".5", "1.", "0." + "1" * 17, "2." + "5" * 17, "+1"):
        assert not pattern.fullmatch(text), (bounds, text)  # -0 is written 0; 16 decimals at most


def test_a_bound_of_more_than_16_decimals_is_rounded_inwards_exactly():
    """The rule writes 16 decimals at most: gt=1e-20 lets the same ones through as ge=1e-16, and bounds with
    none of them between are refused with the place."""
    from ggufspec.errors import ToolError
    from ggufspec.schemaints import number_range, number_range_rule
    bounds = number_range({"exclusiveMinimum": 1e-20, "maximum": 0.12345678901234567}, "#")
    pattern = as_regex(number_range_rule(*bounds))
    for text, within in (("0", False), ("0.0000000000000001", True), ("0.1234567890123456", True),
                         ("0.1234567890123457", False), ("0.1", True)):
        assert bool(pattern.fullmatch(text)) == within, text
    with pytest.raises(ToolError, match=r"at #/a leave no number of at most 16 decimals \(from 0.0000000000000001 to 0\)"):
        number_range({"minimum": 1e-20, "maximum": 2e-20}, "#/a")
    with pytest.raises(ToolError, match=r"leave no number of at most 16 decimals \(from 0.9999999999999999 to 1\)"):
        number_range({"exclusiveMinimum": 0.9999999999999999, "exclusiveMaximum": 1}, "#/a")


def whole_sampled_answers(decoder, grammar: str) -> list[str]:
    """Eight sampled answers under the grammar (drafted, K = 3), those that ended by themselves."""
    from ggufspec.processing import Constraints
    answers = (decoder.generate("the", n_predict=100, n_draft=3, temperature=1.0, seed=seed,
                                constraints=Constraints(grammar=grammar)) for seed in range(8))
    return [out.text for out in answers if out.stats.stop_reason == "eos"]


def test_a_served_number_is_within_its_bounds_and_greedy_is_the_target_alones(tiny_pair):
    """Sampled through llama.cpp's grammar sampler: every whole answer's numbers are within [0, 1] and
    (-3, 7]; greedy under the grammar, the drafts change nothing."""
    from ggufspec import SpeculativeDecoder
    from ggufspec.processing import Constraints
    from ggufspec.tools import schema_grammar
    target, draft = tiny_pair
    grammar = schema_grammar({"type": "object", "required": ["p", "t"], "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1}, "t": {"type": "number", "exclusiveMinimum": -3,
                                                                   "maximum": 7}}})
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1, strict=True) as decoder:
        answers = whole_sampled_answers(decoder, grammar)
        for text in answers:
            value = json.loads(text)
            assert 0 <= value["p"] <= 1 and -3 < value["t"] <= 7, text
        assert answers
        alone = decoder.generate("a cat", n_predict=48, n_draft=0, constraints=Constraints(grammar=grammar))
        assert decoder.generate("a cat", n_predict=48, n_draft=3, constraints=Constraints(grammar=grammar)).tokens \
            == alone.tokens


def test_a_served_number_is_within_bounds_that_are_not_whole(tiny_pair):
    """response_format's {"minimum": 0.5, "maximum": 2.75} (once a 400), through llama.cpp's grammar sampler."""
    from decimal import Decimal
    from ggufspec import SpeculativeDecoder
    from ggufspec.tools import schema_grammar
    target, draft = tiny_pair
    grammar = schema_grammar({"type": "object", "required": ["x"], "properties": {
        "x": {"type": "number", "minimum": 0.5, "maximum": 2.75}}})
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1, strict=True) as decoder:
        answers = whole_sampled_answers(decoder, grammar)
        for text in answers:
            assert Decimal("0.5") <= json.loads(text, parse_float=Decimal)["x"] <= Decimal("2.75"), text
        assert answers


def test_a_number_bound_past_int64_or_not_a_number_is_still_refused():
    from ggufspec.errors import ToolError
    from ggufspec.tools import schema_grammar
    with pytest.raises(ToolError, match="'maximum' at #/properties/p cannot be enforced"):
        schema_grammar({"type": "object", "properties": {"p": {"type": "number", "minimum": 0.5, "maximum": 1e300}}})
    with pytest.raises(ToolError, match="'minimum' at # cannot be enforced.*below 2\\*\\*63"):
        schema_grammar({"type": "number", "minimum": "0.5"})
    with pytest.raises(ToolError, match="bounds at # leave no number"):
        schema_grammar({"type": "number", "minimum": 3, "exclusiveMaximum": 3})


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


@pytest.mark.parametrize("least, most", [(0, 3), (2, 2), (0, 2000), (0, 2001), (1999, 2001), (0, 4999),
                                         (2500, 2500), (1000, 3000), (3, None), (2003, None), (0, 20000)])
def test_a_repetition_matches_exactly_the_counts_in_range(least, most):
    rule = repetition('"a"', least, most)
    assert "{" not in rule or max(int(n) for n in re.findall(r"\d+", rule)) <= 2000  # what llama.cpp parses
    pattern = as_regex(rule.replace("?", "{0,1}").replace("*", "{0,}"))
    top = (most or least) + 3
    for n in sorted({*range(0, 12), *range(max(0, least - 3), least + 4), *range(max(0, top - 6), top + 1),
                     *range(995, 1006), *range(1995, 2006)}):
        assert bool(pattern.fullmatch("a" * n)) == (least <= n and (most is None or n <= most)), (least, most, n)


def test_a_separated_repetition_counts_items():
    pattern = as_regex(repetition('"a"', 0, 2500, separator_rule='","').replace("?", "{0,1}").replace(" | )", "|)"))
    for n in (0, 1, 2, 1000, 2500, 2501):
        assert bool(pattern.fullmatch(",".join(["a"] * n))) == (n <= 2500), n


@pytest.mark.parametrize("least, most", [(-1, 3), (3, 2), (1.5, 4), (0, True)])
def test_a_bad_bound_is_a_tool_error(least, most):
    from ggufspec.errors import ToolError
    with pytest.raises(ToolError):
        repetition('"a"', least, most)


@pytest.mark.parametrize("schema, says", [
    ({"type": "string", "maxLength": -1}, "maxLength at #/properties/x must be a whole number >= 0, got -1"),
    ({"type": "string", "minLength": 2.5}, "minLength at #/properties/x must be a whole number >= 0, got 2.5"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 and maxLength 2 at #/properties/x leave no"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": "3"}, 'maxItems at #/properties/x must be a whole '
                                                                        'number >= 0, got "3"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 1}, "minItems 4 and maxItems 1 at"),
])
def test_a_bad_length_bound_names_its_place(schema, says):
    from ggufspec.errors import ToolError
    from ggufspec.tools import schema_grammar
    with pytest.raises(ToolError, match=re.escape(says)):
        schema_grammar({"type": "object", "properties": {"x": schema}})


@pytest.mark.parametrize("pattern, least, most, written", [
    ("^[a-z]+$", None, 10, "^[a-z]{1,10}$"), ("^\\d{3,5}$", 4, None, "^\\d{4,5}$"), ("^.*$", 2, 5, "^.{2,5}$"),
    ("^[A-Z]{3}$", 3, 3, "^[A-Z]{3,3}$"), ("^x?$", None, 0, "^x{0,0}$"), ("^[\\]a]{2,}$", None, 4, "^[\\]a]{2,4}$"),
    ("^[a-z]+-\\d+$", None, 5, None), ("^[a-z]{6}$", None, 5, None), ("^a+$", -1, None, None)])
def test_a_pattern_of_one_character_repeated_takes_the_lengths_into_its_count(pattern, least, most, written):
    """pydantic's constr(pattern=..., max_length=...): the converter follows a pattern or the lengths,
    never both (the lengths were refused); a pattern repeating one character counts them instead. Any
    other pattern, counts that leave nothing, or a bad bound: left as they are (refused, with the reason)."""
    from ggufspec.schemapatterns import length_in_pattern
    schema = {"type": "string", "pattern": pattern, **{key: bound for key, bound in (("minLength", least),
                                                                                     ("maxLength", most)) if bound is not None}}
    assert length_in_pattern(schema) == ({"type": "string", "pattern": written} if written else schema)


def test_a_date_is_a_day_of_the_calendar():
    """format "date": every day of 24 years around the turns of two centuries, and nothing else (02-30, 04-31, a
    29 February outside leap years, 1900's included and 2000's not: the converter's rule took them)."""
    import datetime
    from ggufspec.schemafollow import CALENDAR_DATE
    pattern = as_regex(CALENDAR_DATE.content)
    for year in (*range(1896, 1906), *range(1996, 2006), 2100, 2400, 1, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                try:
                    valid = bool(datetime.date(year, month, day))
                except ValueError:
                    valid = False
                text = f"{year:04d}-{month:02d}-{day:02d}"
                assert bool(pattern.fullmatch(text)) == valid, text


def test_a_long_string_is_followed_to_its_exact_length(tiny_pair):
    """A pattern's a{2003,2005} (blocks of 1,000 in the grammar): the answer's string is within it,
    through llama.cpp's own grammar sampler (the tiny model's byte tokens make other characters
    that Python decodes otherwise than the grammar counts them: hence a pattern of one letter)."""
    from ggufspec import SpeculativeDecoder
    from ggufspec.processing import Constraints
    from ggufspec.tools import schema_grammar
    target, _ = tiny_pair
    grammar = schema_grammar({"type": "string", "pattern": "^a{2003,2005}$"})
    with SpeculativeDecoder(target, n_ctx=4096, n_threads=1) as decoder:
        out = decoder.generate("the", n_predict=4000, n_draft=0, temperature=0, constraints=Constraints(grammar=grammar))
    assert out.stats.stop_reason == "eos", out.stats
    assert re.fullmatch("a{2003,2005}", json.loads(out.text)), out.text


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "maxItems": n} for n in (1999, 2000, 2500, 3000, 10000, 10 ** 6)
] + [{"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 10000},
     {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string", "maxLength": 3000},
                                              "maxItems": 5000}}},
     {"type": "string", "minLength": 2000, "maxLength": 10 ** 9}, {"type": "string", "pattern": "^(a{0,3000})?$"},
     {"type": "string", "format": "date"}, {"type": "string", "format": "date-time"},
     {"type": "number", "minimum": 0, "maximum": 1}, {"type": "number", "exclusiveMinimum": -3, "maximum": 7},
     *({"type": "number", **bounds} for bounds in FRACTIONAL_BOUNDS),
     {"type": "number", "exclusiveMinimum": -123456789.125, "exclusiveMaximum": 1e-20},
     {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3000},
     {"type": "string", "pattern": "[a-z]+"}, {"type": "string", "pattern": "\\d{4}$"},
     {"$defs": {"N": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/N"}}}}},
      "$ref": "#/$defs/N"}])
def test_llama_cpps_own_parser_takes_every_bound(tiny_decoder, schema):
    """Through the grammar sampler that serves them (processing.Grammar): a round maxItems of 2,000 and
    up was once refused, llama.cpp counting an optional group's inner rules against its limit."""
    from ggufspec.processing import Constraints, Grammar
    from ggufspec.tools import schema_grammar
    Grammar(tiny_decoder.target.vocab, Constraints(grammar=schema_grammar(schema)))


@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": 9007199254740993},
                                    {"type": "integer", "maximum": -9007199254740993},
                                    {"type": "integer", "minimum": -9223372036854775808},
                                    {"type": "integer", "minimum": -1e19}, {"type": "integer", "maximum": 1e19}])
def test_bounds_of_16_digits_and_beyond_int64_parse(tiny_decoder, schema):
    """16 digits wrote [0-9]{16,15}, on which llama.cpp's parser took all the memory; a bound past int64
    was an internal error: now a rule that parses, or (past int64) none."""
    from ggufspec.processing import Constraints, Grammar
    from ggufspec.tools import schema_grammar
    grammar = schema_grammar(schema)
    assert "{16,15}" not in grammar
    Grammar(tiny_decoder.target.vocab, Constraints(grammar=grammar))
