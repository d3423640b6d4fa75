"""The qwen3_xml tool-call family (ggufspec/tools_xml.py): Qwen3-Coder's XML calls, and Qwen3.5's and
Nemotron 3 Nano's (templates derived from it), recognised from the template, parsed by the tools'
schemas, forced by grammars llama.cpp takes (and whose strings parse back), rendered back through the
template, and served end to end by the real server with a tiny model carrying Qwen3-Coder's template."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import httpx
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from ggufspec import tools as toolkit
from ggufspec.tinymodels import Shape, make_weights, write_model
from ggufspec.tools import ToolCall, ToolError
from serverproc import serving
from test_tools import HERMES, parses
from test_tools_qa import TOOL_SETS, gbnf_rules, sample, tool

# Qwen3-Coder's chat template, as llama.cpp keeps it (models/templates/Qwen3-Coder.jinja)
QWEN3_CODER_TEMPLATE = r"""{% macro render_extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{-'\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{% endmacro %}

{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{%- if not tools is defined %}
    {%- set tools = [] %}
{%- endif %}

{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- "<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks." }}
    {%- endif %}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following tools:\n\n" }}
    {{- "<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>' }}
                {{- '\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {%- if param_fields.description is defined %}
                    {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
                {%- endif %}
                {%- set handled_keys = ['name', 'type', 'description'] %}
                {{- render_extra_keys(param_fields, handled_keys) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {% set handled_keys = ['type', 'properties'] %}
        {{- render_extra_keys(tool.parameters, handled_keys) }}
        {{- '\n</parameters>' }}
        {%- set handled_keys = ['type', 'name', 'description', 'parameters'] %}
        {{- render_extra_keys(tool, handled_keys) }}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a tool ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: the tool calling block MUST begin with an opening <tool_call> tag and end with a closing </tool_call> tag.\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
{%- endif %}
{%- if system_message is defined %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
QWEN = toolkit.detect_format(QWEN3_CODER_TEMPLATE)

WEATHER = tool("get_weather", {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "metric": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "unit": {"enum": ["c", "f", 0]}, "note": {"type": ["string", "null"]}, "any": {}}})
NOW = tool("now")
TOOLS = toolkit.check_tools([WEATHER, NOW])
NAMES = toolkit.plan_tools(TOOLS, "auto", None, QWEN).names


def xml_call(name: str, **values: str) -> str:
    """A call as the template writes it (and the model was trained to): values as raw text."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


# ---------------------------------------------------------------- the family, from its templates

def test_xml_templates_are_recognised_as_llama_cpp_does():
    assert (QWEN.name, QWEN.native, QWEN.start) == ("qwen3_xml", True, "<tool_call>")
    # Qwen3.5's and Nemotron 3 Nano's templates write calls in the same lines
    derived = ("{%- if tools %}{{- tools | tojson }}{%- endif %}{{- '<tool_call>\\n<function=' + tool_call.name + "
               "'>\\n' }}{{- '<parameter=' + args_name + '>\\n' }}")
    assert toolkit.detect_format(derived).name == "qwen3_xml"
    # a template that writes them without newlines is another model's format (llama.cpp's exclusion)
    unspaced = "{{ tools }}{{ '<tool_call><function=' ~ tool_call.name ~ '>' }}{{ '<parameter=' ~ k ~ '>' }}"
    assert toolkit.detect_format(unspaced).name == "hermes"
    assert HERMES.name == "hermes"  # Qwen 2.5/3's JSON calls stay JSON
    assert toolkit.trigger_texts(QWEN) == ("<tool_call>", "<function=")  # a bare call too, as llama.cpp
    assert toolkit.trigger_patterns(QWEN) == (re.escape("<tool_call>"), re.escape("<function="))


# ---------------------------------------------------------------- parsing

def test_a_call_is_parsed_with_values_typed_by_the_schema():
    text = "I will look it up.\n" + xml_call("get_weather", city="123", days="3", metric="true", hours="[1, 2]",
                                              where='{"lat": 48.8}', unit="0", note="null", any="x y")
    content, calls = toolkit.parse_calls(text, QWEN, NAMES)
    assert content == "I will look it up."
    (call,) = calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "123", "days": 3, "metric": True, "hours": [1, 2], "where": {"lat": 48.8}, "unit": 0,
        "note": None, "any": "x y"}


@pytest.mark.parametrize("values, expected", [
    ({"city": "Paris\nand Lyon", "days": "two"}, {"city": "Paris\nand Lyon", "days": "two"}),  # not JSON: text
    ({"city": '{"a": 1}', "note": "42", "unit": "f"}, {"city": '{"a": 1}', "note": "42", "unit": "f"}),
    ({"where": '{"s": "</parameter>"}', "city": ""}, {"where": {"s": "</parameter>"}, "city": ""}),
    ({"days": "1e999"}, {"days": "1e999"}),  # no JSON a client can read: the text
])
def test_values_are_json_only_where_their_schema_and_text_say_so(values, expected):
    _, calls = toolkit.parse_calls(xml_call("get_weather", **values), QWEN, NAMES)
    assert [json.loads(c.arguments) for c in calls] == [expected]


def test_several_calls_and_the_text_around_them():
    text = (f"Two things.\n{xml_call('now')}\n{xml_call('get_weather', city='Oslo', days='2')}\n"
            "<tool_call>\n<function=now>\n</function>")  # no </tool_call>: still a whole call
    content, calls = toolkit.parse_calls(text, QWEN, NAMES)
    assert content == "Two things."
    assert calls == [ToolCall("now", "{}"), ToolCall("get_weather", '{"city": "Oslo", "days": 2}'),
                     ToolCall("now", "{}")]
    # the model's own spacing need not be the template's
    assert toolkit.parse_calls("<tool_call><function=now></function></tool_call>", QWEN, NAMES) == \
        (None, [ToolCall("now", "{}")])
    # without the schemas (another family's fallback): JSON where the text is JSON
    assert toolkit.parse_calls(xml_call("f", a="1", b="x"), HERMES, frozenset()) == \
        (None, [ToolCall("f", '{"a": 1, "b": "x"}')])
    # Qwen's JSON calls still parse under this family
    assert toolkit.parse_calls('<tool_call>{"name": "now", "arguments": {}}</tool_call>', QWEN, NAMES)[1] == \
        [ToolCall("now", "{}")]


def test_a_call_cut_anywhere_is_no_call_and_no_crash():
    text = "Sure.\n" + xml_call("get_weather", city="Rome", days="5", where='{"lat": 41.9}')
    end = text.index("</function>") + len("</function>")
    for cut in range(len(text)):
        content, calls = toolkit.parse_calls(text[:cut], QWEN, NAMES)
        if cut < end:
            assert (content, calls) == (text[:cut], []), cut
        else:
            assert content == "Sure." and [c.name for c in calls] == ["get_weather"]
    assert toolkit.call_start("Sure.\n<tool_", QWEN) == len("Sure.\n")  # a stream holds back from the marker


def test_a_call_without_its_tool_call_lines_is_a_call_of_a_known_function():
    """Qwen3-Coder at times writes `<function=NAME>...</function>` without `<tool_call>`: it stayed
    content (llama.cpp takes it as a call). A name no tool has stays content: prose about the format."""
    bare = xml_call("get_weather", city="Oslo", days="2").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert toolkit.parse_calls("Let me check.\n" + bare, QWEN, NAMES) == \
        ("Let me check.", [ToolCall("get_weather", '{"city": "Oslo", "days": 2}')])
    assert toolkit.parse_calls(f"{bare}\n{xml_call('now')}", QWEN, NAMES)[1] == \
        [ToolCall("get_weather", '{"city": "Oslo", "days": 2}'), ToolCall("now", "{}")]
    for text in ("Write <function=rm>\n</function> to call rm.", bare.replace("get_weather", "get_weathers")):
        assert toolkit.parse_calls(text, QWEN, NAMES) == (text, [])
    assert toolkit.parse_calls(bare, HERMES, frozenset()) == (bare, [])  # no tools known: no bare call
    assert toolkit.call_start("Let me check.\n<function=", QWEN) == len("Let me check.\n")  # a stream holds it back
    assert toolkit.call_start("Let me check.\n<func", QWEN) == len("Let me check.\n")


# ---------------------------------------------------------------- grammars

def declared_type(tools: list[dict], name: str, parameter: str):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    return (schema.get("properties") or {}).get(parameter, {}).get("type")


def check_round_trip(tools: list[dict], text: str, parallel: bool) -> None:
    """The calls in a grammar's string, read as the template writes them, against parse_calls'."""
    written = [(m[1], dict(re.findall(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", m[2], re.S)))
               for m in re.finditer(r"(?:<tool_call>\n)?<function=([^>\n]+)>\n(.*?)</function>\n(?:</tool_call>)?",
                                    text, re.S)]  # a call with its <tool_call> lines, or bare
    content, calls = toolkit.parse_calls(text, QWEN, toolkit.plan_tools(tools, "auto", None, QWEN).names)
    assert content is None and [c.name for c in calls] == [name for name, _ in written], text
    assert parallel or len(calls) == 1
    for call, (name, raw) in zip(calls, written):
        arguments = json.loads(call.arguments)
        assert arguments.keys() == raw.keys(), text
        for key, value in arguments.items():
            kind = declared_type(tools, name, key)
            assert value == raw[key] if isinstance(value, str) else value == json.loads(raw[key]), (key, text)
            if kind == "string":
                assert isinstance(value, str), (key, text)
            elif kind in ("integer", "number", "boolean", "object", "array"):
                assert not isinstance(value, str), (key, text)


@pytest.mark.parametrize("key", sorted(TOOL_SETS) + ["weather"])
def test_what_a_call_grammar_allows_parses_back(key, monkeypatch):
    import test_tools_qa
    monkeypatch.setattr(test_tools_qa, "POOL", test_tools_qa.POOL + list("prmt"))  # the letters of </parameter>
    tools = TOOLS if key == "weather" else toolkit.check_tools(TOOL_SETS[key])
    rng = random.Random(key)
    for parallel in (True, False):
        rules = gbnf_rules(toolkit.call_grammar(tools, QWEN, parallel=parallel))
        for _ in range(40):
            check_round_trip(tools, sample(rules, rng), parallel)


def test_the_grammar_is_llama_cpps():
    grammar = toolkit.call_grammar(TOOLS, QWEN, only="get_weather", parallel=False)
    assert 'tx-one ::= "<tool_call>\\n" tx-call "</tool_call>"\ntx-any ::= tx-one | tx-call\nroot ::= tx-any\n' in grammar
    assert '"<parameter=city>\\n" tx-text "\\n</parameter>\\n"' in grammar  # a string: free text
    assert '"<parameter=unit>\\n" ("c" | "f" | "0")' in grammar             # an enum: its values' texts
    assert "tx-0-args-3 ::= tx-0-0 tx-0-args-2 | tx-0-1 tx-0-args-1" in grammar  # required, in any order
    assert "<function=now>" not in grammar
    with pytest.raises(ToolError, match="nothing can follow"):
        toolkit.call_grammar(toolkit.check_tools([tool("f", {"type": "object", "properties": {"a": {"enum": []}}})]),
                             QWEN)


def test_llama_cpp_takes_every_grammar(tiny_vocab):
    for key in sorted(TOOL_SETS):
        for parallel in (True, False):
            assert parses(tiny_vocab, toolkit.call_grammar(toolkit.check_tools(TOOL_SETS[key]), QWEN, parallel=parallel)), key
    assert parses(tiny_vocab, toolkit.call_grammar(TOOLS, QWEN))
    assert parses(tiny_vocab, toolkit.call_grammar(TOOLS, QWEN, only="now"))


LAZY_RUN = """
import sys
import llama_cpp
from ggufspec import tools as toolkit
from ggufspec.processing import Grammar
from ggufspec.server.constraints import engine_constraints, shaping
from ggufspec.server.schemas import ChatBody
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
fmt = toolkit.detect_format(sys.argv[3])
tools = [{"type": "function", "function": {"name": "now"}},
         {"type": "function", "function": {"name": "go", "parameters": {"type": "object", "required": ["n"],
                                                                        "properties": {"n": {"type": "integer"}}}}}]
body = ChatBody(messages=[{"role": "user", "content": "hi"}], tools=tools)
grammar = Grammar(vocab, engine_constraints(shaping(body, fmt, 300), ()))
for byte in sys.argv[2].encode():
    if not grammar.accept(3 + byte):  # the tiny vocabulary's byte tokens
        sys.exit(3)  # a trigger fired onto text the grammar does not take
"""


@pytest.mark.parametrize("answer", [
    "Let me check. <tool_call>\n<function=now>\n</function>\n</tool_call>",
    "Let me check.\n<function=go>\n<parameter=n>\n12\n</parameter>\n</function>\n",  # bare: triggers at <function=
    "<function=now>\n</function>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
    "<tool_call>\n<function=go>\n<parameter=n>\n12\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=now>\n</function>\n</tool_call>",
    "A tag: <tool",  # the trigger's start, never finished
])
def test_the_lazy_grammar_takes_the_text_its_trigger_fires_on(tiny_pair, answer):
    """Under tool_choice auto the grammar starts at `<tool_call>`: text it did not take there would
    abort the server's process (llama.cpp's "Unexpected empty grammar stack")."""
    run = subprocess.run([sys.executable, "-c", LAZY_RUN, str(tiny_pair[0]), answer, QWEN3_CODER_TEMPLATE],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-500:]


# ---------------------------------------------------------------- rendering a conversation

HISTORY = [{"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "metric": true, '
                                                       '"where": {"lat": 48.8}, "note": null}'}},
               {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]


def render(messages: list[dict], tools: list[dict] | None = None) -> str:
    return Jinja2ChatFormatter(QWEN3_CODER_TEMPLATE, "", "")(messages=messages, tools=tools).prompt


def test_a_history_with_json_text_arguments_renders_as_the_model_writes_calls():
    """OpenAI's arguments are a JSON text: the template's `arguments|items` needs a mapping, and its
    `|string` would write Python's True and None where the model writes JSON."""
    prepared = toolkit.prepare_messages(HISTORY, QWEN, TOOLS)
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not changed in place
    prompt = render(prepared, TOOLS)
    call = xml_call("get_weather", city="Paris", days="3", metric="true", where='{"lat": 48.8}', note="null")
    assert f"<|im_start|>assistant\n{call}\n{xml_call('now')}<|im_end|>\n" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>\n" \
           "<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert "<name>get_weather</name>" in prompt  # the template describes the tools itself
    # what the template wrote is what the parser reads back
    assert toolkit.parse_calls(call, QWEN, NAMES) == (None, [ToolCall("get_weather", json.dumps(
        {"city": "Paris", "days": 3, "metric": True, "where": {"lat": 48.8}, "note": None}))])
    # arguments that are no JSON object still render
    odd = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "not json"}},
        {"id": "d", "type": "function", "function": {"name": "now", "arguments": "[1]"}}]}]
    prompt = render(toolkit.prepare_messages(odd, QWEN, TOOLS), TOOLS)
    assert "<parameter=arguments>\nnot json\n</parameter>" in prompt and "<parameter=value>\n[1]\n</parameter>" in prompt


# ---------------------------------------------------------------- through the server

SET_UNIT = {"type": "function", "function": {"name": "set_unit", "description": "choose the unit", "parameters": {
    "type": "object", "required": ["unit", "ok", "n"], "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 1, "maximum": 9}}}}}


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-coder")
    shape = Shape(eos_bias=4.0)
    target = write_model(directory / "qwen3-coder-tiny.gguf", shape, make_weights(shape, 0),
                         chat_template=QWEN3_CODER_TEMPLATE)
    with serving(directory, "-m", str(target), "--no-draft", "-c", "4096") as running:
        yield running


def test_a_forced_call_through_the_server_is_parsed_and_streamed(qwen_server):
    props = httpx.get(qwen_server.url + "/props", timeout=10).json()
    assert props["chat_template_tool_format"] == "qwen3_xml" and props["chat_template_tools"] is True
    client = qwen_server.client(timeout=120)
    choice = {"type": "function", "function": {"name": "set_unit"}}
    messages = [{"role": "user", "content": "which unit?"}]
    answer = client.chat.completions.create(model="qwen3-coder-tiny", messages=messages, tools=[SET_UNIT],
                                            tool_choice=choice, max_tokens=200, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls", answer
    (call,) = answer.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "set_unit" and call.id.startswith("call_")
    assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["ok"], bool)
    assert type(arguments["n"]) is int and 1 <= arguments["n"] <= 9 and answer.choices[0].message.content is None
    streamed, content = [], ""
    for chunk in client.chat.completions.create(model="qwen3-coder-tiny", messages=messages, tools=[SET_UNIT],
                                                stream=True, tool_choice=choice, max_tokens=200, temperature=0):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            streamed += [(c.function.name, c.function.arguments) for c in chunk.choices[0].delta.tool_calls or []]
    assert streamed == [("set_unit", call.function.arguments)] and content == ""  # the raw XML never shows
    # the call and its result, sent back, reach the template as the model writes them
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    prompt = httpx.post(qwen_server.url + "/apply-template", json={"messages": history, "tools": [SET_UNIT]},
                        timeout=30).json()["prompt"]
    rendered = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                       for key, value in arguments.items())  # in the order the model wrote them
    assert f"<|im_start|>assistant\n<tool_call>\n<function=set_unit>\n{rendered}</function>\n</tool_call>" in prompt
    assert "<tool_response>\ndone\n</tool_response>" in prompt
