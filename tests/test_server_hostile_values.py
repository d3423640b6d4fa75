"""Values a hostile or careless client sends to `ggufspec serve`, found by an adversarial audit of the real
process: each a one-line 400 (415) in the API's shape, or taken as llama-server takes it, never a 500, a
traceback in the log (stop_server checks), a stream cut short, or seconds of work that hold a slot.
Through the real server process and raw HTTP."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from ggufspec.server.errors import APIError
from ggufspec.server.resumable import _offset
from serverproc import serving

HI = {"role": "user", "content": "hi"}
DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's recursion limit


@pytest.fixture(scope="module")
def server(chat_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "slots").mkdir()
    with serving(folder, "-m", str(chat_pair[0]), "-md", str(chat_pair[1]), "-c", "1024",
                 "--slot-save-path", str(folder / "slots")) as running:
        yield running


def post(server, path, body, **kwargs):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60, **kwargs)


def error_400(response, says: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert says in message and "\n" not in message, message


@pytest.mark.parametrize("path, says", [("/slots/0?action=save", '{"filename": "NAME"}'),
                                        ("/lora-adapters", '[{"id": N, "scale": S}, ...]'),
                                        ("/v1/streams/lookup", '{"conversation_ids": ["ID", ...]}')])
def test_json_nested_past_pythons_recursion_is_malformed_json(server, path, says):
    error_400(post(server, path, DEEP), f"malformed JSON body: send {says}")


def test_numbers_past_pythons_digit_limit_in_a_path_or_query_are_400s(server):
    error_400(post(server, "/slots/" + "1" * 5000 + "?action=save", {"filename": "a"}), "Invalid slot ID")
    with pytest.raises(APIError, match="Invalid 'from' offset"):
        _offset("1" * 5000)


@pytest.mark.parametrize("field, value", [("min_keep", 2 ** 70), ("t_max_predict_ms", 10 ** 400)])
def test_whole_numbers_past_a_floats_range_are_taken(server, field, value):
    """llama-server's fields: a min_keep past the vocabulary keeps every token; a time limit past 30,000
    years is none."""
    response = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 3, field: value})
    assert response.status_code == 200, response.text


def test_a_ping_interval_past_a_floats_range_streams_the_whole_answer(server):
    body = {"messages": [HI], "max_tokens": 3, "stream": True, "sse_ping_interval": 10 ** 400}
    with httpx.stream("POST", server.url + "/v1/chat/completions", content=json.dumps(body), timeout=60) as response:
        raw = b"".join(response.iter_bytes())
    assert response.status_code == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]


@pytest.mark.parametrize("field, value, says", [
    ("samplers", "k" * 20_000, "samplers: String should have at most 64 characters"),
    ("samplers", ["top_k"] * 20_000, "samplers: List should have at most 64 items"),
    ("dry_sequence_breakers", [f"b{i}" for i in range(20_000)], "dry_sequence_breakers: List should have at most 64")])
def test_lists_whose_checks_would_cost_seconds_are_refused_at_once(server, field, value, says):
    """`samplers`' order was checked pair by pair (48 s for 20,000 letters), and llama.cpp matches each DRY
    breaker against the whole vocabulary: at most 64 of either."""
    started = time.monotonic()
    error_400(post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2, field: value,
                                                    "dry_multiplier": 0.8}), says)
    assert time.monotonic() - started < 5


def test_a_long_stop_string_costs_no_more_than_a_short_one(server):
    """Each token's check for a stop string just begun compared every prefix of it (8-17 s for one of
    300,000 characters); now the tail from each place its first character appears."""
    started = time.monotonic()
    response = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 16, "stop": ["a" * 300_000]})
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 10


def test_a_schema_with_too_many_optional_properties_says_what_to_do(server):
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(3000)}}
    body = {"messages": [HI], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}}
    error_400(post(server, "/v1/chat/completions", body), "3000 optional properties")


def test_a_tools_wide_parameters_are_not_refused(server):
    """The cap is a response format's: a tool's parameters are the agent's, not the user's to change."""
    parameters = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    response = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2, "tools": tools})
    # rendered into the prompt, 300 parameters pass the tiny server's context: refused for that alone
    assert response.json()["error"]["code"] == "context_length_exceeded", response.text


@pytest.mark.parametrize("value, says", [(5, "samplers must be a string or an array"),
                                         (["top_k", 3], "samplers[1] must be a string")])
def test_samplers_of_the_wrong_kind_still_say_so(server, value, says):
    """The length cap made `samplers` a union of constrained types, which the error messages named
    `samplers.constrained-str` until they knew the tag (found by review)."""
    response = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2, "samplers": value})
    error_400(response, says)
    assert response.json()["error"]["param"] == says.split(" ")[0]


def test_a_compressed_body_is_a_415_not_malformed_json(server):
    error_400(post(server, "/v1/chat/completions", b"\x1f\x8b\x08\x00", headers={"Content-Encoding": "gzip"}),
              "Content-Encoding gzip is not supported", status=415)


def test_a_token_that_is_true_is_no_token(server):
    error_400(post(server, "/detokenize", {"tokens": [True]}), "tokens")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/slots/0?action=save", "/lora-adapters"])
def test_a_client_that_leaves_mid_body_leaves_no_traceback(server, path):
    """stop_server, at the module's end, finds no traceback in the log (starlette's ClientDisconnect was one)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 200\r\n\r\n{{\"messages\": [".encode())
    time.sleep(0.3)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
