"""What agents need of `ggufspec serve`, through the real server process: tools (forced by a grammar,
parsed into tool_calls, streamed), structured output (response_format, grammar, json_schema),
logprobs, logit_bias and penalties, n choices, /tokenize and /detokenize, a model without a chat
template, and each bad value as a 400 naming its field.

The tiny chat pair wherever the behaviour does not need a real model (under a grammar a random model
still writes a valid call); the demo pair (slow) for a real model's tool call and JSON answer. Tests of
what the engine computes (constraints, logprobs) are skipped until the engine takes them."""
from __future__ import annotations

import json
import math

import anthropic
import httpx
import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.tinymodels import Shape, make_weights, write_model
from serverproc import pair_server_fixture, start_server, stop_server

N_CTX = 2048  # the tiny models write text byte by byte: a tool list is a few hundred tokens

UNIT = {"type": "function", "function": {
    "name": "set_unit", "description": "choose the temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
HI = [{"role": "user", "content": "hi"}]

server = pair_server_fixture("-c", str(N_CTX))


@pytest.fixture(scope="module")
def reference(chat_pair):
    target, draft = chat_pair
    with SpeculativeDecoder(target, draft, n_ctx=N_CTX, n_threads=1) as decoder:
        yield decoder


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def sse_chunks(server, body) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------- tokenizer endpoints

def test_tokenize_and_detokenize(server, reference):
    llm = reference.target_llm
    tokens = post(server, "/tokenize", {"content": "the cat"}).json()["tokens"]
    assert tokens == llm.tokenize(b"the cat", add_bos=False, special=True)
    with_bos = post(server, "/tokenize", {"content": "the cat", "add_special": True}).json()["tokens"]
    assert with_bos == [llm.token_bos()] + tokens
    pieces = post(server, "/tokenize", {"content": "the cat\u00e9", "with_pieces": True}).json()["tokens"]
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw == llm.detokenize([p["id"] for p in pieces], special=True) and raw.decode().endswith("cat\u00e9")
    assert any(isinstance(p["piece"], list) for p in pieces)  # a byte token of the split character: its bytes
    assert post(server, "/detokenize", {"tokens": tokens}).json() == {"content": llm.detokenize(tokens).decode()}
    bad = post(server, "/detokenize", {"tokens": [5, 10 ** 9]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


# ---------------------------------------------------------------- n choices

def test_n_choices_each_its_own_seed(server, reference):
    client = server.client()
    answer = client.completions.create(model="target", prompt="the cat", max_tokens=12, n=3, temperature=0.9,
                                       seed=7, extra_body={"draft": 3})
    expected = [reference.generate("the cat", n_predict=12, n_draft=3, temperature=0.9, seed=7 + i) for i in range(3)]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    assert answer.usage.completion_tokens == sum(len(e.tokens) for e in expected)
    greedy = reference.chat(HI, n_predict=10).text
    chunks = sse_chunks(server, {"messages": HI, "max_tokens": 10, "n": 2})
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {0: greedy, 1: greedy}
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]


# ---------------------------------------------------------------- chat templates

@pytest.fixture(scope="module")
def bare_target(tmp_path_factory):
    shape = Shape(eos_bias=4.0)
    return write_model(tmp_path_factory.mktemp("bare") / "bare.gguf", shape, make_weights(shape, 0), chat_template=None)


def test_a_model_without_a_chat_template_answers_in_chatml(bare_target, tmp_path):
    running = start_server(tmp_path, "-m", str(bare_target), "--no-draft", "-c", "512")
    try:
        props = httpx.get(running.url + "/props", timeout=10).json()
        assert props["chat_template_fallback"] is True and "<|im_start|>" in props["chat_template"]
        answer = running.client().chat.completions.create(model="bare", messages=HI, max_tokens=8)
        with SpeculativeDecoder(bare_target, n_ctx=512, n_threads=1) as decoder:
            expected = decoder.chat(HI, n_predict=8)
            prompt = decoder.tokenize(decoder.render_chat(HI))
        assert answer.choices[0].message.content == expected.text
        assert answer.usage.prompt_tokens == len(prompt)
        assert "no chat template" in running.log.read_text()
    finally:
        stop_server(running)


def test_props_name_the_template_and_its_tool_format(server):
    props = httpx.get(server.url + "/props", timeout=10).json()
    assert props["chat_template_fallback"] is False and props["chat_template_tool_format"] == "hermes"
    assert props["chat_template_tools"] is False  # the tiny template knows no tools: a system message teaches them
    assert "draft_choice" in props


def test_a_conversation_with_calls_and_results_is_rendered(server, reference):
    from ggufspec import load, tools
    messages = [{"role": "user", "content": "which unit?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "set_unit",
                                                                      "arguments": '{"unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    answer = server.client().chat.completions.create(model="target", messages=messages, tools=[UNIT],
                                                     tool_choice="none", max_tokens=4)
    fmt = tools.detect_format(load.chat_template(reference.target_llm).text)
    prompt = load.render_chat(reference.target_llm, tools.prepare_messages(messages, fmt, None))  # "none": no tools offered
    assert "<tool_response>\ndone\n</tool_response>" in prompt and '"unit": "celsius"' in prompt
    assert answer.usage.prompt_tokens == len(reference.tokenize(prompt))


def test_a_logit_bias_key_that_is_text_biases_each_of_its_tokens_as_llama_server_does(server):
    """llama-server tokenizes a key that is no integer (no BOS, special tokens as text), in both forms."""
    tokens = post(server, "/tokenize", {"content": "the cat"}).json()["tokens"]

    def answer(bias) -> str:
        body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "logit_bias": bias}
        return post(server, "/v1/completions", body).json()["choices"][0]["text"]
    by_ids = answer({str(t): 100 for t in tokens})
    assert len(tokens) > 1 and by_ids != answer({})
    assert answer({"the cat": 100}) == answer([["the cat", 100]]) == by_ids


# ---------------------------------------------------------------- bad values: 400, the field named

@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repeat_penalty": -1}, "repeat_penalty"),
    ("/v1/completions", {"prompt": "x", "repeat_last_n": -2}, "repeat_last_n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [[None, 1]]}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "grammar": "  "}, "grammar"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= x", "json_schema": {}}, "grammar"),
    ("/v1/completions", {"prompt": "x", "json_schema": {"$ref": "https://example.com/s.json"}}, "schema"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "tools": [UNIT], "tool_choice": {"type": "function",
                                                                                "function": {"name": "nope"}}}, "nope"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, "tools[0]"),
    # malformed named choices and schemas whose keywords are of the wrong type (these were 500s)
    ("/v1/chat/completions", {"messages": HI, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "tools": [UNIT], "tool_choice": {"type": "function",
                                                                                "function": {"name": ["f"]}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5}}}},
     "required"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"allOf": [{"$ref": 5}]}}}}, "response_format"),
])
def test_bad_values_name_their_field(server, path, body, message):
    for stream in (False, True):
        response = post(server, path, {**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and "\n" not in error["message"] and "--" not in error["message"]
    assert server.health()["status"] == "ok"


@pytest.mark.parametrize("field, value", [("max_tokens", "5"), ("max_tokens", True), ("stream", "yes"),
                                          ("stream", 1), ("temperature", True), ("n", "2"), ("seed", "12"),
                                          ("logprobs", "true"), ("draft", True), ("frequency_penalty", "0.5"),
                                          ("repeat_last_n", "64"), ("lookup", "yes"), ("cache_prompt", 0),
                                          ("parallel_tool_calls", "true")])
def test_types_are_strict_as_openai_checks_them(server, field, value):
    error = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, field: value}).json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_null_where_openai_allows_it_means_the_default(server):
    body = {"messages": HI, "max_tokens": 2, "temperature": 0, "n": None, "stream": None, "logprobs": None,
            "ignore_eos": None, "stream_options": {"include_usage": None}}
    answer = post(server, "/v1/chat/completions", body)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 1, answer.text
    assert "logprobs" not in answer.json()["choices"][0] or answer.json()["choices"][0]["logprobs"] is None


def test_a_developer_message_is_the_system_message(server):
    prompts = [post(server, "/apply-template", {"messages": [{"role": role, "content": "Answer in French."}, *HI]})
               .json()["prompt"] for role in ("developer", "system")]
    assert prompts[0] == prompts[1] and "Answer in French." in prompts[0]


def test_an_infinite_bound_in_a_schema_is_a_400(server):
    for stream in (b"false", b"true"):  # 1e400 parses as infinity (the JSON is written here: Python's cannot)
        body = b'{"prompt": "x", "max_tokens": 2, "stream": %s, "json_schema": {"type": "integer", "minimum": 1e400}}'
        error = httpx.post(server.url + "/v1/completions", content=body % stream, timeout=60).json()["error"]
        assert "'minimum'" in error["message"] and "must be a number" in error["message"], error


def test_a_grammar_llama_cpp_cannot_parse_is_a_400(server):
    response = post(server, "/v1/completions", {"prompt": "x", "grammar": "root ::= undefined-rule"})
    assert response.status_code == 400, response.text


# ---------------------------------------------------------------- what the engine computes

def test_chat_logprobs_whole_and_streamed(server):
    client = server.client()
    for draft in (3, 0):
        answer = client.chat.completions.create(model="target", messages=HI, max_tokens=12, logprobs=True,
                                                top_logprobs=3, extra_body={"draft": draft})
        entries = answer.choices[0].logprobs.content
        assert len(entries) == answer.usage.completion_tokens
        for entry in entries:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-3)  # greedy: the likeliest
            raw = bytes(entry.bytes)  # a part of a character is written as OpenAI writes it
            assert entry.token == (raw.decode() if raw.decode(errors="ignore").encode() == raw else
                                   "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
        if draft:
            speculative = [e.logprob for e in entries]
        else:  # draft-accepted tokens carry their own logprob, the target's, as the target alone gives it
            assert [e.logprob for e in entries] == pytest.approx(speculative, abs=1e-3)
    chunks = sse_chunks(server, {"messages": HI, "max_tokens": 12, "logprobs": True, "top_logprobs": 3})
    streamed = [e["logprob"] for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == pytest.approx(speculative, abs=1e-3)


def test_completion_logprobs_in_the_legacy_shape(server):
    answer = server.client().completions.create(model="target", prompt="the cat", max_tokens=10, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == 10
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # a token that is part of a character is OpenAI's "bytes:\xNN": distinct keys, none lost to "\ufffd"
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert "\ufffd" not in token and top[token] == pytest.approx(value, abs=1e-3)  # greedy: the likeliest
    if not any(token.startswith("bytes:") for token in logprobs.tokens):
        assert "".join(logprobs.tokens) == answer.choices[0].text


def test_logprobs_under_a_grammar_leave_out_the_tokens_it_rules_out(server):
    """Fewer tokens allowed than alternatives asked for: the ruled-out ones (-inf, no JSON number)
    are left out, as OpenAI does, instead of a 500 or a stream that is not JSON."""
    grammar = 'root ::= "ab"'
    chat = {"messages": HI, "max_tokens": 5, "grammar": grammar, "logprobs": True, "top_logprobs": 3}
    answer = post(server, "/v1/chat/completions", chat)
    assert answer.status_code == 200, answer.text
    for entry in answer.json()["choices"][0]["logprobs"]["content"]:
        assert 1 <= len(entry["top_logprobs"]) <= 3 and entry["top_logprobs"][0]["logprob"] > -1e9
    streamed = [top["logprob"] for chunk in sse_chunks(server, chat)
                for entry in ((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
                for top in entry["top_logprobs"]]
    assert streamed and all(math.isfinite(value) for value in streamed)  # Python's json reads -Infinity
    completion = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 5, "grammar": grammar, "logprobs": 2})
    assert completion.status_code == 200, completion.text
    native = post(server, "/completion", {"prompt": "x", "n_predict": 5, "grammar": grammar, "n_probs": 2})
    assert native.status_code == 200, native.text


def test_a_token_that_is_part_of_a_character_is_written_as_its_bytes():
    from ggufspec.server.choices import logprob_entry, token_string
    assert [token_string(b) for b in (b"\xf0\x9f", "é".encode(), b"<|im_end|>")] == ["bytes:\\xf0\\x9f", "é", "<|im_end|>"]
    entry = logprob_entry(b"\xf0\x9f", -0.5, [(b"\xf0\x9f", -0.5), (b"\xe4\xb8", -1.5)])
    assert [t["token"] for t in entry["top_logprobs"]] == ["bytes:\\xf0\\x9f", "bytes:\\xe4\\xb8"]
    assert entry["bytes"] == [0xf0, 0x9f]


def test_logit_bias_bans_and_forces_tokens(server, reference):
    from ggufspec.processing import Constraints
    first = reference.generate("the cat", n_predict=4).tokens[0]
    without_first = reference.generate("the cat", n_predict=4, constraints=Constraints(logit_bias={first: -100}))
    assert without_first.tokens[0] != first
    client = server.client()
    banned = client.completions.create(model="target", prompt="the cat", max_tokens=4, logit_bias={str(first): -100})
    assert banned.choices[0].text == without_first.text
    forced = post(server, "/tokenize", {"content": "Z"}).json()["tokens"][-1]
    answer = client.completions.create(model="target", prompt="the cat", max_tokens=3, logit_bias={str(forced): 100})
    assert answer.choices[0].text == "ZZZ"


def test_penalties_reach_the_engine(server, reference):
    from ggufspec.processing import Constraints
    options = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repeat_penalty": 1.3, "repeat_last_n": 16}
    expected = reference.generate("the cat", n_predict=16, n_draft=3, constraints=Constraints(**options)).text
    answer = server.client().completions.create(model="target", prompt="the cat", max_tokens=16,
                                                frequency_penalty=1.5, presence_penalty=0.5,
                                                extra_body={"repeat_penalty": 1.3, "repeat_last_n": 16, "draft": 3})
    assert answer.choices[0].text == expected


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_a_forced_tool_call_is_valid_and_the_same_speculating_or_not(server, tool_choice):
    client = server.client()
    calls = []
    for draft in (3, 0):
        # one whole call, room for it to end: more calls, or one cut short, end at max_tokens ("length")
        answer = client.chat.completions.create(model="target", messages=HI, tools=[UNIT], tool_choice=tool_choice,
                                                max_tokens=128, parallel_tool_calls=False, extra_body={"draft": draft})
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "set_unit" and call.id.startswith("call_")
        assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
        calls.append((call.function.name, call.function.arguments, choice.message.content))
    assert calls[0] == calls[1]
    chunks = sse_chunks(server, {"messages": HI, "tools": [UNIT], "tool_choice": tool_choice, "max_tokens": 128,
                                 "parallel_tool_calls": False})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [call for d in deltas for call in d.get("tool_calls") or []]
    # sent as the model writes it (test_callstream): the name, then the arguments over several deltas,
    # spaced as written (the whole answer's are json.dumps'): the same object
    assert {c["index"] for c in streamed} == {0} and streamed[0]["function"]["name"] == "set_unit"
    assert len(streamed) > 1 and not any("name" in c["function"] for c in streamed[1:])
    arguments = "".join(c["function"]["arguments"] for c in streamed)
    assert json.loads(arguments) == json.loads(calls[0][1])
    assert not "".join(d.get("content") or "" for d in deltas)  # the call's raw text never shows as content
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    # no delta says content "" either: the SDK's stream helper keeps it, where the whole answer has None
    assert all(d.get("content") is None for d in deltas), deltas
    with client.chat.completions.stream(model="target", messages=HI, tools=[UNIT], tool_choice=tool_choice,
                                        max_tokens=128, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion().choices[0].message
    assert final.content is None and final.tool_calls[0].function.arguments == arguments


WRITE_FILE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "required": ["path", "content"], "additionalProperties": False,
    "properties": {"path": {"type": "string", "maxLength": 4096}, "content": {"type": "string", "maxLength": 100000}}}}}


def test_long_length_bounds_are_followed_not_fatal(server):
    """An agent's write_file tool (content up to 100,000 characters) and a schema's 20,000-item array:
    once a stack overflow that took the server down, now grammars llama.cpp parses (schemafollow.repetition)."""
    client = server.client()
    answer = client.chat.completions.create(model="target", messages=HI, tools=[WRITE_FILE], max_tokens=24,
                                            tool_choice={"type": "function", "function": {"name": "write_file"}})
    assert answer.choices[0].finish_reason in ("tool_calls", "length")
    items = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 20000}
    response = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 16, "response_format": {
        "type": "json_schema", "json_schema": {"name": "flags", "schema": items}}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith("[")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_json_schema_answers_parse_and_are_the_same_speculating_or_not(server):
    client = server.client()
    texts = []
    for draft in (3, 0):
        answer = client.chat.completions.create(
            model="target", messages=HI, max_tokens=48, extra_body={"draft": draft},
            response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}})
        texts.append(answer.choices[0].message.content)
        assert isinstance(json.loads(texts[-1])["ok"], bool)
    assert texts[0] == texts[1]
    raw = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 48, "json_schema": FLAG}).json()
    assert isinstance(json.loads(raw["choices"][0]["text"])["ok"], bool)
    grammar = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "grammar": 'root ::= "yes" | "no"'})
    assert grammar.json()["choices"][0]["text"] in ("yes", "no")


def test_a_token_longer_than_32_bytes_is_detokenized_whole(tmp_path):
    """llama-cpp-python's Llama.detokenize gives 32 bytes a token: /detokenize, /tokenize's pieces and
    /completion's prompt came back empty for one longer (runs of spaces or dashes in code models)."""
    from ggufspec.server.tokens import DetokenizeBody, detokenize_tokens
    from ggufspec.tinymodels import vocabulary
    vocab, _ = vocabulary()
    vocab[280] = "▁" + "-" * 48
    shape = Shape()
    path = write_model(tmp_path / "long.gguf", shape, make_weights(shape, 0), tokens=vocab)
    with SpeculativeDecoder(path, n_ctx=256, n_threads=1) as decoder:
        assert detokenize_tokens(decoder, DetokenizeBody(tokens=[280, 280]))["content"].strip() == \
            "-" * 48 + " " + "-" * 48


def test_tools_beside_a_response_format_answer_with_a_call_or_in_the_format(server):
    """OpenAI's API takes both (Codex's exec --output-schema, the Agents SDK's output_type): each was a 400.
    Under auto the answer is a valid call or JSON of the format; a forced call is a call (audit)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}}
    pieces = post(server, "/tokenize", {"content": "<tool_call>", "with_pieces": True}).json()["tokens"]
    call_start = next(t["id"] for t in pieces if t["piece"] == "<")  # the tiny vocabulary writes it byte by byte
    kinds = set()
    for bias in ({}, {str(call_start): 30}):  # the tiny model answers in JSON; a bias makes it call
        answer = server.client().chat.completions.create(
            model="target", messages=HI, tools=[UNIT], response_format=fmt, max_tokens=96, logit_bias=bias,
            parallel_tool_calls=False)
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content)["ok"], bool)
        kinds.add(bool(choice.message.tool_calls))
    assert kinds == {True, False}
    forced = server.client().chat.completions.create(model="target", messages=HI, tools=[UNIT], response_format=fmt,
                                                      tool_choice="required", max_tokens=96, parallel_tool_calls=False)
    assert forced.choices[0].finish_reason == "tool_calls"
    flat = {"type": "function", "name": "set_unit", "parameters": UNIT["function"]["parameters"]}
    response = server.client().responses.create(model="target", input="hi", tools=[flat], max_output_tokens=96,
                                                text={"format": {"type": "json_schema", "name": "flag", "schema": FLAG}})
    assert response.status == "completed" and response.output[-1].type in ("function_call", "message")
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    message = claude.messages.create(model="any", max_tokens=96, messages=HI, tools=[
        {"name": "set_unit", "input_schema": UNIT["function"]["parameters"]}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": FLAG}}})
    assert message.stop_reason in ("tool_use", "end_turn")


@pytest.fixture(scope="module")
def mistral_target(tmp_path_factory):
    """The tiny target with Mistral's [TOOL_CALLS] as a control token (it prints nothing) and a template naming it."""
    import gguf
    from ggufspec.tinymodels import CHAT_TEMPLATE, vocabulary
    shape = Shape(eos_bias=4.0)
    tokens, types = vocabulary()
    tokens[-1], types[-1] = "[TOOL_CALLS]", gguf.TokenType.CONTROL
    template = CHAT_TEMPLATE + "{% if false %}{{ tools }}[TOOL_CALLS]{% endif %}"
    return write_model(tmp_path_factory.mktemp("mistral") / "mistral.gguf", shape, make_weights(shape, 0),
                       chat_template=template, tokens=tokens, types=types)


def test_a_call_opened_by_a_control_token_is_parsed_forced_or_beside_a_format(mistral_target, tmp_path):
    """[TOOL_CALLS] prints nothing: its text is put back so the call parses. It was only where a lazy grammar
    waited for it; a forced call, or a call under a format's grammar, came back as content (a review)."""
    running = start_server(tmp_path, "-m", str(mistral_target), "--no-draft", "-c", "1024")
    try:
        marker = post(running, "/tokenize", {"content": "[TOOL_CALLS]"}).json()["tokens"]
        assert len(marker) == 1 and httpx.get(running.url + "/props", timeout=10).json()[
            "chat_template_tool_format"] == "mistral"
        fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
        for extra in ({"tool_choice": "required"}, {"response_format": fmt}):
            answer = running.client().chat.completions.create(
                model="mistral", messages=HI, tools=[UNIT], max_tokens=64, parallel_tool_calls=False,
                logit_bias={str(marker[0]): 100}, **extra)  # the control token, not "[" written byte by byte
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (extra, choice)
            assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
    finally:
        stop_server(running)
