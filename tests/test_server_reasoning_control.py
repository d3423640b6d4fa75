"""llama-server's `reasoning_control` on the real server: a streamed chat completion armed with
`"reasoning_control": true` has its thinking ended by POST /v1/chat/completions/control {"id", "action":
"reasoning_end"} while the client reads it; the model goes on to its answer. The official `openai` client
for the stream, raw HTTP for the control requests and their errors. (The engine's side, lossless against
the target alone: tests/test_reasoning_control.py.)"""
from __future__ import annotations

import httpx
import pytest

from serverproc import serving
from test_server_reasoning import HI, OPENS_THINKING, reasoner

KEY = "k-control"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A DeepSeek-R1-like template (the answer starts inside <think>); the tiny model never ends its
    thinking by itself. n-gram lookup drafts."""
    target = reasoner(tmp_path_factory.mktemp("r1-like"), OPENS_THINKING)
    with serving(tmp_path_factory.mktemp("control"), "-m", str(target), "--lookup", "-c", "2048",
                 "--api-key", KEY) as running:
        yield running


def control(server, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/chat/completions/control", json=body, headers=headers, timeout=30)


def stream_and_control(server, armed: bool, after: int = 3):
    """Stream a long answer; after `after` chunks send reasoning_end for it. (the control's answer, the
    thinking, the answer text)"""
    stream = server.client(api_key=KEY).chat.completions.create(
        model="reasoner", messages=HI, max_tokens=1500, stream=True, extra_body={"reasoning_control": True} if armed else {})
    said, thinking, content = None, "", ""
    for n, chunk in enumerate(stream):
        if n == after:
            said = control(server, {"id": chunk.id, "action": "reasoning_end"}).json()
        if chunk.choices:
            delta = chunk.choices[0].delta
            thinking += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    return said, thinking, content


def test_an_armed_completions_thinking_ends_on_request_and_the_answer_follows(server):
    said, thinking, content = stream_and_control(server, armed=True)
    assert said == {"success": True}
    assert thinking and content, (thinking, content)  # the block ended: an answer after it
    _, unended, none = stream_and_control(server, armed=False)
    assert none == "" and unended.startswith(thinking.rstrip("▁ "))  # the same thinking until the end was forced


def test_a_completion_that_did_not_arm_it_or_has_ended_is_no_success(server):
    said, _, _ = stream_and_control(server, armed=False)
    assert said == {"success": False, "message": "reasoning control not enabled for this completion"}
    whole = server.client(api_key=KEY).chat.completions.create(model="reasoner", messages=HI, max_tokens=4,
                                                               extra_body={"reasoning_control": True})
    for completion_id in (whole.id, "chatcmpl-nothing"):
        assert control(server, {"id": completion_id, "action": "reasoning_end"}).json() == \
            {"success": False, "message": "no active completion for this id"}


@pytest.mark.parametrize("body, words", [
    ({"action": "reasoning_end"}, "missing completion id"),
    ({"id": "", "action": "reasoning_end"}, "missing completion id"),
    ({"id": "chatcmpl-x"}, "unknown control action"),
    ({"id": "chatcmpl-x", "action": "stop"}, "unknown control action"),
    ({"id": 7, "action": "reasoning_end"}, "id"),
])
def test_bad_control_requests_are_400_in_one_line(server, body, words):
    response = control(server, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert words in message and "\n" not in message


def test_the_control_needs_the_key_and_a_json_body(server):
    assert control(server, {"id": "chatcmpl-x", "action": "reasoning_end"}, key=None).status_code == 401
    response = httpx.post(server.url + "/v1/chat/completions/control", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "\n" not in response.json()["error"]["message"]
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "reasoning_control": "yes"},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert bad.status_code == 400 and "reasoning_control" in bad.json()["error"]["message"]
