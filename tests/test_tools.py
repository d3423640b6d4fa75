"""ggufspec.tools without a model: each family's call format recognised, rendered and parsed; the
grammars that force a call (or a JSON answer) accepted by llama.cpp's own GBNF parser; bad tools
and schemas refused with one line."""
from __future__ import annotations

import json

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from ggufspec import tools as toolkit
from ggufspec.load import DEFAULT_CHAT_TEMPLATE
from ggufspec.tools import ToolCall, ToolError

HERMES = toolkit.detect_format("{% if tools %}<tool_call>{% endif %}")
LLAMA3 = toolkit.detect_format("<|start_header_id|>{% if tools %}{{ tools | tojson }}{% endif %}")
MISTRAL = toolkit.detect_format("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]")
PLAIN = toolkit.detect_format("{% for m in messages %}{{ m.content }}{% endfor %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
NAMES = frozenset({"get_weather", "now"})


def test_families_are_recognised_by_their_templates():
    assert (HERMES.name, HERMES.native) == ("hermes", True)
    assert (LLAMA3.name, LLAMA3.args_key) == ("llama3", "parameters")
    assert MISTRAL.name == "mistral"
    assert (PLAIN.name, PLAIN.native) == ("hermes", False)  # taught the hermes format by a system message
    fallback = toolkit.detect_format(DEFAULT_CHAT_TEMPLATE)
    assert (fallback.name, fallback.native) == ("hermes", True)


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [ToolCall("get_weather", '{"city": "Paris"}')]),
    (HERMES, 'Let me look.\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}',  # cut short: still whole JSON
     "Let me look.", [ToolCall("now", "{}"), ToolCall("get_weather", '{"city": "Oslo", "unit": "c"}')]),
    (LLAMA3, ' {"name": "get_weather", "parameters": {"city": "Rome"}}',
     None, [ToolCall("get_weather", '{"city": "Rome"}')]),
    (LLAMA3, '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}',
     None, [ToolCall("now", "{}"), ToolCall("now", "{}")]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "now", "arguments": {}}]',
     None, [ToolCall("get_weather", '{"city": "Lyon"}'), ToolCall("now", "{}")]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}', None, [ToolCall("get_weather", '{"city": "Nice"}')]),
    (HERMES, '[TOOL_CALLS][{"name": "now", "arguments": {}}]', None, [ToolCall("now", "{}")]),  # other families too
    (HERMES, '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # Qwen-Coder, unprompted
     None, [ToolCall("get_weather", '{"city": "Paris"}')]),
])
def test_calls_are_parsed_in_each_family(fmt, text, content, calls):
    assert toolkit.parse_calls(text, fmt, NAMES) == (content, calls)


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "The weather is fine."),
    (HERMES, "<tool_call>{not json</tool_call>"),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),          # no name
    (LLAMA3, '{"name": "Alice", "age": 25}'),                      # JSON, but no known function
    (LLAMA3, '{"name": "now", "parameters": {}} and then prose'),   # not a whole message
    (HERMES, '```json\n{"name": "Alice", "arguments": {}}\n```'),   # a JSON answer, not a known function
    (MISTRAL, "[TOOL_CALLS] nothing after it"),
])
def test_what_is_not_a_call_stays_content(fmt, text):
    assert toolkit.parse_calls(text, fmt, NAMES) == (text, [])


def test_streaming_holds_back_from_where_a_call_may_begin():
    assert toolkit.call_start("Sure, here", HERMES) is None
    assert toolkit.call_start("Sure <tool", HERMES) == len("Sure ")          # maybe the start of a marker
    assert toolkit.call_start("Sure <tool_call>{", HERMES) == len("Sure ")
    assert toolkit.call_start("a < b", HERMES) is None
    assert toolkit.call_start("  {", LLAMA3) == 0 and toolkit.call_start("", LLAMA3) == 0
    assert toolkit.call_start("Hello {", LLAMA3) is None                    # llama3: a call is the whole message
    assert toolkit.call_start("```js", HERMES) == 0                         # perhaps a ```json block: a call
    assert toolkit.call_start("```python\n", HERMES) is None                # code: streams


def test_plans_for_each_tool_choice():
    tools = [WEATHER, NOW]
    auto = toolkit.plan_tools(tools, None, None, HERMES)
    assert auto.parse and auto.lazy and not auto.forced and auto.triggers == ("<tool_call>",)
    assert toolkit.trigger_patterns(HERMES) == (r"<tool_call>",)
    assert toolkit.plan_tools(tools, "none", None, HERMES) == toolkit.ToolPlan(None, parse=False)
    required = toolkit.plan_tools(tools, "required", False, HERMES)
    assert required.forced and not required.lazy and "(tc-ws tc-one)*" not in required.grammar
    named = toolkit.plan_tools(tools, {"type": "function", "function": {"name": "now"}}, None, HERMES)
    assert named.forced and '"\\"now\\""' in named.grammar and "get_weather" not in named.grammar
    assert toolkit.plan_tools(None, "auto", None, HERMES).parse is False


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "no spaces allowed"}}], None, "name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "nope"}}], None, "parameters"),
    ([NOW], {"type": "function", "function": {"name": "other"}}, "'other'"),
    ([NOW], "sometimes", "tool_choice"),
    (None, "required", "tool_choice needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.com/s.json"}}}],
     None, "JSON schema"),
])
def test_bad_tools_are_one_line_errors(tools, choice, message):
    with pytest.raises(ToolError, match=None) as caught:
        toolkit.plan_tools(tools, choice, None, HERMES)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_bad_schemas_are_one_line_errors():
    for schema in ([1, 2], {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}):
        with pytest.raises(ToolError):
            toolkit.schema_grammar(schema)


def test_conversations_with_calls_render_through_the_template():
    """A native template gets arguments as objects; one that knows no tools gets them written out."""
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    native = toolkit.prepare_messages(messages, HERMES, [WEATHER])
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not changed in place
    prompt = Jinja2ChatFormatter(DEFAULT_CHAT_TEMPLATE, "", "")(messages=native, tools=[WEATHER]).prompt
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    plain = toolkit.prepare_messages(messages, PLAIN, [WEATHER])
    assert plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert plain[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                        '{"city": "Paris"}}\n</tool_call>'}
    assert plain[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_call_ids_fit_the_family():
    calls = toolkit.openai_tool_calls([ToolCall("now", "{}")], MISTRAL)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    assert toolkit.openai_tool_calls([ToolCall("now", "{}")], HERMES)[0]["id"].startswith("call_")


def parses(vocab, grammar: str) -> bool:
    import llama_cpp
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if sampler:
        llama_cpp.llama_sampler_free(sampler)
    return bool(sampler)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_llama_cpp_accepts_the_call_grammars(tiny_vocab, fmt):
    for parallel in (True, False):
        assert parses(tiny_vocab, toolkit.call_grammar(toolkit.check_tools([WEATHER, NOW]), fmt, parallel=parallel))
    assert parses(tiny_vocab, toolkit.call_grammar(toolkit.check_tools([WEATHER, NOW]), fmt, only="get_weather"))


def test_llama_cpp_accepts_the_json_grammars(tiny_vocab):
    assert parses(tiny_vocab, toolkit.json_object_grammar())
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "$defs": {"unused": {"type": "null"}}}
    assert parses(tiny_vocab, toolkit.schema_grammar(schema))
    assert not parses(tiny_vocab, "root ::= undefined-rule")  # the check can fail


def test_a_call_grammar_follows_json_refs_inside_parameters(tiny_vocab):
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}},
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}}
    grammar = toolkit.call_grammar(toolkit.check_tools([tool]), HERMES)
    assert parses(tiny_vocab, grammar) and json.dumps("x") in grammar.replace("\\", "")


def test_a_call_grammar_follows_integer_bounds_and_takes_annotation_only_properties(tiny_vocab):
    """A forced call's "level" from 1 to 5 came back as 99: tool parameters went through the plain
    converter, without the integer bounds response_format follows; pydantic's {"title": "Any"} was refused."""
    import re
    from test_schema_bounds import as_regex
    tool = {"type": "function", "function": {"name": "set_volume", "parameters": {
        "type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5},
                                         "note": {"title": "Any"}}, "required": ["level"]}}}
    grammar = toolkit.call_grammar(toolkit.check_tools([tool]), HERMES)
    assert parses(tiny_vocab, grammar)
    rule = re.search(r"^(\S*level\S*) ::= (.*?) space$", grammar, re.M)
    assert rule is not None, grammar
    pattern = as_regex(rule.group(2))
    assert [n for n in range(-20, 120) if pattern.fullmatch(str(n))] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- a call that max_tokens cut off

CUT_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def cut_choice(text: str, fmt_name: str = "hermes", tool_choice="auto"):
    """A chat choice that ended at max_tokens after `text`: (content, calls) whole and streamed."""
    from ggufspec.server.choices import ChoiceState
    from ggufspec.server.constraints import Shaping
    fmt = {"hermes": toolkit.detect_format("{{ tools }} <tool_call>"),
           "llama3": toolkit.detect_format("{{ tools }} <|start_header_id|>"),
           "mistral": toolkit.detect_format("{{ tools }} [TOOL_CALLS]")}[fmt_name]
    shape = Shaping(plan=toolkit.plan_tools(CUT_TOOL, tool_choice, None, fmt), fmt=fmt)
    whole = ChoiceState(0, shape, chat=True)
    whole.pieces = [{"text": text}]
    message, _ = whole.message(cut_short=True)
    streamed = ChoiceState(0, shape, chat=True)
    sent = "".join(p["text"] for p in streamed.push([{"text": ch} for ch in text]))
    _, held_content, calls = streamed.end(cut_short=True)
    return message.get("content"), len(message.get("tool_calls") or []), sent + (held_content or ""), len(calls)


@pytest.mark.parametrize("text, shown", [
    ('Sure. <tool_call>\n{"name": "f", "argu', "Sure. "),
    ("Sure. <tool_", "Sure. "),  # a marker cut in two
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "ar', ""),  # a second call
    ("Sure, here it is.", "Sure, here it is."),  # no call: the text stays
    ('{"a": 1, "b', '{"a": 1, "b'),  # a JSON answer is no call
])
def test_a_call_cut_off_by_max_tokens_leaves_no_markup(text, shown):
    content, n_calls, streamed, n_streamed_calls = cut_choice(text)
    assert (content or "") == shown and streamed == shown and n_calls == n_streamed_calls


@pytest.mark.parametrize("text, shown", [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "]}"}}, {"name": "f", "argu', ""),
    ('Sure. [TOOL_CALLS][{"name": "f", "arguments": {}},', "Sure. "),  # cut after the comma
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}', ""),  # cut before the list's "]": the call is whole
])
def test_mistrals_list_cut_by_max_tokens_keeps_its_complete_calls(text, shown):
    """`[TOOL_CALLS][{...}, {"name": "f", "argu`: the list did not decode, so the complete call went
    with the cut one (all of it dropped as a cut call's markup). The complete calls are calls, the cut
    one is dropped, whole answer and stream alike (finish_reason "length" says it was cut)."""
    content, n_calls, streamed, n_streamed_calls = cut_choice(text, "mistral")
    # (the whole answer is one piece here, the text before its calls stripped as parse_calls strips it)
    assert (content or "") == shown.strip() and streamed == shown and n_calls == n_streamed_calls == 1


@pytest.mark.parametrize("text, calls", [
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"ci',
     [ToolCall("now", "{}")]),
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}, ',
     [ToolCall("now", "{}"), ToolCall("now", "{}")]),
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}, oops]', []),      # closed, malformed: no cut, no call
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}, null, {"na', []),  # an item that is no call
    ('[TOOL_CALLS][{"name": "now", "argu', []),                        # nothing complete
])
def test_a_cut_mistral_list_parses_to_its_complete_calls(text, calls):
    assert toolkit.parse_calls(text, MISTRAL, NAMES) == ((None, calls) if calls else (text, []))


def test_a_bare_json_call_cut_off_is_dropped_too():
    content, _, streamed, _ = cut_choice('{"name": "f", "parameters": {"x', "llama3")
    assert not content and not streamed


@pytest.mark.parametrize("schema", [
    {"enum": ['say "hi"', "b", "back\\slash"]}, {"const": 'a "quoted" word'},
    {"type": "object", "properties": {'a"b': {"type": "integer"}}, "required": ['a"b']},
    {"type": "string", "pattern": "^\\d{3}-[\\w.]+$"}, {"type": "string", "pattern": "^\\d+\\.\\d\\d$"},
    {"type": "string", "pattern": "^[\\w.\\-]+@example\\.com$"},
])
def test_quotes_backslashes_and_class_escapes_make_grammars_llama_cpp_parses(tiny_vocab, schema):
    """A quote in an enum, const or property name ended the GBNF literal, and \\d in a pattern was kept
    as literal text: valid schemas were refused as "the grammar does not parse"."""
    assert parses(tiny_vocab, toolkit.schema_grammar(schema))


def test_class_escapes_the_grammar_cannot_follow_are_named():
    with pytest.raises(ToolError, match=r"uses \\s, which the grammar does not follow"):
        toolkit.schema_grammar({"type": "string", "pattern": "^\\s+$"})
    with pytest.raises(ToolError, match=r"put the - last in the class"):  # [a-z] would be a range in GBNF
        toolkit.schema_grammar({"type": "string", "pattern": "^[a\\-z]+$"})
