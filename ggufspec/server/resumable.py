"""llama-server's resumable streams (server-stream.cpp): a streamed request that names its conversation
(`X-Conversation-Id: ID`) no longer depends on its connection. Its SSE bytes go into a buffer kept for
the conversation; a client gone (a page reloaded, a laptop's network lost) does not stop the answer, and
any client may read the stream again from a byte offset:

- `GET /v1/stream?conv_id=ID&from=N`: the bytes from offset N (what the client had already read), then
  the live ones until the answer ends; 404 once the stream is gone (5 minutes after it ended), 400 where
  the buffer's cap (4 MiB) already dropped offset N.
- `POST /v1/streams/lookup {"conversation_ids": [...]}`: the live streams among the ids asked (and their
  "ID::model" variants, llama-server's): `conversation_id`, `is_done`, `total_bytes`, `started_at`,
  `completed_at`. Only ids the caller names are answered: nobody can list the server's conversations.
- `DELETE /v1/stream?conv_id=ID`: the user's Stop: the answer is cancelled and its buffer dropped (204).

A stream exists from its request's arrival (a page reloaded while the prompt is evaluated, or while the
request waits for a slot, finds it) until 5 minutes after its end; a request refused before its first
event leaves none. A new stream for the same conversation replaces (and cancels) the previous one. The keep-alive pings go
into the buffer like the events, so that a reader's byte count stays the offset to resume from."""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.event import ServerSentEvent, ensure_bytes
from sse_starlette.sse import EventSourceResponse

from .errors import APIError

TTL_SECONDS = 300  # a finished stream is kept this long for readers (llama-server's STREAM_SESSION_TTL_SECONDS)
MAX_BYTES = 4 * 1024 * 1024  # the buffer keeps a stream's last 4 MiB (STREAM_SESSION_MAX_BYTES)
SEP = "\n"  # the events' line separator, as the other streams'


class StreamSession:
    """One conversation's stream: its bytes (the last MAX_BYTES of them), whether it ended. It exists from
    the request's arrival (llama-server's): a reader may wait on it while the prompt is evaluated."""

    def __init__(self, conversation_id: str, cancel_job=lambda: None, max_bytes: int = MAX_BYTES):
        self.conversation_id, self.max_bytes, self.cancel_job = conversation_id, max_bytes, cancel_job
        self.buffer, self.dropped = bytearray(), 0  # bytes dropped from the front for the cap
        self.done = self.cancelled = False
        self.started_at, self.completed_at = int(time.time()), 0
        self.producer: asyncio.Task | None = None
        self._changed = asyncio.Event()  # set (and replaced) at each change: the readers waiting wake

    @property
    def total_bytes(self) -> int:
        return self.dropped + len(self.buffer)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self.buffer += data
        if len(self.buffer) > self.max_bytes:
            extra = len(self.buffer) - self.max_bytes
            del self.buffer[:extra]
            self.dropped += extra
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.done, self.completed_at = True, int(time.time())
        self._wake()

    def cancel(self) -> None:
        """Stop the answer (the job, and its producer, whose generator's closing cancels it too) and end the
        stream for its readers."""
        self.cancelled = True
        self.cancel_job()
        if self.producer is not None:
            self.producer.cancel()
        self.finish()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read_from(self, offset: int):
        """The bytes from `offset` on, as they come, until the stream ends, or until the cap drops bytes
        this reader has not had (a reader 4 MiB behind: its stream ends short, and GET with its offset
        says why)."""
        while True:
            if offset < self.dropped:
                return
            if offset < self.total_bytes:
                chunk = bytes(self.buffer[offset - self.dropped:])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await self._changed.wait()

    def described(self) -> dict:
        return {"conversation_id": self.conversation_id, "is_done": self.done, "total_bytes": self.total_bytes,
                "started_at": self.started_at, "completed_at": self.completed_at}


class StreamSessions:
    """The live streams by conversation id; finished ones dropped TTL_SECONDS after their end."""

    def __init__(self, ttl_seconds: float = TTL_SECONDS):
        self.ttl_seconds = ttl_seconds
        self.sessions: dict[str, StreamSession] = {}

    def get(self, conversation_id: str) -> StreamSession | None:
        self._expire()
        return self.sessions.get(conversation_id)

    def open(self, conversation_id: str, cancel_job) -> StreamSession:
        """The conversation's new stream, as its request arrives; the one under way is cancelled (its slot may
        be the one the new request needs)."""
        self.evict(conversation_id, cancel=True)
        session = self.sessions[conversation_id] = StreamSession(conversation_id, cancel_job)
        return session

    def lookup(self, conversation_ids: list[str]) -> list[dict]:
        self._expire()
        return [session.described() for wanted in conversation_ids for key, session in self.sessions.items()
                if key == wanted or key.startswith(wanted + "::")]

    def evict(self, conversation_id: str, cancel: bool) -> None:
        session = self.sessions.pop(conversation_id, None)
        if session is not None and cancel:
            session.cancel()
        elif session is not None:
            session.finish()

    def drop(self, session: StreamSession) -> None:
        """A request refused before its stream began leaves nothing behind (unless a newer one took its id)."""
        if self.sessions.get(session.conversation_id) is session:
            self.evict(session.conversation_id, cancel=False)

    def cancel_all(self) -> None:
        for conversation_id in list(self.sessions):
            self.evict(conversation_id, cancel=True)

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl_seconds
        for key in [key for key, s in self.sessions.items() if s.done and s.completed_at <= cutoff]:
            del self.sessions[key]


async def produce(session: StreamSession, events, ping_seconds: float) -> None:
    """Run the stream to its end into the buffer, a ping comment there every `ping_seconds` (0: none)."""
    pinger = asyncio.create_task(ping(session, ping_seconds)) if ping_seconds > 0 else None
    try:
        async for event in events:
            session.append(ensure_bytes(event, SEP))
    finally:
        if pinger is not None:
            pinger.cancel()
        await events.aclose()  # its `finally` cancels the job: at the end, or cancelled by DELETE
        session.finish()


async def ping(session: StreamSession, seconds: float) -> None:
    while not session.done:
        await asyncio.sleep(seconds)
        comment = ServerSentEvent(comment=f"ping - {datetime.now(timezone.utc)}", sep=SEP)
        session.append(comment.encode())


def open_stream(request: Request, conversation_id: str, job) -> StreamSession:
    """A streamed request that names its conversation: its stream registered at once (lookup sees it; the
    conversation's stream under way is replaced), the job cancelled with it (DELETE)."""
    return request.app.state.streams.open(conversation_id, job.cancel)


def resumable_response(session: StreamSession, events, ping_seconds: float) -> Response:
    """The stream, its job started: `events` run into the session's buffer by a task of their own, and
    the response reads the buffer from the start; a client gone leaves the answer running for the next
    reader."""
    session.producer = asyncio.create_task(produce(session, events, ping_seconds))
    return EventSourceResponse(session.read_from(0), sep=SEP, ping=0)


def drop(request: Request, session: StreamSession) -> None:
    request.app.state.streams.drop(session)


def conversation_id(request: Request) -> str | None:
    return request.headers.get("x-conversation-id", "").strip() or None


def add_stream_routes(app: FastAPI) -> None:
    """GET/DELETE /v1/stream and POST /v1/streams/lookup (behind the app's Guard, as the other routes)."""
    app.state.streams = streams = StreamSessions()

    @app.get("/v1/stream")
    async def read_stream(conv_id: str = "", start: str = Query("", alias="from")):
        session = streams.get(_conversation(conv_id))
        if session is None:
            raise APIError(404, f"Stream not found or expired: {conv_id!r}", type="not_found_error")
        offset = _offset(start)
        if offset < session.dropped:
            raise APIError(400, f"Stream offset lost, please restart: from={offset} is before the "
                                f"{session.dropped} bytes the buffer dropped", param="from")
        return EventSourceResponse(session.read_from(offset), sep=SEP, ping=0)

    @app.post("/v1/streams/lookup")
    async def lookup(request: Request):
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            raise APIError(400, 'malformed JSON body: send {"conversation_ids": ["ID", ...]}') from None
        asked = body.get("conversation_ids") if isinstance(body, dict) else None
        ids = [i for i in asked if isinstance(i, str) and i] if isinstance(asked, list) else []
        return JSONResponse(streams.lookup(ids))

    @app.delete("/v1/stream")
    async def stop_stream(conv_id: str = ""):
        streams.evict(_conversation(conv_id), cancel=True)
        return Response(status_code=204)


def _conversation(conv_id: str) -> str:
    if not conv_id.strip():
        raise APIError(400, "Missing conversation id: give ?conv_id=ID (the request's X-Conversation-Id)",
                       param="conv_id")
    return conv_id.strip()


def _offset(text: str) -> int:
    if text == "":
        return 0
    if not (text.isascii() and text.isdigit() and len(text) < 19):  # below 10^18 bytes
        raise APIError(400, f"Invalid 'from' offset {text!r}: a byte count >= 0", param="from")
    return int(text)

