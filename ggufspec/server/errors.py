"""Errors in OpenAI's shape, `{"error": {"message", "type", "code"}}`, and the app's handlers for them;
`error_body` gives Anthropic's shape instead under its API's paths (/v1/messages)."""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import CacheFullError, ContextFullError, DecodeError, GgufspecError

log = logging.getLogger("ggufspec.server")

# The engine's messages name the command-line flags; a client sent these JSON fields instead.
FLAG_TO_FIELD = {"-n/--n-predict": "max_tokens", "--spec-draft-p-min": "speculative.p_min",
                 "--spec-draft-n-min": "speculative.n_min", "--draft": "draft", "--temp": "temperature",
                 "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p", "--typical": "typical_p",
                 "--xtc-probability": "xtc_probability", "--dynatemp-exp": "dynatemp_exponent"}


# Anthropic's error types (https://docs.anthropic.com/en/api/errors) by HTTP status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_type(status: int) -> str:
    """Anthropic's error type for `status`: the others of 4xx (405...) are the client's mistake too,
    not `api_error`, which is its 500s'."""
    return ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def anthropic_path(path: str) -> bool:
    """Whether `path` belongs to Anthropic's API here (/v1/messages and below it): its errors take its shape."""
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_body(path: str, status: int, message: str, type: str = "invalid_request_error",
               code: str | None = None, param: str | None = None) -> dict:
    """An error's JSON in the shape of the API that `path` belongs to: Anthropic's `{"type": "error",
    "error": {"type", "message"}}` under /v1/messages, else OpenAI's `{"error": {"message", "type", "param",
    "code"}}` (`type`, `param` and `code` are OpenAI's; Anthropic's type follows from `status`)."""
    if anthropic_path(path):
        return {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


FIELD_FIRST = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*|\[\d+\])*) must\b")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers
        # the body's field at fault (OpenAI's `param`), where one is: given, or the one a message begins with
        # ("top_p must be in (0, 1], got 5.0": the engine's checks name the field first)
        field = FIELD_FIRST.match(message) if param is None and status == 400 else None
        self.param = param if field is None else field[1]

    def body(self, path: str = "") -> dict:
        """In OpenAI's shape, or in that of the API `path` belongs to (`error_body`)."""
        return error_body(path, self.status, self.message, self.type, self.code, self.param)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def json_body(body: bytes, shape: str):
    """A route's own JSON body, parsed; malformed (a nesting deeper than Python's recursion too) is a 400
    naming the `shape` expected."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise APIError(400, f"malformed JSON body: send {shape}") from None


def engine_error(exc: Exception) -> APIError:
    """An error from the engine as the status a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextFullError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, CacheFullError):  # a prompt the slots under way leave no room for: theirs end soon
        return APIError(503, f"{exc}; retry in a moment, or start the server with a larger -c", "server_error",
                        "kv_cache_full", headers={"Retry-After": "2"})
    if isinstance(exc, DecodeError) or not isinstance(exc, GgufspecError):
        return APIError(500, f"generation failed: {exc}", "server_error")
    message = str(exc)
    for flag in sorted(FLAG_TO_FIELD, key=len, reverse=True):  # longest first: --spec-draft-p-min before --draft
        message = message.replace(flag, FLAG_TO_FIELD[flag])
    return APIError(400, message, code="invalid_value")


# pydantic's complaints that a value is of the wrong JSON type, as what it should be
EXPECTED = {"string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
            "int_from_float": "an integer", "float_type": "a number", "float_parsing": "a number",
            "bool_type": "a boolean", "bool_parsing": "a boolean", "list_type": "an array",
            "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object"}
SCALAR_TAGS = ("str", "int", "float", "bool", "none", "constrained-str")  # the last: a str with a max_length


def validation_message(errors: list[dict]) -> str:
    """pydantic's first complaint about a body, as one line naming the field (`messages[0].content`)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
    errors = [{**e, "loc": tuple(part for part in e.get("loc", ()) if part != "body")} for e in errors]
    error, expected = chosen_error(errors)
    where = place(error["loc"])
    expected = expected or ([wanted] if (wanted := expected_kind(error)) else [])
    if not where:  # the body itself
        if error.get("type") == "missing":
            return "the request body is empty: send a JSON object"
        return "the request body must be a JSON object" if expected else str(error.get("msg"))
    if expected:
        return f"{where} must be {' or '.join(expected)}"
    if error.get("type") == "missing":
        return f"{where} is required"
    if error.get("type") == "too_short" and error.get("ctx", {}).get("min_length") == 1:
        return f"{where} must not be empty"
    return f"{where}: {error.get('msg')}"


def invalid_body(errors: list[dict]) -> APIError:
    """A 400 for pydantic's complaints, naming the field (OpenAI's `param`) where there is one."""
    cleaned = [{**e, "loc": tuple(part for part in e.get("loc", ()) if part != "body")} for e in errors]
    error = chosen_error(cleaned)[0]  # the complaint the message shows
    loc = () if error.get("type") == "json_invalid" else tuple(p for p in error["loc"] if not union_tag(p))
    return APIError(400, validation_message(errors), param=place(loc) or None)


def chosen_error(errors: list[dict]) -> tuple[dict, list[str]]:
    """The complaint to show, and when a value fits none of a union's members, what it may be.
    pydantic tries every member of a union (`str | list[Item]`) and reports each one's failure,
    the string member's first: the one to show is that of the member the value is (the list's),
    not "should be a valid string". The members' tags are taken out of the place."""
    loc = errors[0]["loc"]
    at = next((i for i, part in enumerate(loc) if union_tag(part)), None)
    if at is None:
        return errors[0], []
    members = [e for e in errors if e["loc"][:at] == loc[:at] and len(e["loc"]) > at and union_tag(e["loc"][at])]
    by_tag: dict[str, list[dict]] = {}
    for e in members:
        by_tag.setdefault(e["loc"][at], []).append({**e, "loc": e["loc"][:at] + e["loc"][at + 1:]})
    fitting = {tag: found for tag, found in by_tag.items()
               if len(found) > 1 or len(found[0]["loc"]) > at or not expected_kind(found[0])}
    if not fitting:  # the value is none of the members' types
        return by_tag[loc[at]][0], list(dict.fromkeys(expected_kind(found[0]) for found in by_tag.values()))
    # the member the value came closest to: fewest complaints, then the deepest, then the latest item
    # (["a", 1] is a list of strings with a bad item 1, not a list of ids with a bad item 0)
    progress = lambda found: (len(found), -len(found[0]["loc"]),
                              -next((p for p in found[0]["loc"][at:] if isinstance(p, int)), 0))
    return chosen_error(min(fitting.values(), key=progress))


def union_tag(part) -> bool:
    """Whether a part of pydantic's `loc` is a union member's tag (`str`, `list[Item]`, a model's
    name) rather than a field: the fields here are all lowercase names."""
    return isinstance(part, str) and (part in SCALAR_TAGS or "[" in part or part[:1].isupper())


def expected_kind(error: dict) -> str | None:
    """What the value should have been, when the complaint is that it is of another kind."""
    if error.get("type") == "literal_error":
        return error.get("ctx", {}).get("expected")
    return EXPECTED.get(error.get("type"))


def place(loc: tuple) -> str:
    """("messages", 0, "content") as messages[0].content, as the other errors name places."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, FastAPI's and starlette's own included, in OpenAI's shape (in
    Anthropic's under its paths: `error_body`)."""

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        return invalid_body(exc.errors()).response(request.url.path)

    @app.exception_handler(ValidationError)
    async def invalid_value(request, exc: ValidationError):
        return invalid_body(exc.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        message = str(exc.detail)
        if exc.status_code == 405 and exc.headers and exc.headers.get("Allow"):
            message = f"{request.method} is not allowed on {request.url.path}: it takes {exc.headers['Allow']}"
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response(request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request, exc: ClientDisconnect):  # while it sent its body: nobody reads the answer
        return APIError(400, "the client closed the connection before its body was whole").response(request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("request failed")
        return APIError(500, f"internal error: {exc}", "server_error").response(request.url.path)
