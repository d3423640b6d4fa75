"""Errors in OpenAI's shape, `{"error": {"message", "type", "code"}}`, and the app's handlers for them;
`error_body` gives Anthropic's shape instead under its API's paths (/v1/messages)."""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextFullError, DecodeError, GgufspecError

log = logging.getLogger("ggufspec.server")

# The engine's messages name the command-line flags; a client sent these JSON fields instead.
FLAG_TO_FIELD = {"-n/--n-predict": "max_tokens", "--draft-p-min": "speculative.p_min",
                 "--draft-min": "speculative.n_min", "--draft": "draft", "--temp": "temperature",
                 "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p"}


# Anthropic's error types (https://docs.anthropic.com/en/api/errors) by HTTP status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_path(path: str) -> bool:
    """Whether `path` belongs to Anthropic's API here (/v1/messages and below it): its errors take its shape."""
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_body(path: str, status: int, message: str, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """An error's JSON in the shape of the API that `path` belongs to: Anthropic's `{"type": "error",
    "error": {"type", "message"}}` under /v1/messages, else OpenAI's `{"error": {"message", "type", "code"}}`
    (`type` and `code` are OpenAI's; Anthropic's type follows from `status`)."""
    if anthropic_path(path):
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": type, "code": code}}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers

    def body(self, path: str = "") -> dict:
        """In OpenAI's shape, or in that of the API `path` belongs to (`error_body`)."""
        return error_body(path, self.status, self.message, self.type, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def engine_error(exc: Exception) -> APIError:
    """An error from the engine as the status a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextFullError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, DecodeError) or not isinstance(exc, GgufspecError):
        return APIError(500, f"generation failed: {exc}", "server_error")
    message = str(exc)
    for flag in sorted(FLAG_TO_FIELD, key=len, reverse=True):  # longest first: --draft-p-min before --draft
        message = message.replace(flag, FLAG_TO_FIELD[flag])
    return APIError(400, message, code="invalid_value")


def validation_message(errors: list[dict]) -> str:
    """pydantic's first complaint about a body, as one line naming the field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, FastAPI's and starlette's own included, in OpenAI's shape (in
    Anthropic's under its paths: `error_body`)."""

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        return APIError(400, validation_message(exc.errors())).response(request.url.path)

    @app.exception_handler(ValidationError)
    async def invalid_value(request, exc: ValidationError):
        return APIError(400, validation_message(exc.errors())).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response(request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("request failed")
        return APIError(500, f"internal error: {exc}", "server_error").response(request.url.path)
