"""The supervisor's HTTP front: every request forwarded to the model process over its Unix socket, SSE
streams included, and a 503 (or, in a stream that has started, an SSE error event) when that process
is gone. A small HTTP/1.1 client on h11, which uvicorn already depends on: no new dependency."""
from __future__ import annotations

import asyncio
import json
import logging

import h11

from .errors import error_body

log = logging.getLogger("ggufspec.server")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones this hop sets itself.
NOT_FORWARDED = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host", b"content-length",
                 b"proxy-connection", b"expect", b"date", b"server"}  # date, server: the front's own
READ_SIZE = 65536


class ChildGone(Exception):
    """The model process closed the connection before the answer was whole."""


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


async def read_body(receive) -> bytes | None:
    """The whole request body (requests here are small JSON), or None when the client left meanwhile."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def next_event(conn: h11.Connection, reader: asyncio.StreamReader):
    """The next h11 event of the response, reading from the model process as needed."""
    try:
        while True:
            event = conn.next_event()  # at the end of the data while a message is open: RemoteProtocolError
            if event is not h11.NEED_DATA:
                if isinstance(event, h11.ConnectionClosed):
                    raise ChildGone
                return event
            conn.receive_data(await reader.read(READ_SIZE))
    except (h11.RemoteProtocolError, OSError):
        raise ChildGone from None


def request_bytes(conn: h11.Connection, scope: dict, body: bytes) -> bytes:
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    headers = [(name, value) for name, value in scope["headers"] if name.lower() not in NOT_FORWARDED]
    headers += [(b"host", b"model"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    return (conn.send(h11.Request(method=scope["method"], target=target, headers=headers))
            + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))


async def ask(socket_path: str, scope: dict, body: bytes, timeout: float | None = None) -> tuple[int, bytes]:
    """(status, body) of one whole request to the model process (the supervisor's health checks)."""
    async def exchange():
        reader, writer = await asyncio.open_unix_connection(socket_path)
        try:
            conn = h11.Connection(h11.CLIENT)
            writer.write(request_bytes(conn, scope, body))
            response, chunks = None, []
            while True:
                event = await next_event(conn, reader)
                if isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    chunks.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return response.status_code, b"".join(chunks)
        finally:
            writer.close()
    return await asyncio.wait_for(exchange(), timeout)


def get_scope(path: str) -> dict:
    return {"method": "GET", "path": path, "headers": [], "query_string": b""}


class Forwarding:
    """One request passed to the model process and its answer passed back, as it comes."""

    def __init__(self, scope, send, child, socket_path: str):
        self.scope, self.send, self.child, self.socket_path = scope, send, child, socket_path
        self.started = False  # the response's status line has gone to the client
        self.event_stream = False

    async def run(self, body: bytes) -> None:
        """Forward; when the model process goes away meanwhile, answer why (`child.why()`)."""
        writer = None
        try:
            reader, writer = await asyncio.open_unix_connection(self.socket_path)
            self.child.connections.add(writer)
            if self.child.gone.is_set():  # gone meanwhile (a slow body): the socket would queue it for the next child
                raise ChildGone
            conn = h11.Connection(h11.CLIENT)
            writer.write(request_bytes(conn, self.scope, body))
            await self.relay(conn, reader)
        except (ChildGone, OSError):
            await self.fail(await self.child.why())
        finally:
            if writer is not None:
                self.child.connections.discard(writer)
                writer.close()

    async def relay(self, conn: h11.Connection, reader: asyncio.StreamReader) -> None:
        while True:
            event = await next_event(conn, reader)
            if isinstance(event, h11.Response):
                headers = [(name, value) for name, value in event.headers if name.lower() not in NOT_FORWARDED
                           or name.lower() == b"content-length"]
                content_type = dict(event.headers).get(b"content-type", b"")
                self.event_stream = content_type.startswith(b"text/event-stream")
                await self.send({"type": "http.response.start", "status": event.status_code, "headers": headers})
                self.started = True
            elif isinstance(event, h11.Data):
                await self.send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, h11.EndOfMessage):
                await self.send({"type": "http.response.body", "body": b""})
                return

    async def fail(self, problem: tuple[str, str]) -> None:
        """A 503 before the answer started; in a stream, an SSE `error` event (as OpenAI and
        llama-server send) and the end of the stream."""
        message, code = problem
        body = error_body(self.scope["path"], 503, message, "server_error", code)  # Anthropic's under /v1/messages
        if not self.started:
            return await send_json(self.send, 503, body, [(b"retry-after", b"5")])
        ending = b""
        if self.event_stream:
            ending = b"event: error\ndata: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
        await self.send({"type": "http.response.body", "body": ending})


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def proxy_app(supervisor):
    """The ASGI app of the front: forwards to the supervisor's current model process while it is
    ready, answers 503 with what happened while it is not. A client that leaves closes its
    connection to the model process, which stops that generation (as it would without a proxy)."""
    async def app(scope, receive, send):
        if scope["type"] != "http":  # uvicorn runs it with lifespan="off"
            return
        child = supervisor.ready_child()
        if child is None:
            status, body = supervisor.unavailable(scope["path"])
            return await send_json(send, status, body, [(b"retry-after", b"5")])
        body = await read_body(receive)
        if body is None:
            return
        forwarding = asyncio.ensure_future(Forwarding(scope, send, child, supervisor.socket_path).run(body))
        leaving = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({forwarding, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (forwarding, leaving):
                task.cancel()
            failed = (await asyncio.gather(forwarding, return_exceptions=True))[0]
            if isinstance(failed, Exception) and not isinstance(failed, asyncio.CancelledError):
                log.error("forwarding %s failed: %r", scope["path"], failed)
    return app
