"""Who may use the server, and how much one request may send: the `Exposure` (the policy, from the
command line) and `Guard`, the pure-ASGI middleware that enforces it in front of the app (streams pass
through untouched).

- Host names: a server on loopback answers only requests whose Host is a loopback name or address
  (or one of --allowed-hosts): a page that rebinds its own name to 127.0.0.1 gets a 403.
- Origins: browsers get CORS headers only for loopback origins (any port), the server's own page and
  --cors-origins; a POST from any other origin is refused (403), so that a page cannot run the model
  with a "simple" request that needs no preflight either, and so is its preflight (a JSON 403).
- The key (--api-key) on /v1/*, llama-server's /completion(s) and /infill, /props, /slots, /tokenize, /detokenize: `Authorization: Bearer KEY` or
  `x-api-key: KEY`, compared in constant time.
- Bodies: at most --max-body bytes, refused from Content-Length before anything is read, and while
  reading a body sent without one (chunked): 413. Below the cap, `OffLoopRoute` parses and validates
  a body in a thread, off the event loop.
Its own errors take the shape of the API their path belongs to (`errors.error_body`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import time
import types
import typing
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
import pydantic_core
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.middleware.cors import CORSMiddleware

from ..errors import GgufspecError
from ..netaddr import is_loopback
from .errors import error_body

MIB = 1 << 20
# A context of 128k tokens as JSON (its text escaped, or its ids) fits with room to spare.
DEFAULT_MAX_BODY = 4 * MIB
OPEN_PATHS = ("/", "/health", "/v1/health")  # and the chat page's scripts under /static/: all else needs the key
WITH_BODY = ("POST", "PUT", "PATCH", "DELETE")  # methods that change things (and may carry a body)
# http(s)://localhost, *.localhost, 127.0.0.0/8 and [::1], any port: pages served from this machine
LOOPBACK_ORIGIN = r"https?://(localhost|[a-z0-9.-]+\.localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"


def is_guarded(path: str) -> bool:
    """The paths that need the key: every one but the page at /, its scripts and /health, so that a
    route added later (llama-server's names for the APIs...) is behind the key from the start."""
    return path not in OPEN_PATHS and not path.startswith("/static/")


@dataclasses.dataclass(frozen=True)
class Exposure:
    """What `Guard` lets through. `check_host`: refuse Host names that are neither loopback nor in
    `allowed_hosts` (`*.example.com` patterns allowed). `cors_origins`: origins beyond the loopback ones
    that browsers may use the API from ("*": any). `trusted`: behind `serve --rpc`'s supervisor, which
    enforced all of it already: only the body cap and the JSON content type are left."""
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    check_host: bool = False
    allowed_hosts: tuple[str, ...] = ()
    max_body: int = DEFAULT_MAX_BODY
    trusted: bool = False

    @classmethod
    def listening(cls, host: str, *, api_key: str | None = None, cors_origins: tuple[str, ...] = (),
                  allowed_hosts: tuple[str, ...] = (), max_body: int = DEFAULT_MAX_BODY) -> "Exposure":
        """The policy of a server listening on `host`: Host names are checked on loopback (and
        elsewhere when --allowed-hosts names some), not when listening beyond it without a list."""
        check = "*" not in allowed_hosts and (is_loopback(host) or bool(allowed_hosts))
        return cls(api_key=api_key or None, cors_origins=tuple(cors_origins), check_host=check,
                   allowed_hosts=tuple(allowed_hosts), max_body=max_body)

    def behind_front(self) -> "Exposure":
        """The model process's policy under `serve --rpc`: its supervisor faces the clients and checks them."""
        return dataclasses.replace(self, trusted=True)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a client may send (`api_key` holds them comma-separated, as llama-server's --api-key)."""
        return tuple(key for key in (self.api_key or "").split(",") if key)

    @property
    def any_origin(self) -> bool:
        return "*" in self.cors_origins

    def host_allowed(self, value: str | None) -> bool:
        if not self.check_host or value is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(value)
        if is_loopback(name) or name.endswith(".localhost"):
            return True
        return any(name == allowed or (allowed.startswith("*.") and name.endswith(allowed[1:]))
                   for allowed in self.allowed_hosts)

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """Whether a browser page of `origin` may use the API: a loopback one, the server's own (the
        origin names the Host the request was sent to), or one of --cors-origins."""
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.cors_origins or re.fullmatch(LOOPBACK_ORIGIN, origin):
            return True
        return host is not None and urlsplit(origin).netloc == host.strip().lower()

    def summary(self) -> str:
        """The policy in a few words, for the start line."""
        parts = ["key required" if self.api_key else "no key"]
        if self.any_origin:
            parts.append("web pages: any origin")
        else:
            parts.append("web pages: " + ", ".join(["loopback", *self.cors_origins]))
        if self.check_host:
            parts.append("Host: " + ", ".join(["loopback", *self.allowed_hosts]))
        parts.append(f"bodies up to {size_text(self.max_body)}")
        return "; ".join(parts)


def host_name(value: str) -> str:
    """A Host header's name, lowercase, without its port, brackets or trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


# ---------------------------------------------------------------- the command line's values

def parse_origins(text: str | None) -> tuple[str, ...]:
    """--cors-origins: a comma-separated list of origins (scheme://host[:port]), "null", or "*"."""
    origins = []
    for item in (text or "").split(","):
        origin = item.strip().lower().rstrip("/")
        if not origin:
            continue
        parts = urlsplit(origin)
        if origin not in ("*", "null") and not (parts.scheme and parts.netloc and not parts.path.strip("/")
                                                  and not parts.query):
            raise GgufspecError(f"--cors-origins: {item.strip()!r} is not an origin: give scheme://host[:port] "
                                f"(e.g. http://example.com:3000), a comma-separated list of them, or *")
        origins.append(origin)
    return tuple(origins)


def parse_hosts(text: str | None) -> tuple[str, ...]:
    """--allowed-hosts: comma-separated names (a port is ignored), `*.example.com` patterns, or *."""
    hosts = []
    for item in (text or "").split(","):
        name = item.strip().lower()
        if not name:
            continue
        if name not in ("*",) and not re.fullmatch(r"(\*\.)?[a-z0-9_.:\[\]-]+", name):
            raise GgufspecError(f"--allowed-hosts: {item.strip()!r} is not a host name: give names such as "
                                f"example.com or *.example.com, comma-separated, or *")
        hosts.append(name if name.startswith("*.") or name == "*" else host_name(name))
    return tuple(hosts)


def parse_api_keys(api_key: str | None, key_file: str | None) -> str | None:
    """--api-key (a key, or llama-server's comma-separated list) and --api-key-file (one key a line,
    blank lines skipped) as the comma-separated keys any of which a client may send; each checked for
    what no client's header could carry."""
    keys = [] if api_key is None else [key.strip() for key in api_key.split(",")]
    if api_key is not None and (not all(keys) or api_key != api_key.strip()):
        raise GgufspecError("--api-key (or GGUFSPEC_API_KEY) is blank, has an empty key between commas, or begins "
                            "or ends with whitespace, which no client's header can carry: give the key(s) without")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as lines:
                from_file = [line.strip() for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise GgufspecError(f"--api-key-file {key_file}: {getattr(exc, 'strerror', None) or exc}") from None
        if not from_file or any("," in key for key in from_file):
            raise GgufspecError(f"--api-key-file {key_file}: give one key a line (no commas); it holds "
                                f"{'none' if not from_file else 'a line with a comma'}")
        keys += from_file
    return ",".join(keys) if keys else None


SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": MIB, "mb": 1000 ** 2, "mib": MIB,
              "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """--max-body: bytes, or with a unit: 512K, 4M, 8MiB, 1G (K, M, G: powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] < 1:
        raise GgufspecError(f"--max-body: {text!r} is not a size: give bytes, or a number with K, M or G "
                            f"(e.g. 4M)")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def size_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return f"{n} bytes"


# ---------------------------------------------------------------- the middleware

async def refuse(scope, send, status: int, message: str, type: str, code: str, close: bool = False) -> None:
    """An error response in the shape of the API of the request's path."""
    payload = json.dumps(error_body(scope.get("path", ""), status, message, type, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:  # the rest of the body is not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class CORS(CORSMiddleware):
    """starlette's CORS, its refused preflight (a text/plain 400) a JSON 403 in the path's API's shape."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers=request_headers)
        if response.status_code == 200:
            return response
        origin = request_headers["origin"]
        refused = response.body.decode().removeprefix("Disallowed CORS ")  # what failed: origin, method...
        if "origin" in refused:
            message, code = (f"web pages of {origin} may not use this server (--cors-origins allows origins "
                             f"beyond loopback ones)"), "origin_not_allowed"
        else:
            message, code = f"CORS preflight refused: {refused} not allowed", "cors_not_allowed"

        async def respond(scope, receive, send):  # called with the scope: the path, and so the API, is known there
            await refuse(scope, send, 403, message, "permission_error", code)
        return respond


class Guard:
    """The `Exposure` enforced: Host names first (every path, the page included), then CORS (starlette's,
    for the allowed origins), then the origin of a POST, the key and the body's size. A HEAD request
    goes on as a GET (FastAPI's routes answer GET alone): uvicorn, whose scope still says HEAD, sends
    the headers without the body, as llama-server answers HEAD /health."""

    def __init__(self, app, exposure: Exposure):
        self.exposure = exposure
        self.checks = Checks(app, exposure)
        self.app = self.checks if exposure.trusted else CORS(
            self.checks, allow_origins=["*"] if exposure.any_origin else list(exposure.cors_origins),
            allow_origin_regex=None if exposure.any_origin else LOOPBACK_ORIGIN, allow_methods=["*"],
            allow_headers=["*"], expose_headers=["Retry-After"])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        if not self.exposure.trusted:
            host = header(scope, b"host")
            if not self.exposure.host_allowed(host):
                return await refuse(scope, send, 403, f"the Host {host!r} is not served here: this server listens "
                                    f"on loopback and answers loopback names only (--allowed-hosts adds names)",
                                    "permission_error", "host_not_allowed")
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs a few seconds after Ctrl-C or SIGTERM (a client that stopped
            # sending its body, or reading the answer): answered if it can still be, and ended quietly
            if not started:
                await refuse(scope, send, 503, "the server is shutting down", "server_error", "shutting_down",
                             close=True)


def header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Checks:
    def __init__(self, app, exposure: Exposure):
        self.app, self.exposure = app, exposure
        self.keys = tuple(key.encode() for key in exposure.api_keys) or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path, exposure = scope["method"], scope.get("path", ""), self.exposure
        headers = dict((key.lower(), value) for key, value in scope["headers"])
        origin = headers.get(b"origin")
        if (not exposure.trusted and method in WITH_BODY and origin is not None
                and not exposure.origin_allowed(origin.decode("latin-1"), header(scope, b"host"))):
            return await refuse(scope, send, 403, f"requests from web pages of {origin.decode('latin-1')} are not "
                                f"allowed here (--cors-origins allows origins beyond loopback ones)",
                                "permission_error", "origin_not_allowed")
        # a CORS preflight carries no key (browsers send none): the CORS layer answers it, nothing more
        preflight = method == "OPTIONS" and origin is not None and b"access-control-request-method" in headers
        guarded = is_guarded(path) and not preflight
        if guarded and self.keys is not None and not exposure.trusted and not self.key_given(headers):
            return await refuse(scope, send, 401, "invalid or missing API key: send the header Authorization: "
                                "Bearer KEY (or x-api-key: KEY)", "authentication_error", "invalid_api_key")
        length = headers.get(b"content-length")
        if method in WITH_BODY or length is not None or b"transfer-encoding" in headers:  # a GET's body too
            if length is not None and length.strip().isdigit() and int(length) > exposure.max_body:
                return await self.too_large(scope, send)
            encoding = headers.get(b"content-encoding", b"identity").strip().lower()
            if encoding not in (b"identity", b""):  # a compressed body is not inflated: no bomb past the cap
                return await refuse(scope, send, 415, f"Content-Encoding {encoding.decode('latin-1')[:40]} is not "
                                    f"supported: send the body uncompressed", "invalid_request_error",
                                    "unsupported_media_type", close=True)
            if length is None:  # chunked: read here, up to the cap, and handed on whole
                body = await read_capped(receive, exposure.max_body)
                if body is None:
                    return  # the client left
                if body is TOO_LARGE:
                    return await self.too_large(scope, send)
                receive = replaying(body, receive)
            if guarded and method == "POST":  # JSON whatever the Content-Type, as llama-server reads it
                headers[b"content-type"] = b"application/json"
                scope = {**scope, "headers": list(headers.items())}
        await self.app(scope, receive, send)

    def key_given(self, headers: dict) -> bool:
        """`Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's clients) naming one of the keys, each
        compared in constant time (all of them, whichever matches)."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        x_api_key = headers.get(b"x-api-key", b"").strip()
        bearer = [secrets.compare_digest(token.strip(), key) for key in self.keys]
        named = [secrets.compare_digest(x_api_key, key) for key in self.keys]
        return (any(bearer) and scheme.lower() == b"bearer") or any(named)

    async def too_large(self, scope, send) -> None:
        limit = size_text(self.exposure.max_body)
        await refuse(scope, send, 413, f"the request body is larger than this server accepts ({limit}; "
                     f"--max-body sets it)", "invalid_request_error", "request_too_large", close=True)


TOO_LARGE = object()


async def read_capped(receive, limit: int):
    """The whole body, None when the client left, or TOO_LARGE as soon as it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replaying(body: bytes, receive):
    """A `receive` that gives `body` once, then what the client does (its disconnect)."""
    given = False

    async def replay():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


# ---------------------------------------------------------------- bodies parsed off the event loop

class OffLoopRoute(APIRoute):
    """A route whose JSON body (one pydantic model) is parsed and validated in a thread: a body of
    megabytes must not hold up the event loop, which every other client, /health and the stop signal
    wait on. FastAPI then finds the model already made (`request.json()` returns it, and pydantic
    does not validate an instance of the model again)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        model = getattr(getattr(field, "field_info", None), "annotation", None)
        embedded = getattr(getattr(field, "field_info", None), "embed", False)
        if (not isinstance(model, type) or not issubclass(model, BaseModel) or embedded
                or len(self.dependant.body_params) != 1):
            return handler

        async def parsed_off_loop(request: Request):
            body = await request.body()
            if body:
                try:
                    request._json = await asyncio.to_thread(validated, model, body)  # what json() returns
                except ValidationError as exc:
                    raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
            return await handler(request)
        return parsed_off_loop


SLICE = 1000  # items of a long list validated at a time: a few milliseconds with the GIL held


def validated(model: type[BaseModel], body: bytes) -> BaseModel:
    """`model` from a JSON body. pydantic holds the GIL while it validates, so that a list of a hundred
    thousand messages would stop the event loop's thread for a second: a long list of models is
    validated a slice at a time, the GIL let go between slices (the whole is then validated at
    the cost of checking that its items are instances already)."""
    if len(body) < 64 * 1024:
        return model.model_validate_json(body)
    try:  # pydantic's own parser, as for a small body: a lone surrogate or a deep nesting is malformed JSON
        data = pydantic_core.from_json(body)
    except ValueError:
        return model.model_validate_json(body)  # pydantic's own message for malformed JSON
    return validated_data(model, data)


def validated_data(model: type[BaseModel], data) -> BaseModel:
    """`model` from parsed JSON (or a dict built like it: a protocol's translation), a long list of
    models a slice at a time."""
    if isinstance(data, dict):
        for name, field in model.model_fields.items():
            key = field.alias or name
            items, item_model = data.get(key), listed_model(field.annotation)
            if item_model is not None and isinstance(items, list) and len(items) > SLICE:
                data[key] = validated_items(TypeAdapter(list[item_model]), items, key)
    return model.model_validate(data)


def listed_model(annotation) -> type | None:
    """M for a field of type list[M] (M a model), also within a union (`str | list[M]`) or Annotated."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return args[0] if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel) else None
    if origin in (typing.Union, types.UnionType):
        return next((found for found in map(listed_model, args) if found is not None), None)
    return None


def validated_items(adapter: TypeAdapter, items: list, key: str) -> list:
    done = []
    for start in range(0, len(items), SLICE):
        try:
            done += adapter.validate_python(items[start:start + SLICE])
        except ValidationError as exc:  # the same errors as the whole body's, their places in the whole list
            errors = [{**e, "loc": (key, start + e["loc"][0], *e["loc"][1:])} for e in exc.errors()]
            raise ValidationError.from_exception_data(exc.title, errors) from None
        time.sleep(0)  # lets the event loop's thread take the GIL
    return done
