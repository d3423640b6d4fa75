"""A Hermes (or named Mistral) tool call sent as it is written (server.callstream): its name once whole, then its arguments'
text as it grows, in each protocol's own stream events; their concatenation is the call's JSON and the
stream's final answer (the SDK's) is the whole answer's. Other formats, and whole answers, as before.

Without a model, the answer's pieces played into each protocol (test_tool_protocols.FakeJob); then the
real server with a tiny Qwen-templated model and the official SDKs, counting the argument deltas."""
from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from ggufspec import tools as toolkit
from ggufspec.server.callstream import OPENINGS, CallStream, streams_calls
from ggufspec.server.constraints import Shaping
from ggufspec.server.protocols import core
from ggufspec.server.protocols.anthropic import MessageState
from ggufspec.server.protocols.openai_responses import ResponsesBody, ResponseState
from ggufspec.server.responses import Reply, stream_events
from serverproc import serving
from test_tool_protocols import (ANTHROPIC_TOOLS, CHAT_TOOLS, FORMATS, HI, RESPONSES_TOOLS, STREAMED, UNIT_TOOLS, FakeJob,
                                 FakeServing, family_model, written)

FILE = {"path": "a.py", "content": 'def f(x):\n    return {"a": [x, "}"]}  # a brace in a string: \\" too\n'}
WRITE = ("write", FILE)


def fed(text: str, step: int = 1) -> list[tuple]:
    stream, events = CallStream(), []
    for end in range(step, len(text) + step, step):
        events += stream.push(text[:end])
    return events


def test_a_named_mistral_call_too():
    for family, opening in (("mistral-args", OPENINGS["[ARGS]"]), ("mistral-call-id", OPENINGS["[CALL_ID]"])):
        stream, text = CallStream(*opening), written(family, [WRITE, ("g", {"s": "hi"})])
        events = [e for end in range(1, len(text) + 1) for e in stream.push(text[:end])]
        assert [value for kind, value in events if kind == "call"] == ["write", "g"], family
        assert "".join(v for k, v in events if k == "arguments") == json.dumps(FILE) + json.dumps({"s": "hi"})


def test_the_name_once_whole_then_the_arguments_as_written():
    text = written("hermes", [WRITE, ("g", {"s": "hi"})])
    for step in (1, 3, 17):
        events = fed(text, step)
        assert [value for kind, value in events if kind == "call"] == ["write", "g"]
        first, second = "".join(v for k, v in events[1:events.index(("call", "g"))]), ""
        second = "".join(v for k, v in events[events.index(("call", "g")) + 1:])
        assert json.loads(first) == FILE and first == json.dumps(FILE)  # exactly as written, braces in strings too
        assert second == json.dumps({"s": "hi"})
    assert len(fed(text)) > 20  # one character at a time: that many deltas


def test_what_is_not_the_grammars_shape_is_not_streamed():
    assert fed('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>' + " " * 300) == []
    assert fed('<tool_call>\n{"name": "f", "arguments": "x"}</tool_call>') == []
    cut = fed('<tool_call>\n{"name": "f", "arguments": {"s": "a b')
    assert cut == [("call", "f")] + [("arguments", c) for c in '{"s": "a b']


def shape_for(family: str, choice="auto") -> Shaping:
    fmt = toolkit.detect_format(FORMATS[family])
    return Shaping(plan=toolkit.plan_tools(UNIT_TOOLS, choice, None, fmt), fmt=fmt)


def test_only_hermes_and_named_mistral_calls_under_the_grammar():
    assert all(streams_calls(shape_for(family)) for family in STREAMED)
    assert not any(streams_calls(shape_for(family)) for family in FORMATS if family not in STREAMED)
    fmt = toolkit.detect_format(FORMATS["hermes"])
    assert not streams_calls(Shaping(plan=toolkit.plan_tools(None, None, None, fmt), fmt=fmt))


def stream_of(protocol: str, text: str, finish: str, family: str = "hermes") -> list[dict]:
    """The SSE events of `text` answered through `protocol`, streamed."""
    shape = shape_for(family)
    if protocol == "chat":
        async def chunks():
            return [json.loads(e["data"]) async for e in stream_events(FakeJob(shape, text, finish), Reply("m", True, shape), False)
                    if e["data"] != "[DONE]"]
        return asyncio.run(chunks())
    state = (MessageState(FakeServing(shape.fmt), 5) if protocol == "messages" else
             ResponseState(FakeServing(shape.fmt), ResponsesBody(input="x")))

    async def play():
        return [json.loads(e["data"]) async for answer_event in core.answer_events(FakeJob(shape, text, finish), stream_calls=True)
                for e in state.on(answer_event)]
    return asyncio.run(play())


def argument_deltas(protocol: str, events: list[dict]) -> dict[int, list[str]]:
    deltas: dict[int, list[str]] = {}
    for event in events:
        if protocol == "chat":
            for call in (event["choices"][0]["delta"].get("tool_calls") or []) if event["choices"] else []:
                deltas.setdefault(call["index"], []).append(call["function"].get("arguments") or "")
        elif protocol == "messages" and event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            deltas.setdefault(event["index"], []).append(event["delta"]["partial_json"])
        elif protocol == "responses" and event["type"] == "response.function_call_arguments.delta":
            deltas.setdefault(event["output_index"], []).append(event["delta"])
    return deltas


@pytest.mark.parametrize("family", STREAMED)
@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
def test_each_protocol_streams_the_arguments_as_written(protocol, family):
    text = "Writing it. " + written(family, [WRITE, ("g", {"s": "hi"})])
    deltas = argument_deltas(protocol, stream_of(protocol, text, "stop", family=family))
    assert ["".join(d) for d in deltas.values()] == [json.dumps(FILE), json.dumps({"s": "hi"})], deltas
    assert all(len(d) > 10 for d in deltas.values())  # as the pieces came, not once whole
    other = argument_deltas(protocol, stream_of(protocol, written("mistral", [WRITE]), "stop", family="mistral"))
    assert [len(d) for d in other.values()] == [1]  # held until whole, as before


@pytest.mark.parametrize("protocol", ["messages", "responses"])
def test_a_streamed_call_cut_short_ends_as_the_protocol_ends_one(protocol):
    one = written("hermes", [WRITE])
    events = stream_of(protocol, one + one[:len(one) // 2], "length")
    deltas = argument_deltas(protocol, events)
    assert "".join(deltas[min(deltas)]) == json.dumps(FILE) and len(deltas) == 2
    if protocol == "messages":
        starts = [e["index"] for e in events if e["type"] == "content_block_start"]
        assert starts == [e["index"] for e in events if e["type"] == "content_block_stop"]  # each block closed
        assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    else:
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [item["status"] for item in done] == ["completed", "incomplete"]
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["output"] == done  # the final response holds what the events said


# ---------------------------------------------------------------- the real server, the official SDKs

@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hermes")
    with serving(directory, "-m", str(family_model(directory, "hermes")), "--no-draft", "-c", "4096") as running:
        yield running


def test_the_sdks_get_the_arguments_as_they_are_written(qwen_server):
    choice = {"type": "tool", "name": "set_unit"}
    client = anthropic.Anthropic(base_url=qwen_server.url, api_key="none", max_retries=0, timeout=300)
    fields = dict(model="hermes", messages=HI, tools=ANTHROPIC_TOOLS, tool_choice=choice, max_tokens=300)
    with client.messages.stream(**fields) as helper:
        partial = [e.delta.partial_json for e in helper if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
        streamed = helper.get_final_message()
    whole = client.messages.create(**fields)
    assert len(partial) > 3 and json.loads("".join(partial)) == streamed.content[-1].input == whole.content[-1].input
    openai = qwen_server.client(timeout=300)
    chat = dict(model="hermes", messages=HI, tools=CHAT_TOOLS, max_tokens=300,
                tool_choice={"type": "function", "function": {"name": "set_unit"}})
    deltas = [c.function.arguments for chunk in openai.chat.completions.create(stream=True, **chat) if chunk.choices
              for c in chunk.choices[0].delta.tool_calls or []]
    message = openai.chat.completions.create(**chat).choices[0].message
    assert len(deltas) > 3 and json.loads("".join(deltas)) == json.loads(message.tool_calls[0].function.arguments)
    responses = dict(model="hermes", input=HI, tools=RESPONSES_TOOLS, max_output_tokens=300,
                     tool_choice={"type": "function", "name": "set_unit"})
    with openai.responses.stream(**responses) as helper:
        got = [e.delta for e in helper if e.type == "response.function_call_arguments.delta"]
        final = helper.get_final_response()
    assert len(got) > 3 and "".join(got) == final.output[-1].arguments
    assert json.loads(final.output[-1].arguments) == json.loads(openai.responses.create(**responses).output[-1].arguments)
