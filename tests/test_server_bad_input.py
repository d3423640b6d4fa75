"""Bad input to `ggufspec serve`, through the real server process and raw HTTP: every one a one-line
400 (403, 404, 405) in the shape of the API its path belongs to, OpenAI's `{"error": {...}}` or, under
/v1/messages, Anthropic's `{"type": "error", "error": {...}}`; never a 500, a traceback or an answer
that breaks what was asked (a JSON schema the grammar cannot enforce is refused, not ignored)."""
from __future__ import annotations

import json

import httpx
import pytest

from ggufspec.errors import GgufspecError
from ggufspec.tools import ToolError, schema_grammar
from serverproc import pair_server_fixture

HI = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


server = pair_server_fixture("-c", "2048")  # a tool list is a few hundred of the tiny models' tokens


def post(server, path, body, **kwargs):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=30, **kwargs)


def openai_error(response, status=400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"], error
    return error


def anthropic_error(response, status=400, kind="invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and "\n" not in body["error"]["message"], body
    return body["error"]


# ---------------------------------------------------------------- chat completions: messages

@pytest.mark.parametrize("calls, says", [
    ("x", "messages[1].tool_calls must be an array"),
    ({"a": 1}, "messages[1].tool_calls must be an array"),
    ([5], "messages[1].tool_calls[0] must be an object"),
    ([{"function": "x"}], "messages[1].tool_calls[0].function must be an object"),
    ([{"function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function.name is required"),
])
def test_malformed_tool_calls_are_400s_not_500s(server, calls, says):
    for stream in (False, True):
        body = {"messages": [HI, {"role": "assistant", "tool_calls": calls}], "max_tokens": 2, "stream": stream}
        assert says in openai_error(post(server, "/v1/chat/completions", body))["message"]


def test_a_well_formed_call_history_is_still_answered(server):
    messages = [HI, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1",
                                                                  "content": "done"}]
    response = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("message, says", [
    ({"role": "wizard", "content": "hi"}, "messages[0].role must be"),
    ({"role": "user"}, "messages[0].content is required"),
    ({"role": "system", "content": None}, "messages[0].content is required"),
    ({"role": "assistant"}, "messages[0].content is required for an assistant message without tool_calls"),
    ({"role": "user", "content": [{"type": "weird", "text": "x"}]}, "unknown content part type 'weird'"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text is required"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "no images"),
])
def test_invalid_chat_messages_are_400s(server, message, says):
    error = openai_error(post(server, "/v1/chat/completions", {"messages": [message], "max_tokens": 2}))
    assert says in error["message"]
    if "weird" in says:
        assert "images" not in error["message"]


# ---------------------------------------------------------------- the Responses API

@pytest.mark.parametrize("body, says", [
    ({"input": []}, "input must not be empty"),
    ({"input": 5}, "input must be a string or an array"),
    ({"input": [1]}, "input[0] must be an object"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}]},
     "input[0].arguments must be a string"),
    ({"input": [{"role": "user"}]}, "input[0].content is required"),
    ({"input": "hi", "top_logprobs": 50}, "top_logprobs"),
])
def test_responses_errors_name_the_real_problem(server, body, says):
    error = openai_error(post(server, "/v1/responses", {**body, "max_output_tokens": 2}))
    assert says in error["message"] and ".str" not in error["message"], error


def test_a_call_output_without_its_call_is_accepted(server):
    """Stateless: a client may have trimmed the history that held the call."""
    item = {"type": "function_call_output", "call_id": "call_gone", "output": "done"}
    response = post(server, "/v1/responses", {"input": [item], "max_output_tokens": 2})
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------- Anthropic's Messages API

@pytest.mark.parametrize("body, says", [
    ({"messages": [HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                          "input": "notadict"}]}]}, "content[0].input"),
    ({"messages": [HI], "tools": [{"name": "f"}]}, "tools[0].input_schema is required"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text is required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string or an array"),
])
def test_malformed_anthropic_blocks_are_400s(server, body, says):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert says in anthropic_error(post(server, path, {**body, "max_tokens": 2}))["message"]


@pytest.mark.parametrize("field, value", [("temperature", 1.5), ("temperature", -0.1), ("top_p", 1.01),
                                          ("top_k", -1)])
def test_anthropic_sampling_values_outside_its_ranges_are_400s(server, field, value):
    """Anthropic's API takes temperature and top_p in 0-1 (OpenAI's temperature goes to 2)."""
    body = {"messages": [HI], "max_tokens": 2, field: value}
    assert field in anthropic_error(post(server, "/v1/messages", body))["message"]
    assert post(server, "/v1/messages", {**body, field: 1 if field != "top_k" else 0}).status_code == 200


# ---------------------------------------------------------------- HTTP itself

def test_head_answers_get_routes_without_a_body(server):
    for path in ("/health", "/v1/models", "/props"):
        response = httpx.head(server.url + path, timeout=10)
        assert response.status_code == 200 and response.content == b"", path
        assert int(response.headers["content-length"]) > 0 and response.headers["content-type"] == "application/json"


def test_a_refused_preflight_is_a_json_403_in_the_apis_shape(server):
    def preflight(path, origin):
        return httpx.options(server.url + path, timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
    refused = preflight("/v1/chat/completions", "http://evil.example")
    error = refused.json()["error"]
    assert refused.status_code == 403 and refused.headers["content-type"] == "application/json"
    assert error["type"] == "permission_error" and "http://evil.example" in error["message"]
    assert "access-control-allow-origin" not in refused.headers
    anthropic = anthropic_error(preflight("/v1/messages", "http://evil.example"), 403, "permission_error")
    assert "--cors-origins" in anthropic["message"]
    allowed = preflight("/v1/messages", "http://localhost:5173")
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_anthropic_paths_use_anthropic_client_error_types(server):
    not_allowed = anthropic_error(httpx.get(server.url + "/v1/messages", timeout=10), 405)
    assert "GET" in not_allowed["message"] and "POST" in not_allowed["message"]
    anthropic_error(httpx.post(server.url + "/v1/messages/nothing", json={}, timeout=10), 404, "not_found_error")
    openai_error(httpx.get(server.url + "/v1/chat/completions", timeout=10), 405)


def test_an_empty_or_non_object_body_says_so(server):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert "the request body is empty" in openai_error(post(server, path, b""))["message"]
        assert "must be a JSON object" in openai_error(post(server, path, b"[1]"))["message"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert "the request body is empty" in anthropic_error(post(server, path, b""))["message"]


def test_a_large_body_is_parsed_as_a_small_one(server):
    """Bodies from 64 KiB are parsed apart from their validation (`guard.validated`): a lone surrogate
    (a JavaScript client cutting an emoji in two) and a deep nesting are malformed JSON there too, 400s,
    not 500s once the text reached the tokenizer."""
    padding = "x" * 70_000
    surrogate = ('{"prompt": "%s \\ud800", "max_tokens": 1}' % padding).encode()
    nested = ('{"prompt": "%s", "max_tokens": 1, "extra": %s%s}' % (padding, "[" * 40_000, "]" * 40_000)).encode()
    for body in (surrogate, nested, surrogate[:200] + b"}"):
        for path in ("/v1/completions", "/tokenize"):
            assert "JSON" in openai_error(post(server, path, body))["message"]
    assert "JSON" in anthropic_error(post(server, "/v1/messages", surrogate))["message"]


# ---------------------------------------------------------------- JSON schemas the grammar cannot enforce

BOUNDED = {"type": "number", "minimum": 1e300, "maximum": 1e301}  # a number's bounds are followed below 2**63
NESTED = {"type": "object", "properties": {"n": {"type": "number", "exclusiveMaximum": 1e300}}, "required": ["n"]}
ANNOTATED = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x", "title": "flag",
             "description": "d", "$comment": "c", "type": "object", "required": ["ok"],
             "properties": {"ok": {"type": "boolean", "default": True, "examples": [True], "title": "ok"}}}


@pytest.mark.parametrize("path, body, says", [
    ("/v1/completions", {"prompt": "x", "json_schema": BOUNDED, "temperature": 1, "seed": 1}, "'minimum' at #"),
    ("/v1/completions", {"prompt": "x", "json_schema": {"enum": []}}, "enum at # is empty"),
    ("/v1/chat/completions", {"messages": [HI], "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": NESTED}}}, "response_format: the JSON schema's 'exclusiveMaximum' at #/properties/n"),
    ("/v1/chat/completions", {"messages": [HI], "response_format": {"type": "json_object", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}, "'uniqueItems' at #"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "string", "maxLength": 3, "pattern": "^a+b$"}}}},
     "text.format: the JSON schema's 'maxLength' at # cannot be enforced next to pattern"),
])
def test_schemas_with_constraints_the_grammar_would_drop_are_400s(server, path, body, says):
    error = openai_error(post(server, path, {**body, "max_tokens": 4}))
    assert says in error["message"] and error["code"] == "invalid_value", error


def test_anthropic_structured_output_refuses_them_too(server):
    body = {"messages": [HI], "max_tokens": 4, "output_config": {"format": {"type": "json_schema", "schema": BOUNDED}}}
    assert "'minimum' at #" in anthropic_error(post(server, "/v1/messages", body))["message"]


def test_annotations_and_tool_parameters_still_work(server):
    form = {"type": "json_schema", "json_schema": {"name": "flag", "schema": ANNOTATED}}
    answer = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 4, "response_format": form})
    assert answer.status_code == 200, answer.text
    # a tool's parameters are the model's to fill, not a format the answer is held to: not refused
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}}}}}
    called = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 4, "tools": [tool]})
    assert called.status_code == 200, called.text


@pytest.mark.parametrize("schema, says", [
    (BOUNDED, "'minimum' at #"),
    ({"type": "number", "multipleOf": 2}, "'multipleOf' at #"),
    ({"type": "object", "properties": {"a": {"type": "number", "exclusiveMinimum": -1e300}}}, "at #/properties/a"),
    ({"type": "array", "items": {"type": "number", "maximum": "3.5"}}, "'maximum' at #/items"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "bounds at # leave no integer"),
    ({"type": "integer", "multipleOf": 2}, "'multipleOf' at #"),
    ({"type": "array", "minItems": 1}, "'minItems' at #"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, "'minProperties' at #"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "required at # names 'b'"),
    ({"type": "string", "not": {"const": "x"}}, "'not' at #"),
    ({"type": "string", "pattern": "^a+b$", "maxLength": 3}, "'maxLength' at # cannot be enforced next to pattern"),
    ({"type": ["number", "null"], "maximum": 1e300}, "'maximum' at #/anyOf/0"),  # the list rewritten, the bound kept
    ({"anyOf": [{"type": "string"}], "type": "string"}, "'type' at # cannot be enforced next to anyOf"),
    ({"$defs": {"n": {"type": "number", "maximum": 1e300}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
     "'maximum' at #/$defs/n"),
    ({"enum": []}, "enum at # is empty"),
    # a pattern: its problem with its place (the converter took "^(a|b$" as a|b, and wrote "^a**$" as a
    # grammar llama.cpp refuses)
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a|b$"}}},
     "pattern at #/properties/a is not a regular expression: missing )"),
    ({"type": "string", "pattern": "^a**$"}, "pattern at # is not a regular expression: multiple repeat"),
    ({"type": "string", "pattern": "^[z-a]$"}, "pattern at # is not a regular expression: bad character range"),
    ({"type": "string", "pattern": 5}, "pattern at # must be a text"),
    ({"anyOf": [{"type": "string", "pattern": "^(?<=x)y$"}]}, "pattern at #/anyOf/0 cannot be followed: Unsupported"),
    ({"type": "string", "pattern": "^a|b"}, 'pattern at # cannot be followed: Pattern must start with "^"'),
    # values the converter tripped on with a Python error, looped on, or took as something else
    ({"$ref": 5}, "$ref at # must be a text"),
    ({"allOf": 5}, "allOf at # must be a non-empty list of schemas, got 5"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": 5}}}, "format at #/properties/a must be a text"),
    ({"type": "object", "additionalProperties": 5}, "additionalProperties at # must be true, false or a schema"),
    ({"enum": [1, float("nan")]}, "enum at # holds a value JSON cannot write (NaN"),
    ({"properties": False}, "properties at # must be an object of schemas, got false"),
    ({"$defs": {"a": {"$ref": 5}}, "type": "string"}, "$ref at #/$defs/a must be a text"),  # no schema refers to it
    ({"type": [{"type": "string"}]}, "type at # must be a type's name or a list of them"),
    ({"type": "object", "properties": {"a": {"type": "array", "prefixItems": "x"}}},
     "prefixItems at #/properties/a must be a list of schemas"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "'minItems' at # cannot be enforced next to prefixItems"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "$ref at #/properties/x leads back to itself (#/$defs/a -> #/$defs/b -> #/$defs/a)"),
    ({"anyOf": []}, "anyOf at # must be a non-empty list"),
    # a declared property came back as an additional one of another type ({"a": "hello"} for an integer a)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     "additionalProperties at # allows more keys beside properties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     "additionalProperties at # allows more keys"),
    # every answer had b, which part 0 forbids
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, "no object could follow both"),
])
def test_schema_grammar_refuses_what_the_converter_ignores(schema, says):
    with pytest.raises(ToolError) as caught:
        schema_grammar(schema)
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("schema", [
    ANNOTATED,
    {"type": "string", "minimum": 5},  # a number's bound says nothing of a string
    {"type": "string", "format": "date-time", "description": "when"},
    {"type": "integer", "format": "int32"},
    {"type": "string", "minLength": 1, "maxLength": 8},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "x"},
    {"type": ["string", "null"]},
    {"type": ["string", "null"], "maxLength": 3},  # rewritten as an anyOf: the bound is followed
    {"type": ["string", "null"], "enum": ["a", None]},  # the enum says it all
    {"type": "string", "format": "email"},  # a format is an annotation (JSON Schema), pydantic's EmailStr
    {"type": "integer", "minimum": 0},  # pydantic's Field(ge=0)
    {"type": ["integer", "null"], "exclusiveMaximum": 10},
    {"type": ["number", "null"], "minimum": 0, "maximum": 1},  # pydantic's float Field(ge=0, le=1)
    # pydantic's constr(pattern=..., max_length=10): one character repeated, counted by the lengths
    {"type": "string", "pattern": "^[a-z]+$", "maxLength": 10}, {"type": ["string", "null"], "pattern": "^\\d*$",
                                                                 "minLength": 2},
    # pydantic's tuple[int, str]: the grammar writes exactly the two items, which its bounds allow
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"a": {"title": "A"}}},  # annotations alone: any value (pydantic's Any)
    {"type": "object", "properties": {"type": {"type": "string"}, "enum": {"type": "integer"}},
     "required": ["type", "enum"]},  # properties named like keywords stay properties
    {"$defs": {"A": {"type": ["string", "null"], "maxLength": 2}}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/A"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/a", "description": "d"}}, "required": ["a"],
     "additionalProperties": False, "$defs": {"a": {"const": 1}}},
])
def test_schema_grammar_still_takes_what_it_follows(schema):
    assert "root ::=" in schema_grammar(schema)


def test_a_recursive_pydantic_model_is_followed():
    """pydantic writes a model that holds itself as {"$defs": {"Node": ...}, "$ref": "#/$defs/Node"}: the
    converter's resolve_refs stopped at the root's $ref and left the one inside $defs unresolved."""
    node = {"type": "object", "required": ["name", "children"], "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}
    grammar = schema_grammar({"$defs": {"Node": node}, "$ref": "#/$defs/Node"})
    assert "children-item ::= Node" in grammar and "root ::=" in grammar, grammar


def test_the_cli_flag_is_a_one_line_error():
    from ggufspec.cli.constraint_options import schema_grammar as flag_grammar
    with pytest.raises(GgufspecError) as caught:
        flag_grammar(json.dumps(BOUNDED), "--json-schema")
    assert str(caught.value).startswith("--json-schema: the JSON schema's 'minimum' at #")
    assert "\n" not in str(caught.value)


def test_a_list_of_types_keeps_each_types_bounds():
    """{"type": ["string", "null"], "maxLength": 3}: the converter alone would write any string."""
    from ggufspec.schemafollow import normalized
    assert normalized({"type": ["string", "null"], "maxLength": 3, "title": "t"}) == {
        "title": "t", "anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}
    assert normalized({"type": "string", "enum": ["a"], "default": {"type": ["x"]}}) == {
        "enum": ["a"], "default": {"type": ["x"]}}  # data is not rewritten
    grammar = schema_grammar({"type": ["string", "null"], "maxLength": 3})
    assert "char{0,3}" in grammar and "null" in grammar, grammar


def test_an_answer_cut_short_by_the_shutdown_says_so(chat_pair, tmp_path):
    """SIGTERM while an answer streams: the client keeps what it was sent, then an error event with
    code shutting_down, not a finish_reason that says the answer is whole (the server still exits 0)."""
    import signal

    from serverproc import start_server
    target, draft = chat_pair
    server = start_server(tmp_path, "-m", str(target), "-md", str(draft), "-c", "4096")
    events = []
    body = {"messages": [HI], "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if len(events) == 20:
                    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    errors = [e["error"] for e in events if "error" in e]
    assert not finishes and errors and errors[-1]["code"] == "shutting_down", events[-3:]


# ---------------------------------------------------------------- llama.cpp's samplers

def test_llamacpps_samplers_are_taken_and_bad_values_are_400s(server):
    """llama.cpp's samplers (tests/test_llamacpp_samplers.py, tests/test_dry.py, tests/test_mirostat.py): set per
    request, the filters shown in the answer's generation_settings; a value out of range is a 400 naming
    the field, in Anthropic's shape on /v1/messages."""
    chain = {"typical_p": 0.9, "top_n_sigma": 1.5, "xtc_probability": 0.5, "xtc_threshold": 0.2,
             "dynatemp_range": 0.3, "dynatemp_exponent": 2.0, "mirostat": 0, "mirostat_tau": 4.0, "mirostat_eta": 0.2}
    dry = {"dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 1, "dry_penalty_last_n": -1,
           "dry_sequence_breakers": ["\n", ":"]}
    for path, body in (("/completion", {"prompt": "the cat", "n_predict": 4, "temperature": 0.8, "seed": 3}),
                       ("/v1/chat/completions", {"messages": [HI], "max_tokens": 4, "temperature": 0.8, "seed": 3})):
        answer = post(server, path, {**body, **chain, **dry})
        assert answer.status_code == 200, answer.text
        if path == "/completion":
            assert {name: answer.json()["generation_settings"][name] for name in chain} == chain
        for field, bad in (("typical_p", -1.0), ("xtc_probability", 1.5), ("top_n_sigma", "wide"),
                           ("dynatemp_exponent", -1.0), ("dry_base", 0.5), ("dry_allowed_length", -1),
                           ("dry_penalty_last_n", -2), ("dry_sequence_breakers", []),
                           ("dry_sequence_breakers", "\n"), ("dry_multiplier", "much"), ("mirostat", 3),
                           ("mirostat_tau", "high")):
            error = openai_error(post(server, path, {**body, field: bad}))
            assert field in error["message"] and "\n" not in error["message"], error
    messages = {"messages": [HI], "max_tokens": 4, "temperature": 0.8, **dry, "dynatemp_range": 0.3}
    assert post(server, "/v1/messages", messages).status_code == 200
    assert post(server, "/v1/messages", {**messages, "mirostat": 2, "samplers": "pk"}).status_code == 200
    assert "dry_base" in anthropic_error(post(server, "/v1/messages", {**messages, "dry_base": 0.2}))["message"]


def test_ignore_eos_generates_past_the_end_of_generation_tokens(server):
    """llama.cpp's ignore_eos: every end-of-generation token ruled out, so the answer runs to n_predict."""
    body = {"prompt": "the cat", "n_predict": 6, "logit_bias": [[2, 100]], "return_tokens": True}  # 2: the EOS
    assert post(server, "/completion", body).json()["tokens"] == []
    ignoring = post(server, "/completion", {**body, "ignore_eos": True}).json()
    assert len(ignoring["tokens"]) == 6 and ignoring["stop_type"] == "limit" and 2 not in ignoring["tokens"]
    chat = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 6, "logit_bias": {"2": 100},
                                                 "ignore_eos": True}).json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 6


# ---------------------------------------------------------------- the agents' APIs, as their own APIs check

@pytest.mark.parametrize("body, says", [
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools[0].name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_responses_errors_use_the_responses_names_and_ranges(server, body, says):
    error = openai_error(post(server, "/v1/responses", {**body, "max_output_tokens": 3}))
    assert says in error["message"] and "function" not in error["message"].replace("function_call", ""), error


@pytest.mark.parametrize("body, says", [
    ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": 5, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool"}},
     "tool_choice.name is required"),
])
def test_anthropic_bodies_are_checked_as_anthropic_checks_them(server, body, says):
    assert says in anthropic_error(post(server, "/v1/messages", {"messages": [HI], **body}))["message"]


def test_anthropic_max_tokens_0_puts_the_prompt_in_the_cache_and_answers_nothing(server):
    """The SDK documents max_tokens 0: "populate the prompt cache without generating a response"."""
    response = post(server, "/v1/messages", {"messages": [HI], "max_tokens": 0})
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [] and response.json()["usage"]["output_tokens"] == 0


# ---------------------------------------------------------------- bounds that are not whole; "$ref" as data

def test_a_number_between_bounds_that_are_not_whole_is_followed(server):
    """response_format's minimum 0.5 and maximum 2.75 (a 400 while only whole bounds were followed)."""
    from decimal import Decimal
    schema = {"type": "object", "required": ["x"], "properties": {"x": {"type": "number", "minimum": 0.5,
                                                                        "maximum": 2.75}}}
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    whole = 0
    for seed in range(4):
        response = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 48, "temperature": 1,
                                                         "seed": seed, "response_format": form})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            whole += 1
            value = json.loads(choice["message"]["content"], parse_float=Decimal)["x"]
            assert Decimal("0.5") <= value <= Decimal("2.75"), choice
    assert whole


REF_AS_DATA = [
    {"type": "object", "properties": {"a": {"const": {"$ref": "x"}}}, "required": ["a"]},
    {"enum": [{"$ref": "#/nope"}, {"$ref": "#/$defs"}]},
    {"type": "string", "default": {"$ref": "#/nope"}, "examples": [{"$ref": 5}]},
    {"type": "object", "properties": {"$ref": {"type": "string"}}, "required": ["$ref"]},  # a property's name
    {"$defs": {"v": {"const": {"$ref": "#/$defs/v"}}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/v"}},
     "required": ["a"]},
]


@pytest.mark.parametrize("schema", REF_AS_DATA)
def test_a_ref_key_in_data_is_data(schema, tiny_decoder):
    """llama-cpp-python's resolve_refs took every {"$ref": ...} for a reference, a const's, an enum's or a
    default's value too ("Unsupported ref x", "Error resolving ref #/nope") or a property named $ref
    ("unhashable type: 'dict'"), and wrote #/$defs as stdin#/$defs in a literal the answer must equal."""
    from ggufspec.processing import Constraints, Grammar
    grammar = schema_grammar(schema)
    assert "stdin" not in grammar, grammar
    Grammar(tiny_decoder.target.vocab, Constraints(grammar=grammar))  # llama.cpp's parser takes it
    for value in schema.get("enum", []):  # a tree of its values (gbnftrie): each taken whole, by llama.cpp
        assert takes(Grammar(tiny_decoder.target.vocab, Constraints(grammar=grammar)), json.dumps(value)), value
    if (value := schema.get("properties", {}).get("a", {}).get("const")) is not None:
        assert json.dumps(json.dumps(value))[1:-1] in grammar, (value, grammar)


def takes(grammar, text: str) -> bool:
    """Whether the grammar takes `text` whole, byte token by byte token (the tiny vocabulary's <0xNN>: id 3 + NN),
    and may end there (</s>, id 2, allowed)."""
    import numpy as np
    for token in [3 + byte for byte in text.encode()]:
        if not grammar.allows(np.array([token]), np.zeros(1, np.float32))[0]:
            return False
        grammar.accept(token)
    return bool(grammar.allows(np.array([2]), np.zeros(1, np.float32))[0])


def test_a_tools_parameters_with_a_ref_key_in_data():
    from ggufspec import tools as toolkit
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"mode": {"enum": [{"$ref": "x"}, "plain"], "default": {"$ref": "#/y"}}}}}}
    hermes = toolkit.detect_format("{% if tools %}<tool_call>{% endif %}")
    assert json.dumps(json.dumps({"$ref": "x"}))[1:-1] in toolkit.call_grammar(toolkit.check_tools([tool]), hermes)


def test_a_const_with_a_ref_key_is_answered_literally(server):
    value = {"$ref": "#/$defs/v", "n": [1, {"$ref": "y"}]}
    schema = {"$defs": {"v": {"type": "string"}}, "type": "object", "properties": {"a": {"const": value}},
              "required": ["a"], "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    response = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 60, "response_format": form})
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["choices"][0]["message"]["content"]) == {"a": value}


def test_a_ref_that_leads_nowhere_is_still_a_one_line_400():
    with pytest.raises(ToolError) as caught:
        schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}})
    assert "#/$defs/none" in str(caught.value) and "\n" not in str(caught.value)
