"""Anthropic's Messages API and OpenAI's Responses API on `ggufspec serve`, through the real server
process, spoken to with the official `anthropic` and `openai` SDKs (httpx for the raw events and the
errors). Each is a translation of the same request the chat API makes: the tests compare their
answers and prompt lengths with /v1/chat/completions' for the same conversation.

The tiny chat pair: its template knows no tools (a system message teaches them), and under a grammar
a random model still writes a valid call, so a forced call's input must parse whatever it says."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from ggufspec.server.protocols.openai_responses import COMPACTED
from serverproc import pair_server_fixture, raw_events, serving

N_CTX = 2048  # the tiny models write text byte by byte: a tool list is a few hundred tokens
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
          "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "set_unit", "description": "choose the temperature unit",
                                              "parameters": SCHEMA}}
ANTHROPIC_TOOL = {"name": "set_unit", "description": "choose the temperature unit", "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "set_unit", "description": "choose the temperature unit",
                  "parameters": SCHEMA}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
HI = [{"role": "user", "content": "hi"}]

server = pair_server_fixture("-c", str(N_CTX))


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def chat(server, messages, **fields):
    """The same conversation through /v1/chat/completions: (text, prompt tokens)."""
    answer = server.client().chat.completions.create(model="target", messages=messages, **fields)
    return answer.choices[0].message.content, answer.usage.prompt_tokens


# ---------------------------------------------------------------- Anthropic: answers

def test_a_message_is_the_chat_answer_to_the_same_conversation(server, claude):
    system = [{"type": "text", "text": "be brief"}, {"type": "text", "text": "and kind"}]
    message = claude.messages.create(model="claude-haiku-4-5", max_tokens=12, system=system, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}])
    text, prompt_tokens = chat(server, [{"role": "system", "content": "be brief\nand kind"},
                                        {"role": "user", "content": "hi\nthere"}], max_tokens=12)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens
    assert message.usage.output_tokens == 12 and message.stop_reason == "max_tokens"
    again = claude.messages.create(model="x", max_tokens=12, system="be brief\nand kind", messages=[
        {"role": "user", "content": "hi\nthere"}], metadata={"user_id": "u1"},
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0, "top_k": 40, "top_p": 0.9})
    assert again.content[0].text == text and again.usage.cache_read_input_tokens > 0  # the cache held the prompt


def test_a_multi_turn_conversation_and_stop_sequences(server, claude):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and then?"}]
    text, _ = chat(server, turns, max_tokens=16)
    stop = text[6:8]
    message = claude.messages.create(model="target", max_tokens=16, messages=turns, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]


def test_a_last_assistant_message_is_continued(server, claude):
    from ggufspec.tinymodels import CHAT_TEMPLATE
    assert CHAT_TEMPLATE.endswith("<s>assistant:{% endif %}")  # so the prompt below is the template's
    prefill = " the cat"
    expected = server.client().completions.create(model="target", prompt="<s>user: hi\n<s>assistant:" + prefill,
                                                  max_tokens=10)
    message = claude.messages.create(model="target", max_tokens=10, messages=[
        *HI, {"role": "assistant", "content": [{"type": "text", "text": prefill}]}])
    assert message.content[0].text == expected.choices[0].text  # what follows the prefill, not the prefill
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    counted = claude.messages.count_tokens(model="target", messages=[*HI, {"role": "assistant", "content": prefill}])
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_max_tokens_beyond_the_context_is_a_ceiling_not_an_error(claude, server):
    message = claude.messages.create(model="target", max_tokens=100_000, messages=HI)  # Claude Code asks 32000
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens < N_CTX
    response = server.client().responses.create(model="target", input="hi", max_output_tokens=100_000)
    assert response.status in ("completed", "incomplete")
    # opencode asks chat for 32000 whatever the context: every turn was a 400 (audit); llama-server lowers it too
    chat = server.client().chat.completions.create(model="target", max_tokens=100_000, messages=HI,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(chat)
    assert chunks[-1].usage.completion_tokens < N_CTX
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    text = server.client().completions.create(model="target", prompt="the cat", max_tokens=100_000)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens < N_CTX


def test_a_streamed_message_is_the_deltas_and_the_events_come_in_order(server, claude):
    whole = claude.messages.create(model="target", max_tokens=16, messages=HI)
    with claude.messages.stream(model="target", max_tokens=16, messages=HI) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    names = [name for name, _ in raw_events(server, "/v1/messages", {"max_tokens": 16, "messages": HI})]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_message_start_splits_off_the_cached_prompt_as_the_final_usage_does(server):
    """Claude Code reads message_start's usage (context size, cost): it counted cached tokens as input."""
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "the same question, asked twice"}]}
    raw_events(server, "/v1/messages", body)  # now cached
    events = dict(raw_events(server, "/v1/messages", body))
    started, final = events["message_start"]["message"]["usage"], events["message_delta"]["usage"]
    assert started["cache_read_input_tokens"] > 0
    for key in ("input_tokens", "cache_read_input_tokens"):
        assert started[key] == final[key]
    nothing = dict(raw_events(server, "/v1/messages", {**body, "max_tokens": 0}))  # no token: still a start
    assert nothing["message_start"]["message"]["usage"]["cache_read_input_tokens"] > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"max_tokens": 1500, "messages": HI}),
    ("/v1/responses", {"max_output_tokens": 1500, "input": "hi"}),
])
def test_a_client_that_leaves_a_stream_stops_its_generation(server, path, body):
    import time
    long = {**body, "stream": True, "grammar": "root ::= [a-z]{1500}"}  # no end before 1500 tokens
    with httpx.stream("POST", server.url + path, json=long, timeout=60) as response:
        lines = response.iter_lines()
        while "delta" not in next(lines):
            pass  # the answer has begun
    deadline = time.monotonic() + 10
    while (health := server.health())["busy"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["last"]["stop_reason"] == "interrupted" and health["last"]["n_predict"] < 1500


# ---------------------------------------------------------------- Anthropic: tools

def test_a_call_cut_off_by_max_tokens_shows_no_markup_in_any_api(server, claude):
    """A forced call that max_tokens cuts off: the template's <tool_call> markup is neither the answer's
    text nor a streamed delta, in any of the three APIs (QA); the stop reason says max_tokens."""
    ask = {"model": "target", "max_tokens": 6, "messages": HI, "tools": [ANTHROPIC_TOOL],
           "tool_choice": {"type": "any"}}
    message = claude.messages.create(**ask)
    assert message.stop_reason == "max_tokens" and not [b for b in message.content if b.type == "text" and b.text]
    with claude.messages.stream(**ask) as stream:
        assert not [b for b in stream.get_final_message().content if b.type == "text" and b.text]
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": SCHEMA}}
    body = {"messages": HI, "tools": [tool], "tool_choice": "required", "max_tokens": 6}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert answer["finish_reason"] == "length" and not answer["message"]["content"], answer
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in r.iter_lines() if line.startswith("data: {") and '"choices":[{' in line)
    assert "<tool_call>" not in streamed and not streamed.strip()
    response = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": "required", "max_output_tokens": 6}).json()
    assert response["status"] == "incomplete"
    assert not any(part.get("text") for item in response["output"] for part in item.get("content") or []), response


def test_a_forced_tool_call_gives_a_parsed_input_whole_and_streamed(server, claude):
    ask = {"model": "target", "max_tokens": 128, "messages": HI, "tools": [ANTHROPIC_TOOL],
           "tool_choice": {"type": "tool", "name": "set_unit", "disable_parallel_tool_use": True}}
    message = claude.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "set_unit" and call.id.startswith("toolu_") and call.input["unit"] in ("celsius", "fahrenheit")
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == [("tool_use", call.name, call.input)]
    events = raw_events(server, "/v1/messages", {k: v for k, v in ask.items() if k != "model"})
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    # a Hermes call goes out as it is written (test_callstream): its input over several deltas
    partial = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert len(partial) > 1 and json.loads("".join(partial)) == call.input
    assert not any(d["type"] == "text_delta" and "<tool_call>" in d["text"] for d in deltas)  # never the raw call


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "auto"}, {"type": "none"}])
def test_each_tool_choice_is_accepted(claude, tool_choice):
    # one call at most, with room to end: parallel ones go on until max_tokens cuts one (max_tokens)
    message = claude.messages.create(model="target", max_tokens=128, messages=HI, tools=[ANTHROPIC_TOOL],
                                     tool_choice={**tool_choice, "disable_parallel_tool_use": True})
    kinds = {block.type for block in message.content}
    assert (message.stop_reason == "tool_use") == ("tool_use" in kinds)
    if tool_choice["type"] == "any":
        assert message.stop_reason == "tool_use"
    if tool_choice["type"] == "none":
        assert "tool_use" not in kinds


def test_a_tool_result_fed_back_is_rendered_as_chat_renders_it_and_answered(server, claude):
    call = {"type": "tool_use", "id": "toolu_1", "name": "set_unit", "input": {"unit": "celsius"}}
    results = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"},
               {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                "content": [{"type": "text", "text": "no such unit"}]}]
    messages = [{"role": "user", "content": "which unit?"},
                {"role": "assistant", "content": [{"type": "text", "text": "let me see"}, call]},
                {"role": "user", "content": [*results, {"type": "text", "text": "well?"}]}]
    message = claude.messages.create(model="target", max_tokens=8, messages=messages, tools=[ANTHROPIC_TOOL],
                                     tool_choice={"type": "none"})
    openai_call = {"id": "toolu_1", "type": "function", "function": {"name": "set_unit", "arguments": '{"unit": "celsius"}'}}
    text, prompt_tokens = chat(server, [
        {"role": "user", "content": "which unit?"},
        {"role": "assistant", "content": "let me see", "tool_calls": [openai_call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "done"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such unit"},
        {"role": "user", "content": "well?"}], tools=[CHAT_TOOL], tool_choice="none", max_tokens=8)
    assert message.content[0].text == text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens
    counted = claude.messages.count_tokens(model="target", messages=messages, tools=[ANTHROPIC_TOOL],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == prompt_tokens


def test_count_tokens_counts_the_tools_too(server, claude):
    bare = claude.messages.count_tokens(model="target", messages=HI).input_tokens
    with_tools = claude.messages.count_tokens(model="target", messages=HI, tools=[ANTHROPIC_TOOL]).input_tokens
    message = claude.messages.create(model="target", max_tokens=2, messages=HI, tools=[ANTHROPIC_TOOL])
    assert with_tools > bare > 0
    assert with_tools == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_output_config_format_is_structured_output(claude):
    message = claude.messages.create(model="target", max_tokens=48, messages=HI,
                                     output_config={"format": {"type": "json_schema", "schema": FLAG}})
    assert isinstance(json.loads(message.content[0].text)["ok"], bool)


# ---------------------------------------------------------------- OpenAI Responses

def test_a_response_is_the_chat_answer_to_the_same_conversation(server):
    client = server.client()
    response = client.responses.create(model="target", input="hi", instructions="be brief", max_output_tokens=12)
    text, prompt_tokens = chat(server, [{"role": "system", "content": "be brief"}, *HI], max_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_") and response.output_text == text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete"  # the message item too, as OpenAI marks it
    assert response.usage.input_tokens == prompt_tokens and response.usage.output_tokens == 12
    items = client.responses.create(model="target", max_output_tokens=12, input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert items.output_text == text


def test_a_streamed_response_is_the_deltas_and_numbered(server):
    client = server.client()
    whole = client.responses.create(model="target", input="hi", max_output_tokens=400)
    assert whole.status == "completed"  # the tiny model ends on its own (eos_bias)
    with client.responses.stream(model="target", input="hi", max_output_tokens=400) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


def test_a_forced_function_call_whole_and_streamed(server):
    client = server.client()
    ask = {"model": "target", "input": "hi", "max_output_tokens": 128, "tools": [RESPONSES_TOOL],
           "tool_choice": {"type": "function", "name": "set_unit"}, "parallel_tool_calls": False}
    response = client.responses.create(**ask)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "set_unit" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    # the same call; streamed as it was written (test_callstream), its arguments spaced as the model wrote them
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == \
        [("function_call", "set_unit", json.loads(call.arguments))]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output[0].arguments
    assert not any(e.type == "response.output_text.delta" for e in events)


def test_a_function_call_output_fed_back_is_rendered_as_chat_renders_it(server):
    client = server.client()
    response = client.responses.create(model="target", max_output_tokens=8, tools=[RESPONSES_TOOL], tool_choice="none",
                                       input=[{"role": "user", "content": "which unit?"},
                                              {"type": "function_call", "call_id": "call_1", "name": "set_unit",
                                               "arguments": '{"unit": "celsius"}'},
                                              {"type": "function_call_output", "call_id": "call_1", "output": "done"}])
    openai_call = {"id": "call_1", "type": "function", "function": {"name": "set_unit", "arguments": '{"unit": "celsius"}'}}
    text, prompt_tokens = chat(server, [{"role": "user", "content": "which unit?"},
                                        {"role": "assistant", "content": None, "tool_calls": [openai_call]},
                                        {"role": "tool", "tool_call_id": "call_1", "content": "done"}],
                               tools=[CHAT_TOOL], tool_choice="none", max_tokens=8)
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens


def test_text_format_json_schema_is_structured_output(server):
    response = server.client().responses.create(model="target", input="hi", max_output_tokens=48, text={
        "format": {"type": "json_schema", "name": "flag", "schema": FLAG, "strict": True}})
    assert isinstance(json.loads(response.output_text)["ok"], bool)


# ---------------------------------------------------------------- a reasoning model's <think> block

def test_thinking_is_told_apart_from_the_answer_however_the_text_is_cut():
    from ggufspec.server.protocols.reasoning import Thinking, ThinkingSplitter

    def split(chunks, opened=False):
        splitter, events = ThinkingSplitter(opened), []
        for chunk in chunks:
            events += splitter.push(chunk)
        events += splitter.flush()
        joined = {"thinking": "", "text": ""}
        for event in events:
            joined["thinking" if isinstance(event, Thinking) else "text"] += event.text
        return joined

    answer = "<think>\nplan it</think>\n\nthe answer"
    for cut in range(1, len(answer)):
        assert split([answer[:cut], answer[cut:]]) == {"thinking": "\nplan it", "text": "the answer"}, cut
    assert split(list(answer)) == {"thinking": "\nplan it", "text": "the answer"}
    assert split(["plan</thi", "nk>answer"], opened=True) == {"thinking": "plan", "text": "answer"}  # DeepSeek-R1's
    assert split(["no thinking <think>here"]) == {"thinking": "", "text": "no thinking <think>here"}
    assert split(["<thi"]) == {"thinking": "", "text": "<thi"}


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    """The tiny target with a template that knows a thinking block (as Qwen3's does); a grammar (passed
    through as llama.cpp's field) makes its answer one."""
    from ggufspec.tinymodels import CHAT_TEMPLATE, Shape, make_weights, write_model
    shape = Shape(eos_bias=4.0)
    template = CHAT_TEMPLATE + "{# the answer: <think>...</think> then the reply #}"
    target = write_model(tmp_path_factory.mktemp("reasoning") / "reasoner.gguf", shape, make_weights(shape, 0), template)
    with serving(tmp_path_factory.mktemp("reasoning-server"), "-m", str(target), "--no-draft", "-c", "512") as running:
        yield running


THINK_GRAMMAR = 'root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{2,6}'


def test_a_reasoning_model_s_thinking_is_a_thinking_block_and_a_reasoning_item(reasoning_server):
    claude = anthropic.Anthropic(base_url=reasoning_server.url, api_key="none", max_retries=0, timeout=60)
    ask = {"model": "reasoner", "max_tokens": 32, "messages": HI, "extra_body": {"grammar": THINK_GRAMMAR}}
    message = claude.messages.create(**ask)
    thinking, text = message.content
    assert thinking.type == "thinking" and text.type == "text" and thinking.thinking.isalpha() and text.text.isalpha()
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        ("thinking", thinking.thinking), ("text", text.text)]
    client = reasoning_server.client()
    response = client.responses.create(model="reasoner", input="hi", max_output_tokens=32,
                                       extra_body={"grammar": THINK_GRAMMAR})
    reasoning, said = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thinking.thinking
    assert said.type == "message" and response.output_text == text.text
    with client.responses.stream(model="reasoner", input="hi", max_output_tokens=32,
                                 extra_body={"grammar": THINK_GRAMMAR}) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking.thinking
    assert streamed.output_text == text.text and streamed.output[0].type == "reasoning"


def test_a_responses_logprobs_are_the_chat_answers(server):
    """include=["message.output_text.logprobs"] / top_logprobs: each token's entry, as chat gives them,
    on the output_text part, on its deltas, and on the stream helper's final response."""
    client = server.client()
    chat_entries = client.chat.completions.create(model="target", messages=HI, max_tokens=8, logprobs=True,
                                                  top_logprobs=2).choices[0].logprobs.content
    fields = {"model": "target", "input": "hi", "max_output_tokens": 8, "top_logprobs": 2,
              "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**fields).output[0].content[0].logprobs
    with client.responses.stream(**fields) as stream:  # cut by max_output_tokens: response.incomplete
        events = list(stream)
    deltas = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    final = next(e.response for e in events if e.type == "response.incomplete").output[0].content[0].logprobs
    assert len(chat_entries) == 8
    for entries in (whole, deltas, final):
        assert [(e.token, round(e.logprob, 3), len(e.top_logprobs)) for e in entries] == [
            (e.token, round(e.logprob, 3), 2) for e in chat_entries]
    assert client.responses.create(model="target", input="hi", max_output_tokens=8).output[0].content[0].logprobs == []


# ---------------------------------------------------------------- models and errors

def test_models_as_each_client_lists_them(server, claude):
    assert [m.id for m in server.client().models.list()] == ["target"]
    (model,) = claude.models.list().data
    assert model.id == "target" and model.type == "model"
    assert server.client().models.retrieve("target").id == claude.models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client().models.retrieve("gpt-4o")


BAD_MESSAGES = [
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": "hi"}, "messages"),
    ({"max_tokens": 8}, "messages"),
    ({"messages": HI}, "max_tokens is required"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}, "content"),
    ({"max_tokens": -1, "messages": HI}, "max_tokens"),  # 0 is allowed: the prompt into the cache
    ({"max_tokens": 8, "messages": HI, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 8, "messages": HI, "top_p": 5}, "top_p"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text"),
    ({"max_tokens": 8, "messages": HI, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     "nope"),
    ({"max_tokens": 8, "messages": HI, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "a server tool (web_search_20250305)"),
    ({"max_tokens": 8, "messages": HI, "output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/x"}}}},
     "output_config.format"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "the cat " * 400}]}, "2048"),
    ({"max_tokens": 8, "messages": HI, "temperature": True}, "temperature"),
    ({"max_tokens": 8, "messages": HI, "tools": [ANTHROPIC_TOOL, ANTHROPIC_TOOL]}, "unique"),
    ({"max_tokens": 8, "messages": HI, "tools": [{**ANTHROPIC_TOOL, "input_schema": {"type": "string"}}]},
     "tools[0].input_schema.type"),
]


def test_empty_text_blocks_as_claude_code_sends_them_are_passed_over(server):
    """Anthropic's API refuses an empty text block, and a Claude Code session that sent one stays stuck
    (its tracker has many reports): here it is only nothing to render."""
    messages = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "text", "text": ""}]},
                {"role": "user", "content": "again"}]
    response = httpx.post(server.url + "/v1/messages", json={"max_tokens": 4, "messages": messages}, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body, message", BAD_MESSAGES)
def test_bad_messages_are_400s_in_anthropics_shape(server, body, message):
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/messages", json={**body, "stream": stream}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"] and "\n" not in error["error"]["message"]
    assert server.health()["status"] == "ok"


def test_anthropic_errors_reach_the_sdk_and_the_server_keeps_serving(server, claude):
    malformed = httpx.post(server.url + "/v1/messages", content=b'{"messages": [', timeout=30)
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    missing = httpx.post(server.url + "/v1/messages/nothing", json={}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        claude.messages.create(model="target", max_tokens=8, messages=[])
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        claude.messages.count_tokens(model="target", messages=[])
    assert claude.messages.create(model="target", max_tokens=4, messages=HI).usage.output_tokens == 4


BAD_RESPONSES = [
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input holds no message"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation: this server keeps no"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt: this server keeps no"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": ["f"]}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "text.format"),
    ({"input": "hi", "model": "gpt-5"}, "gpt-5"),
]


@pytest.mark.parametrize("body, message", BAD_RESPONSES)
def test_bad_responses_requests_are_errors_in_openais_shape(server, body, message):
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/responses", json={**body, "stream": stream}, timeout=30)
        assert response.status_code == (404 if "model" in body else 400), response.text
        error = response.json()["error"]
        assert message in error["message"] and "\n" not in error["message"]
    assert server.health()["status"] == "ok"


# ---------------------------------------------------------------- the demo pair (slow): a real model at work

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
ASK_WEATHER = "What's the weather like in Paris today?"


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    from conftest import demo_pair_paths
    target, draft = demo_pair_paths()
    with serving(tmp_path_factory.mktemp("demo-server"), "-m", str(target), "-md", str(draft), "-c", "2048",
                 "-t", "2") as running:
        yield running


@pytest.mark.slow
def test_claude_code_s_loop_on_the_demo_pair(demo_server):
    """A forced call (streamed, as Claude Code asks), its result fed back, and an answer that uses it."""
    claude = anthropic.Anthropic(base_url=demo_server.url, api_key="none", max_retries=0, timeout=600)
    tool = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER_SCHEMA}
    asked = [{"role": "user", "content": ASK_WEATHER}]
    with claude.messages.stream(model="claude-haiku-4-5", max_tokens=64, messages=asked, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = [block for block in final.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] == "Paris"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees celsius and sunny"}
    # tool_choice none: offered the tool again, the 1.5B model calls it again (and in the template's
    # own example's doubled braces, which no parser takes for a call)
    answer = claude.messages.create(model="claude-haiku-4-5", max_tokens=64, tools=[tool], tool_choice={"type": "none"},
                                    messages=[*asked, {"role": "assistant", "content": final.content},
                                              {"role": "user", "content": [result]}])
    assert answer.stop_reason == "end_turn" and "18" in answer.content[0].text


@pytest.mark.slow
def test_codex_s_loop_on_the_demo_pair(demo_server):
    """Responses streamed as Codex asks for them: a forced call, its output fed back, an answer that uses it."""
    client = demo_server.client(timeout=600)
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": WEATHER_SCHEMA}
    asked = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK_WEATHER}]}]
    model = client.models.list().data[0].id
    with client.responses.stream(model=model, input=asked, tools=[tool], max_output_tokens=64,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] == "Paris"
    fed_back = [*asked, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees celsius and sunny"}]
    with client.responses.stream(model=model, input=fed_back, tools=[tool], tool_choice="none",
                                 max_output_tokens=64) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        answer = stream.get_final_response()
    assert answer.status == "completed" and answer.output_text == "".join(deltas) and "18" in answer.output_text


# ---------------------------------------------------------------- a session's history from elsewhere

def claude_tokens(server, messages) -> int:
    response = httpx.post(server.url + "/v1/messages/count_tokens", json={"messages": messages}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def test_what_a_tool_returns_that_is_no_text_is_a_placeholder_not_a_400_for_the_whole_session(server):
    """Claude Code reading a picture, its tool search, a search's results; a web search Anthropic ran: each was a
    400 that every later turn of the session got too (the history keeps it) (audit)."""
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]}

    def result(*blocks):
        return [{"role": "user", "content": "read it"}, call,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": list(blocks)}]}]
    text = {"type": "text", "text": "a cat"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    placeholder = {"type": "text", "text": "[an image not shown: this model reads text only]"}
    assert claude_tokens(server, result(text, image)) == claude_tokens(server, result(text, placeholder))
    found = {"type": "search_result", "source": "https://x.org", "title": "X",
             "content": [{"type": "text", "text": "found"}]}
    assert claude_tokens(server, result(found)) == claude_tokens(server, result(
        {"type": "text", "text": "X (https://x.org)"}, {"type": "text", "text": "found"}))
    assert claude_tokens(server, result({"type": "tool_reference", "tool_name": "grep"})) > 0
    searched = [{"role": "user", "content": "news?"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "news"}},
        {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []}, {"type": "text", "text": "none"}]},
        {"role": "user", "content": "ok"}]
    assert claude_tokens(server, searched) == claude_tokens(server, [
        searched[0], {"role": "assistant", "content": "none"}, searched[2]])
    answered = httpx.post(server.url + "/v1/messages", json={"max_tokens": 4, "messages": result(text, image)},
                          timeout=60)
    assert answered.status_code == 200, answered.text


def responses_tokens(server, items) -> int:
    response = httpx.post(server.url + "/v1/responses/input_tokens", json={"input": items}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def test_a_codex_session_a_hosted_model_began_goes_on_here(server):
    """Codex's freeform apply_patch and local shell calls, a web search, a compacted history, an image a tool
    returned: each item was a 400 (audit). Calls and results are rendered as function calls; what OpenAI's
    servers did is dropped; an image is a placeholder."""
    ask = {"role": "user", "content": "fix it"}
    custom = [ask, {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
              {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"}]
    as_function = [ask, {"type": "function_call", "call_id": "c1", "name": "apply_patch",
                         "arguments": json.dumps({"input": "*** Begin Patch"})},
                   {"type": "function_call_output", "call_id": "c1", "output": "Done"}]
    assert responses_tokens(server, custom) == responses_tokens(server, as_function)
    shell = [ask, {"type": "local_shell_call", "call_id": "s1", "status": "completed",
                   "action": {"type": "exec", "command": ["ls"]}},
             {"type": "local_shell_call_output", "id": "s1", "output": "a.py"}]
    assert responses_tokens(server, shell) > responses_tokens(server, [ask])
    dropped = [ask, {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
               {"type": "mcp_call", "id": "mcp_1", "name": "x", "arguments": "{}", "server_label": "s"}]
    assert responses_tokens(server, dropped) == responses_tokens(server, [ask])
    # a compacted history cannot be read here: the model is told so, in the system message
    compacted = [{"type": "compaction", "encrypted_content": "xyz"}, ask]
    told = [{"role": "system", "content": COMPACTED}, ask]
    assert responses_tokens(server, compacted) == responses_tokens(server, told) > responses_tokens(server, [ask])
    image = [ask, {"type": "function_call", "call_id": "v1", "name": "view_image", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "v1",
              "output": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]
    placeholder = [*image[:2], {"type": "function_call_output", "call_id": "v1",
                                "output": "[an image not shown: this model reads text only]"}]
    assert responses_tokens(server, image) == responses_tokens(server, placeholder)
    answered = server.client().responses.create(model="target", input=compacted + custom[1:] + shell[1:] + dropped[1:],
                                                max_output_tokens=4)
    assert answered.status in ("completed", "incomplete")
