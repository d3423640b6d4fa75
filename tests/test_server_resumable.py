"""llama-server's resumable streams: a streamed request with `X-Conversation-Id` goes on when its client
leaves, and GET /v1/stream?conv_id=ID&from=N gives the bytes from N on; POST /v1/streams/lookup says
which of the ids asked are live; DELETE /v1/stream stops one. Real servers on loopback, raw HTTP and the
official clients."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from serverproc import answer_text, pair_server_fixture, replay, slow_server_fixture, wait_idle

KEY = "k-resume"
AUTH = {"Authorization": f"Bearer {KEY}"}


server = pair_server_fixture("--api-key", KEY, "--temp", "0", "-np", "2")
slow_server = slow_server_fixture(KEY, "-np", "1")


def chat_body(n: int, text: str = "one two three") -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": n, "stream": True, "temperature": 0}


def streamed_bytes(server, body: dict, conversation: str | None, path: str = "/v1/chat/completions") -> bytes:
    headers = {**AUTH, **({"X-Conversation-Id": conversation} if conversation else {})}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return b"".join(response.iter_raw())


def started_and_left(server, conversation: str) -> None:
    """A long streamed answer of `conversation`, its client gone at the first data: the answer goes on."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat_body(4000), timeout=60,
                      headers={**AUTH, "X-Conversation-Id": conversation}) as response:
        for chunk in response.iter_raw():
            if b"data: " in chunk:
                break


def lookup(server, *ids) -> list[dict]:
    response = httpx.post(server.url + "/v1/streams/lookup", json={"conversation_ids": list(ids)}, headers=AUTH,
                          timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_stream_is_read_again_from_any_offset(server):
    whole = streamed_bytes(server, chat_body(24), "conv-a")
    assert answer_text(whole) == answer_text(streamed_bytes(server, chat_body(24), None))  # the same answer
    again = replay(server, "conv-a")
    assert again.status_code == 200 and again.headers["content-type"].startswith("text/event-stream")
    assert again.content == whole
    assert replay(server, "conv-a", 40).content == whole[40:]
    [described] = lookup(server, "conv-a", "conv-unknown")
    assert described["conversation_id"] == "conv-a" and described["is_done"] is True
    assert described["total_bytes"] == len(whole) and described["completed_at"] >= described["started_at"] > 0


def test_a_client_gone_leaves_the_answer_running_for_the_next_reader(slow_server):
    body = {**chat_body(48), "messages": [{"role": "user", "content": "a b"}]}
    with httpx.stream("POST", slow_server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={**AUTH, "X-Conversation-Id": "conv-gone"}) as response:
        read = b""
        for chunk in response.iter_raw():
            read += chunk
            if read.count(b"data: ") >= 4:
                break  # the client leaves a few tokens in
    rest = replay(slow_server, "conv-gone", len(read))
    assert rest.status_code == 200
    resumed = read + rest.content
    assert resumed.rstrip().endswith(b"data: [DONE]")
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in resumed.decode().splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert finish[-1] == "length"  # the answer ran to its max_tokens, nobody reading
    plain = streamed_bytes(slow_server, body, None)
    assert answer_text(resumed) == answer_text(plain)


def test_delete_stops_the_answer_and_drops_the_stream(slow_server):
    started_and_left(slow_server, "conv-stop")
    assert lookup(slow_server, "conv-stop")[0]["is_done"] is False  # still answering, nobody reading
    stopped = httpx.delete(slow_server.url + "/v1/stream", params={"conv_id": "conv-stop"}, headers=AUTH)
    assert stopped.status_code == 204
    assert replay(slow_server, "conv-stop").status_code == 404 and lookup(slow_server, "conv-stop") == []
    wait_idle(slow_server)  # the generation was cancelled, not left running
    assert httpx.delete(slow_server.url + "/v1/stream", params={"conv_id": "conv-stop"}, headers=AUTH).status_code == 204


def test_a_new_stream_of_the_conversation_replaces_the_old(slow_server):
    started_and_left(slow_server, "conv-twice")
    second = streamed_bytes(slow_server, chat_body(6), "conv-twice")  # waits for the slot the first held
    assert replay(slow_server, "conv-twice").content == second


def test_the_messages_stream_resumes_too(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with client.messages.stream(model="m", max_tokens=16, messages=[{"role": "user", "content": "one two"}],
                                extra_headers={"X-Conversation-Id": "conv-messages"}) as stream:
        text = "".join(stream.text_stream)
    raw = replay(server, "conv-messages").content.decode()
    deltas = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert deltas[0]["type"] == "message_start" and deltas[-1]["type"] == "message_stop"
    assert "".join(d["delta"].get("text", "") for d in deltas if d["type"] == "content_block_delta") == text


@pytest.mark.parametrize("method, path, params, body, status, words", [
    ("GET", "/v1/stream", {}, None, 400, "Missing conversation id"),
    ("GET", "/v1/stream", {"conv_id": "nobody"}, None, 404, "Stream not found or expired"),
    ("DELETE", "/v1/stream", {}, None, 400, "Missing conversation id"),
    ("POST", "/v1/streams/lookup", {}, b"{not json", 400, "malformed JSON body"),
])
def test_bad_requests_are_openai_errors(server, method, path, params, body, status, words):
    response = httpx.request(method, server.url + path, params=params, content=body, headers=AUTH, timeout=10)
    assert response.status_code == status and words in response.json()["error"]["message"], response.text


def test_a_lost_offset_and_a_bad_one(server):
    streamed_bytes(server, chat_body(4), "conv-offsets")
    assert replay(server, "conv-offsets", 10**9).content == b""  # past the end of a finished stream: nothing
    bad = httpx.get(server.url + "/v1/stream", params={"conv_id": "conv-offsets", "from": "-1"}, headers=AUTH)
    assert bad.status_code == 400 and "Invalid 'from' offset" in bad.json()["error"]["message"]


def test_a_refused_request_leaves_no_stream_and_lookup_lists_only_what_is_asked(server):
    refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": [], "stream": True},
                         headers={**AUTH, "X-Conversation-Id": "conv-refused"}, timeout=10)
    assert refused.status_code == 400
    assert lookup(server, "conv-refused") == [] and lookup(server) == []
    assert httpx.post(server.url + "/v1/streams/lookup", json={"conversation_ids": "conv-a"}, headers=AUTH).json() == []


@pytest.mark.parametrize("method, path", [("GET", "/v1/stream"), ("DELETE", "/v1/stream"),
                                          ("POST", "/v1/streams/lookup")])
def test_the_routes_need_the_key(server, method, path):
    response = httpx.request(method, server.url + path, params={"conv_id": "conv-a"}, json={}, timeout=10)
    assert response.status_code == 401


def occupy(server, conversation: str = "conv-holder"):
    """A resumable request holding the one slot (its client gone, it generates on) until it is stopped at
    the context manager's end."""
    import contextlib

    @contextlib.contextmanager
    def held():
        started_and_left(server, conversation)
        try:
            yield
        finally:
            httpx.delete(server.url + "/v1/stream", params={"conv_id": conversation}, headers=AUTH)
    return held()


def send_and_leave(server, conversation: str, body: dict) -> None:
    """A resumable request whose client leaves before anything comes back (the request waits for the slot)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0,
                   headers={**AUTH, "X-Conversation-Id": conversation})


def test_a_client_gone_while_its_request_waits_finds_the_stream_after(slow_server):
    """As llama-server's: the stream exists from the request's arrival, the answer goes on without the
    connection (here the client left while the request waited for the slot)."""
    body = {**chat_body(12), "messages": [{"role": "user", "content": "a b c"}]}
    with occupy(slow_server):
        send_and_leave(slow_server, "conv-waiting", body)
        [described] = lookup(slow_server, "conv-waiting")
        assert described["is_done"] is False and described["total_bytes"] == 0
    whole = replay(slow_server, "conv-waiting")  # read from the start once the slot is free
    assert answer_text(whole.content) == answer_text(streamed_bytes(slow_server, body, None))


def test_delete_while_the_request_waits_means_it_never_runs(slow_server):
    with occupy(slow_server):
        send_and_leave(slow_server, "conv-never", chat_body(4000))
        assert httpx.delete(slow_server.url + "/v1/stream", params={"conv_id": "conv-never"},
                            headers=AUTH).status_code == 204
    wait_idle(slow_server)
    assert lookup(slow_server, "conv-never") == []


def test_the_buffer_keeps_the_last_bytes_and_a_reader_behind_them_ends():
    """The cap (4 MiB on the server; 8 bytes here): the first bytes dropped, a reader from them ends at once,
    one from what is kept reads on to the end."""
    import asyncio

    from ggufspec.server.resumable import StreamSession

    async def scenario():
        session = StreamSession("c", max_bytes=8)
        session.append(b"0123456789")
        session.append(b"ab")
        session.finish()
        behind = [chunk async for chunk in session.read_from(0)]
        kept = b"".join([chunk async for chunk in session.read_from(session.dropped)])
        return session, behind, kept
    session, behind, kept = asyncio.run(scenario())
    assert session.dropped == 4 and session.total_bytes == 12 and behind == [] and kept == b"456789ab"
