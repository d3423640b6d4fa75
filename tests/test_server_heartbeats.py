"""A stream's keep-alives through a silence (a long prompt, a tool call held back until it is whole: formats
other than Hermes) are the
protocol's own events, which clients' event parsers see: Anthropic's `ping`, a numbered
`response.in_progress`. SSE comments alone left Codex's idle timer running: it gave up after 300 s of them and
sent the request again (audit; openai/codex#31539)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic

from ggufspec.server.protocols.core import HEARTBEAT, with_heartbeats
from serverproc import raw_events, slow_server_fixture

KEY = "heartbeat-key"
# Mistral's call format: its calls are held back until whole (a Hermes call streams as it is written,
# test_callstream), the silence the beats fill
MISTRAL = Path(__file__).parent / "fixtures" / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja"
slow_server = slow_server_fixture(KEY, "--sse-ping-interval", "1", "--chat-template-file", str(MISTRAL))

WRITE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
# the slow target never ends a string on its own: the call is held back until max tokens cut it (seconds)
RESPONSES_BODY = {"input": "write it", "tools": [{"type": "function", "name": "write", "parameters": WRITE}],
                  "tool_choice": "required", "max_output_tokens": 700, "stream": True}
MESSAGES_BODY = {"model": "any", "max_tokens": 700, "messages": [{"role": "user", "content": "write it"}],
                 "tools": [{"name": "write", "input_schema": WRITE}], "tool_choice": {"type": "tool", "name": "write"},
                 "stream": True}


def collected(source, seconds: float) -> list:
    async def run():
        return [event async for event in with_heartbeats(source, seconds)]
    return asyncio.run(run())


async def slow_source(gap: float):
    yield "a"
    await asyncio.sleep(gap)
    yield "b"
    yield "c"


def test_heartbeats_come_in_silences_only_and_never_when_off():
    events = collected(slow_source(0.35), 0.1)
    assert [e for e in events if e is not HEARTBEAT] == ["a", "b", "c"]
    assert 2 <= events.count(HEARTBEAT) <= 4 and events[0] == "a" and events[-2:] == ["b", "c"]
    assert collected(slow_source(0.25), 0) == ["a", "b", "c"]


def test_a_consumer_that_leaves_mid_silence_stops_the_source():
    stopped = []

    async def source():
        try:
            yield "a"
            await asyncio.sleep(30)
            yield "never"
        finally:
            stopped.append(True)

    async def run():
        beats = with_heartbeats(source(), 0.05)
        assert await anext(beats) == "a" and await anext(beats) is HEARTBEAT
        await beats.aclose()
    asyncio.run(asyncio.wait_for(run(), 10))
    assert stopped == [True]


def test_responses_keep_alive_is_a_numbered_in_progress_event(slow_server):
    events = raw_events(slow_server, "/v1/responses", RESPONSES_BODY)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.incomplete"
    assert names.count("response.in_progress") >= 2, names  # beats while the call was held back
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    beat = [data for name, data in events[2:] if name == "response.in_progress"][0]
    assert beat["response"]["status"] == "in_progress" and beat["response"]["id"] == events[0][1]["response"]["id"]
    with slow_server.client(api_key=KEY).responses.stream(**{k: v for k, v in RESPONSES_BODY.items() if k != "stream"},
                                                          model="slow") as stream:
        kinds = [event.type for event in stream]  # the SDK's stream helper takes the beats
    assert kinds.count("response.in_progress") >= 2 and kinds[-1] == "response.incomplete"


def test_messages_keep_alive_is_anthropics_ping_event(slow_server):
    events = raw_events(slow_server, "/v1/messages", MESSAGES_BODY)
    names = [name for name, _ in events]
    assert names.count("ping") >= 2 and names[-1] == "message_stop", names
    assert all(data == {"type": "ping"} for name, data in events if name == "ping")
    client = anthropic.Anthropic(base_url=slow_server.url, api_key=KEY, max_retries=0)
    with client.messages.stream(**{k: v for k, v in MESSAGES_BODY.items() if k != "stream"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
