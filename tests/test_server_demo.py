"""The slow tier of the server for agents: the real demo pair (Qwen2.5-Coder-1.5B-Instruct + 0.5B) behind
`ggufspec serve`, asked for a tool call and for a JSON answer as an agent would, speculating (draft 3)
and not (draft 0): the same answer either way, and one that parses.

The issue this answers: the same requests used to give prose ("Name: Alice\\nAge: 25", a call in a
```json block with finish_reason "stop")."""
from __future__ import annotations

import json

import pytest

from conftest import demo_pair_paths
from serverproc import start_server, stop_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What's the weather like in Paris today?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    target, draft = demo_pair_paths()
    running = start_server(tmp_path_factory.mktemp("demo-server"), "-m", str(target), "-md", str(draft),
                           "-c", "2048", "-t", "2")
    yield running
    stop_server(running)


def ask(server, **request):
    client = server.client(timeout=600)  # a 1.5B model on a CPU: a minute a request where it is busy
    return client.chat.completions.create(model=client.models.list().data[0].id, **request)


def test_an_unprompted_call_is_parsed_into_tool_calls(demo_server):
    """Qwen2.5-Coder answers a call in a ```json block of its own accord: it becomes a tool call."""
    answer = ask(demo_server, messages=ASK_WEATHER, tools=[WEATHER],
                 max_tokens=64)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"


def test_a_forced_call_is_the_same_speculating_or_not(demo_server):
    calls = []
    for draft in (3, 0):
        answer = ask(demo_server, messages=ASK_WEATHER, tools=[WEATHER],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64,
                     extra_body={"draft": draft})
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
        calls.append(call.function.arguments)
        if draft:
            assert answer.timings["draft_n_accepted"] > 0  # it did speculate
    assert calls[0] == calls[1]


def test_a_json_schema_answer_parses_and_is_the_same_speculating_or_not(demo_server):
    texts = []
    for draft in (3, 0):
        answer = ask(demo_server, max_tokens=64,
                     messages=[{"role": "user", "content": "Alice is 25. Give her name and age."}],
                     response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                     extra_body={"draft": draft})
        texts.append(answer.choices[0].message.content)
        assert json.loads(texts[-1]) == {"name": "Alice", "age": 25}
    assert texts[0] == texts[1]
