"""ggufspec.tools, family by family, against what an OpenAI client expects of `tool_calls` (arguments a
JSON text it can json.loads) and what llama.cpp's parsers and grammars do: every grammar call_grammar
writes is taken by llama.cpp's parser, and the strings it allows parse back into the same calls
(a small GBNF sampler writes them); calls' arguments are JSON; bad schemas are one-line ToolErrors."""
from __future__ import annotations

import json
import random
import re

import pytest

from ggufspec import tools as toolkit
from ggufspec.tools import ToolCall, ToolError
from test_tools import HERMES, LLAMA3, MISTRAL, parses

FORMATS = [HERMES, LLAMA3, MISTRAL]
# mistral's newer templates, as Devstral's and Small 3.2's write a call
DEVSTRAL = toolkit.detect_format('{{ tools }}[TOOL_CALLS]" + name + "[ARGS]" + arguments')
SMALL_3_2 = toolkit.detect_format("{{ tools }}'[TOOL_CALLS]' + name }}{{- '[CALL_ID]' + id }}{{- '[ARGS]' + arguments")
ALL_FORMATS = FORMATS + [DEVSTRAL, SMALL_3_2]


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "number"}}, "required": ["x", "y"]}
TOOL_SETS = {
    "refs": [tool("move", {"type": "object", "required": ["to"], "$defs": {"point": POINT}, "properties": {
        "to": {"$ref": "#/$defs/point"}, "path": {"type": "array", "items": {"$ref": "#/$defs/point"}}}})],
    "enum_anyof": [tool("e", {"type": "object", "required": ["k", "u"], "properties": {
        "k": {"enum": ["a", 1, None, True, "</tool_call>"]},
        "u": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {"type": "boolean"}}]}}})],
    "closed": [tool("x", {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False})],
    "required_only": [tool("r", {"type": "object", "required": ["a"]})],
    "names": [tool("a.b-c_d"), tool("n" * 64, {"type": "object", "properties": {}})],
    "nested": [tool("w", {"type": "object", "properties": {"o": {"type": "object", "properties": {"l": {
        "type": "array", "items": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}}}}}})],
    "patterns": [tool("p", {"type": "object", "required": ["d", "any"], "properties": {
        "d": {"type": "string", "pattern": "^[^0-9]+$"}, "any": {"type": "string", "pattern": "^a.b$"}}})],
    "free": [tool("now"), tool("get", {"type": "object", "additionalProperties": {"type": "string"}})],
}


# ---------------------------------------------------------------- a GBNF sampler: strings a grammar allows

GBNF_TOKEN = re.compile(r'\s+|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\d*(?:,\d*)?\}|[()|*+?]|[A-Za-z0-9_-]+')
ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}
# what a class may give: letters, digits, JSON's specials, markers' pieces, non-ASCII, control characters
POOL = list('aZfA0123579 "\\{}[]<>/,:.-e') + ["é", "😀", "\n", "\t", "\x01", "\x7f"]


def unescape(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        if text[i] != "\\":
            out.append(text[i])
            i += 1
        elif text[i + 1] in "xu":
            width = 2 if text[i + 1] == "x" else 4
            out.append(chr(int(text[i + 2:i + 2 + width], 16)))
            i += 2 + width
        else:
            out.append(ESCAPES.get(text[i + 1], text[i + 1]))
            i += 2
    return out


def gbnf_rules(grammar: str) -> dict:
    rules = {}
    for line in grammar.splitlines():
        if "::=" in line:
            name, body = line.split("::=", 1)
            tokens = [t for t in GBNF_TOKEN.findall(body) if not t.isspace()]
            rules[name.strip()] = parse_alternatives(tokens, [0])
    return rules


def parse_alternatives(tokens: list[str], at: list[int]):
    options = [parse_sequence(tokens, at)]
    while at[0] < len(tokens) and tokens[at[0]] == "|":
        at[0] += 1
        options.append(parse_sequence(tokens, at))
    return ("alt", options)


def parse_sequence(tokens: list[str], at: list[int]):
    items = []
    while at[0] < len(tokens) and tokens[at[0]] not in "|)":
        token = tokens[at[0]]
        at[0] += 1
        if token == "(":
            item = parse_alternatives(tokens, at)
            at[0] += 1
        else:
            item = ("lit", "".join(unescape(token[1:-1]))) if token[0] == '"' else \
                ("cls", token[1:-1]) if token[0] == "[" else ("ref", token)
        while at[0] < len(tokens) and (tokens[at[0]] in "*+?" or tokens[at[0]][0] == "{"):
            q = tokens[at[0]]
            at[0] += 1
            if q in "*+?":
                least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[q]
            else:
                bounds = q[1:-1].split(",")
                least = int(bounds[0])
                most = least if len(bounds) == 1 else int(bounds[1]) if bounds[1] else None
            item = ("rep", item, least, most)
        items.append(item)
    return ("seq", items)


def in_class(spec: str, ch: str) -> bool:
    negated = spec.startswith("^")
    chars, hit, i = unescape(spec[1:] if negated else spec), False, 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == "-":
            hit, i = hit or chars[i] <= ch <= chars[i + 2], i + 3
        else:
            hit, i = hit or chars[i] == ch, i + 1
    return hit != negated


def sample(rules: dict, rng: random.Random, node=("ref", "root"), depth: int = 0) -> str:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "cls":
        return rng.choice([c for c in POOL if in_class(node[1], c)])
    if kind == "ref":
        return sample(rules, rng, rules[node[1]], depth + 1)
    if kind == "seq":
        return "".join(sample(rules, rng, item, depth) for item in node[1])
    if kind == "alt":
        options = node[1]
        if depth > 12:  # deep enough: head for the end by the option with the fewest references
            options = sorted(options, key=lambda o: str(o).count("'ref'") + str(o).count("'rep'"))[:1]
        return sample(rules, rng, rng.choice(options), depth)
    _, item, least, most = node
    most = least if depth > 12 else least + 3 if most is None else min(most, least + 3)
    return "".join(sample(rules, rng, item, depth + 1) for _ in range(rng.randint(least, most)))


def calls_in(text: str, fmt) -> list[tuple[str, object]]:
    """The calls a grammar's string holds, read with a strict JSON decoder: (name, arguments)."""
    decoder, found, position = json.JSONDecoder(), [], 0
    named = re.compile(r"\[TOOL_CALLS\]([\w.-]+)(?:\[CALL_ID\][a-zA-Z0-9]{9})?\[ARGS\]")
    while (start := text.find("{", position)) >= 0:
        if fmt.named:
            match = named.search(text, position)
            obj, position = decoder.raw_decode(text, match.end())
            found.append((match[1], obj))
            continue
        obj, position = decoder.raw_decode(text, start)
        found.append((obj["name"], obj[fmt.args_key]))
    return found


# ---------------------------------------------------------------- grammars

@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name + f.named)
@pytest.mark.parametrize("key", sorted(TOOL_SETS))
def test_what_a_call_grammar_allows_is_json_and_parses_back(fmt, key):
    """The converter's `char` ([^"\\]) let a raw newline or control character into a string: no JSON,
    so a forced call came back as content (and a structured answer was JSON no client could read)."""
    tools = toolkit.check_tools(TOOL_SETS[key])
    names = frozenset(t["function"]["name"] for t in tools)
    rng = random.Random(key)
    for parallel in (True, False):
        rules = gbnf_rules(toolkit.call_grammar(tools, fmt, parallel=parallel))
        for _ in range(40):
            text = sample(rules, rng)
            expected = calls_in(text, fmt)  # strict JSON: raises on a raw control character
            content, calls = toolkit.parse_calls(text, fmt, names)
            assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == expected, text
            assert parallel or len(calls) == 1


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    {"type": "string", "pattern": "^a.b$"}, {"type": "string", "pattern": "^[^0-9-]+$"},
    {"type": "object", "additionalProperties": {"type": "string"}}])
def test_a_structured_answer_is_json_a_client_can_read(schema):
    rules, rng = gbnf_rules(toolkit.schema_grammar(schema)), random.Random(0)
    for _ in range(60):
        json.loads(sample(rules, rng))


def test_llama_cpp_parses_the_json_string_classes(tiny_vocab):
    for key in sorted(TOOL_SETS):
        for fmt in ALL_FORMATS:
            assert parses(tiny_vocab, toolkit.call_grammar(toolkit.check_tools(TOOL_SETS[key]), fmt)), (key, fmt.name)
    assert parses(tiny_vocab, toolkit.schema_grammar({"type": "string", "pattern": "^[^0-9-]+.$"}))
    assert toolkit.json_strings_only('a ::= "[^x]" | ["\\\\] [^a]') == 'a ::= "[^x]" | ["\\\\] [^"\\\\\\x7F\\x00-\\x1Fa]'


@pytest.mark.parametrize("empty", [{"enum": []}, {"anyOf": []}])
def test_a_property_nothing_can_follow_is_a_tool_error_not_a_grammar_llama_cpp_refuses(empty):
    tools = toolkit.check_tools([tool("f", {"type": "object", "properties": {"a": empty}})])
    for fmt in FORMATS:
        with pytest.raises(ToolError, match="nothing can follow|must be a non-empty list") as caught:
            toolkit.call_grammar(tools, fmt)
        assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- parsing: arguments a client can json.loads

@pytest.mark.parametrize("fmt, text", [
    (HERMES, '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": Infinity}"}</tool_call>'),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": "{oops"}]'),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"x": -Infinity}'),
    (LLAMA3, '{"name": "f", "parameters": "x=1"}'),
])
def test_a_call_whose_arguments_are_no_json_is_no_call(fmt, text):
    """A call's arguments went out as "not json" (or with NaN): every client's json.loads failed on it."""
    assert toolkit.parse_calls(text, fmt, frozenset({"f"})) == (text, [])


@pytest.mark.parametrize("fmt, text, arguments", [
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', {"x": 1}),  # JSON in a string
    (HERMES, '<tool_call>{"name": "f", "arguments": ""}</tool_call>', {}),
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', {}),
    (LLAMA3, '{"name": "f", "parameters": "{\\"x\\": [1, {\\"y\\": \\"}\\"}]}"}', {"x": [1, {"y": "}"}]}),
])
def test_arguments_sent_as_a_json_text_are_that_json(fmt, text, arguments):
    _, calls = toolkit.parse_calls(text, fmt, frozenset({"f"}))
    assert [c.name for c in calls] == ["f"] and json.loads(calls[0].arguments) == arguments


def test_mistrals_newer_templates_get_calls_in_their_own_shape():
    """Devstral, Ministral 3 and Small 3.2 write `[TOOL_CALLS]name[ARGS]{...}` (Small 3.2 with a
    `[CALL_ID]`): the grammar forced them into Nemo's `[TOOL_CALLS][{"name": ...}]` instead, and
    Small 3.2's own shape did not parse."""
    assert (DEVSTRAL.name, DEVSTRAL.named, SMALL_3_2.named, MISTRAL.named) == ("mistral", "[ARGS]", "[CALL_ID]", "")
    tools = toolkit.check_tools([tool("now"), tool("get", {"type": "object", "properties": {"k": {"type": "string"}}})])
    grammar = toolkit.call_grammar(tools, DEVSTRAL, parallel=False)
    assert 'root ::= "[TOOL_CALLS]" tc-call\n' in grammar and '"get" tc-mid' in grammar
    text = '[TOOL_CALLS]get[CALL_ID]a1B2c3D4e[ARGS]{"k": "v"}[TOOL_CALLS]now[CALL_ID]Zz9Yy8Xx7[ARGS]{}'
    assert toolkit.parse_calls(text, SMALL_3_2, frozenset()) == (None, [ToolCall("get", '{"k": "v"}'),
                                                                         ToolCall("now", "{}")])


# ---------------------------------------------------------------- llama 3's lazy grammar: what triggers it

LAZY_RUN = """
import sys
import llama_cpp
from ggufspec import tools as toolkit
from ggufspec.processing import Grammar
from ggufspec.server.constraints import engine_constraints, shaping
from ggufspec.server.schemas import ChatBody
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
fmt = toolkit.detect_format("<|start_header_id|>{{ tools }}")
body = ChatBody(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "now"}}])
grammar = Grammar(vocab, engine_constraints(shaping(body, fmt, 300), ()))
for byte in sys.argv[2].encode():
    grammar.accept(3 + byte)  # the tiny vocabulary's byte tokens
"""


@pytest.mark.parametrize("answer", [
    '{\\n  "name": "Alice", "age": 30}',   # JSON the user asked for, pretty-printed
    '{\\n  "name": "now", "parameters": {}}',  # a call, pretty-printed
    '       {"name": "now", "parameters": {}}',  # more space before it than the grammar takes
    '<|python_tag|>{"name": "now", "parameters": {}}',
])
def test_a_llama3_answer_that_starts_like_a_call_does_not_abort_the_server(tiny_pair, answer):
    """`^\\s*\\{\\s*"name"` switched the grammar on for text the grammar does not take (a newline after
    the brace): llama.cpp threw "Unexpected empty grammar stack" through its C API, which aborts the process."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", LAZY_RUN, str(tiny_pair[0]), answer.replace("\\n", "\n")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-500:]


def test_llama3s_trigger_is_a_known_function_written_as_the_grammar_writes_it():
    patterns = [re.compile(p) for p in toolkit.trigger_patterns(LLAMA3, frozenset({"now", "get.weather"}))]
    def triggers(text):
        return any(p.search(text) for p in patterns)
    assert triggers('{"name": "now"') and triggers('\n{"name":"get.weather"') and triggers('x <|python_tag|>')
    assert not triggers('{"name": "Alice"') and not triggers('{\n  "name": "now"') and not triggers('{"name": "getXweather"')


@pytest.mark.parametrize("pattern", ["[a-z]+", "^ab", "b$", "\\d{2}-\\d{2}", "a|b", ""])
def test_a_pattern_left_open_at_an_end_is_followed_as_json_schema_reads_it(pattern):
    """JSON Schema's pattern may match anywhere in the string: "[a-z]+" was refused ("Pattern must start
    with ^"), which also refused a whole agent's request whose tool had one. Each string the grammar
    allows holds a match."""
    rules, rng = gbnf_rules(toolkit.schema_grammar({"type": "string", "pattern": pattern})), random.Random(0)
    for _ in range(40):
        assert re.search(pattern, json.loads(sample(rules, rng))), pattern


def test_a_tool_parameter_whose_pattern_the_grammar_cannot_write_is_any_string(tiny_vocab):
    """A lookahead or \\s in one tool's pattern refused the whole request (a tool's schema is not refused,
    as response_format's is: agents check the arguments); that string is now free, the rest followed."""
    fmt = toolkit.detect_format("")
    tools = toolkit.check_tools([tool("f", {"type": "object", "required": ["a", "b", "n"], "properties": {
        "a": {"type": "string", "pattern": "^(?=x)x+$"}, "b": {"type": "string", "pattern": "^\\s+$"},
        "n": {"type": "integer", "minimum": 1, "maximum": 3}}})])
    grammar = toolkit.call_grammar(tools, fmt)
    assert parses(tiny_vocab, grammar)
    rules, rng = gbnf_rules(grammar), random.Random(1)
    for _ in range(20):
        for name, arguments in calls_in(sample(rules, rng), fmt):
            assert name == "f" and 1 <= arguments["n"] <= 3 and isinstance(arguments["b"], str)


def test_a_tool_schema_of_the_wrong_shape_says_where_not_a_python_error():
    """"'str' object has no attribute 'get'" was the whole 400 for a tool whose prefixItems was a text."""
    fmt = toolkit.detect_format("")
    for parameters, says in [({"type": "object", "properties": {"xs": {"type": "array", "prefixItems": "array"}}},
                              "prefixItems at #/properties/xs must be a list of schemas"),
                             ({"type": "object", "required": [{"a": 1}]}, "required at # must be a list of property names"),
                             ({"type": "object", "properties": {"a": {"$ref": 5}}}, "$ref at #/properties/a must be a text")]:
        with pytest.raises(ToolError, match=re.escape(says)):
            toolkit.call_grammar(toolkit.check_tools([tool("f", parameters)]), fmt)
