"""How the HTTP side serves, by llama-server's flags: `--api-prefix` (every route under a path prefix),
`-to/--timeout` (its read/write timeout, as far as uvicorn lets it be kept), and which of its
optional endpoints answer (`--no-webui`, `--no-slots`, `--slot-save-path`, `--props`).

`Front` wraps the app that faces the clients: the FastAPI app of a plain `serve`, the supervisor's
proxy under `serve --rpc` (the model process behind it then serves without a prefix or timeouts).
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import os
import re
import sys

from ..errors import GgufspecError
from .errors import APIError
from .guard import refuse

DEFAULT_TIMEOUT_S = 3600  # llama-server's --timeout default (common.h: timeout_read, timeout_write)
# a path prefix of plain segments: what needs no percent-encoding, so the raw path starts with it too
PREFIX_SEGMENTS = re.compile(r"(/[A-Za-z0-9._~-]+)+")


def check_api_prefix(prefix: str) -> str:
    """--api-prefix as llama-server takes it: "" (none), or a path with a leading slash and no trailing one."""
    if prefix == "":
        return prefix
    if not prefix.startswith("/") or prefix.endswith("/"):
        raise GgufspecError(f"--api-prefix {prefix!r}: give a path with a leading slash and no trailing one, "
                            f"e.g. --api-prefix /llm (the API is then at /llm/v1)")
    if not PREFIX_SEGMENTS.fullmatch(prefix) or any(part in (".", "..") for part in prefix.split("/")):
        raise GgufspecError(f"--api-prefix {prefix!r}: use path segments of letters, digits and . _ ~ - "
                            f"(no empty, . or .. segment), e.g. --api-prefix /llm")
    return prefix


def check_slot_save_path(folder: str | None) -> str | None:
    """--slot-save-path: a folder that exists and can be written (llama-server: "not a directory")."""
    if folder is None:
        return None
    if not os.path.isdir(folder):
        raise GgufspecError(f"--slot-save-path {folder}: not a directory (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise GgufspecError(f"--slot-save-path {folder}: cannot write there (permission denied)")
    return os.path.abspath(folder)


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """Which of llama-server's optional endpoints answer: the chat page at / (--no-webui: 404, as
    llama-server's), GET /slots (--no-slots: 501), POST /slots/{id} (with --slot-save-path: save,
    restore, erase), POST /props (--props). `threads_http`: threads for the work done off the event
    loop (None: asyncio's default); `sse_ping_interval`: seconds between a stream's keep-alive comments
    (--sse-ping-interval; 0 or less: none), a request's own `sse_ping_interval` over it."""
    webui: bool = True
    slots: bool = True
    slot_save_path: str | None = None
    props: bool = False
    threads_http: int | None = None
    sse_ping_interval: int = 30  # llama-server's default


@dataclasses.dataclass(frozen=True)
class Front:
    """--api-prefix and -to/--timeout, applied in front of everything else (the Guard included, so that
    it sees the paths without the prefix)."""
    api_prefix: str = ""
    timeout: float = DEFAULT_TIMEOUT_S

    def wrap(self, app):
        """`app` behind the timeouts and the prefix (for an ASGI app that is not FastAPI's)."""
        app = Timeouts(app, self.timeout)
        return ApiPrefix(app, self.api_prefix) if self.api_prefix else app

    def add_to(self, app) -> None:
        """The same as FastAPI middleware (the last added runs first)."""
        app.add_middleware(Timeouts, seconds=self.timeout)
        if self.api_prefix:
            app.add_middleware(ApiPrefix, prefix=self.api_prefix)


class ApiPrefix:
    """Every route under the prefix (llama-server's --api-prefix): /llm/v1/models is /v1/models, the chat
    page is at /llm/ (its requests are relative); any other path is a 404 that names the prefix."""

    def __init__(self, app, prefix: str):
        self.app, self.prefix, self.raw_prefix = app, prefix, prefix.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if not path.startswith(self.prefix + "/"):
            return await refuse(scope, send, 404, f"{path} is not served here: every route is under --api-prefix "
                                f"{self.prefix} (e.g. {self.prefix}/v1/chat/completions)", "invalid_request_error",
                                "not_found")
        rest = path[len(self.prefix):]
        raw = scope.get("raw_path")
        raw_rest = raw[len(self.raw_prefix):] if raw and raw.startswith(self.raw_prefix) else rest.encode()
        await self.app({**scope, "path": rest, "raw_path": raw_rest}, receive, send)


class BodyTimeout(APIError):
    """No new bytes of the request's body for --timeout seconds: a 408 (FastAPI's handler answers it
    where a route was reading, `Timeouts` where the Guard was), and the connection closed."""

    def __init__(self, seconds: float):
        super().__init__(408, f"the request body stopped coming: no data for {seconds:g} s (--timeout)",
                         code="request_timeout", headers={"Connection": "close"})


class _ClientNotReading(Exception):
    pass


# Set in the request's task when `Timeouts` let a client go: uvicorn, finding the answer unfinished,
# logs that as an application error; the line said here replaces it.
_CUT = contextvars.ContextVar("ggufspec_client_cut", default=False)
UNFINISHED = "ASGI callable returned without completing response."


class _QuietAfterCut(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT.get() and record.getMessage() == UNFINISHED)


class Timeouts:
    """llama-server's -to/--timeout, the part uvicorn lets an app keep: reading the request body (a pause
    of more than `seconds` between its parts is a 408) and writing the answer (a client that takes none
    of it for `seconds`, its socket buffers full, is cut off). Reading the request line and headers is
    uvicorn's own (h11), without a timeout of this length; idle keep-alive connections close after
    uvicorn's 5 s, as cpp-httplib's."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds
        uvicorn_log = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _QuietAfterCut) for f in uvicorn_log.filters):
            uvicorn_log.addFilter(_QuietAfterCut())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seconds, body_done, started, cut = self.seconds, False, False, False

        async def timed_receive():
            nonlocal body_done
            if body_done:  # after the body, receive() waits for the disconnect: no limit on that
                return await receive()
            try:
                async with asyncio.timeout(seconds):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(seconds) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def timed_send(message):
            nonlocal started, cut
            started = started or message["type"] == "http.response.start"
            try:
                async with asyncio.timeout(seconds):
                    await send(message)
            except TimeoutError:
                cut = True
                raise _ClientNotReading from None
        try:
            await self.app(scope, timed_receive, timed_send)
        except BodyTimeout as exc:
            if not started:
                await refuse(scope, send, 408, exc.message, "invalid_request_error", "request_timeout", close=True)
        except BaseException:
            if not cut:
                raise
            # the client that stopped reading is let go: uvicorn closes its connection, its answer is stopped
            _CUT.set(True)
            sys.stderr.write(f"ggufspec: a client took none of its answer for {seconds:g} s (--timeout): its "
                             f"connection was closed\n")
