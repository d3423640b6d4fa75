"""Errors in OpenAI's shape, `{"error": {"message", "type", "code"}}` (Anthropic's, `{"type": "error",
"error": {"type", "message"}}`, under /v1/messages), and the app's handlers for them."""
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

# Anthropic's error types by status (anything else: api_error); its clients read the type, not the status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"  # and /v1/messages/count_tokens: the paths whose errors are in Anthropic's shape


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The error in the shape of the protocol that `path` speaks."""
        return self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body_for(path), status_code=self.status, headers=self.headers)


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
    """Every error the app answers, FastAPI's and starlette's own included, in the shape of the
    protocol the request's path speaks."""

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
