"""`ggufspec serve`: an OpenAI-compatible HTTP API over one `SpeculativeDecoder`.

Layers: the `Engine` owns the decoder and the one worker thread where every llama.cpp call runs
(the decoder is not thread-safe); a `Job` is one request's generation, handing its pieces to the
event loop through an asyncio queue; `create_app` maps HTTP to jobs and jobs to OpenAI's JSON.

Each request sends its whole prompt (or conversation); the decoder keeps the longest prefix its KV
cache shares with it, so a conversation that grows turn by turn is only evaluated once.

`GET /` is a chat page (ggufspec/static/chat.html, self-contained) that shows the speculation: each
token coloured by origin, K per step, and the time saved against the target alone; `GET /props`
describes the pair for it (llama-server has an endpoint of that name).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import secrets
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__
from .errors import ContextFullError, DecodeError, GgufspecError
from .report import Stats

log = logging.getLogger("ggufspec.server")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "n_predict": "length", "context": "length"}
# The engine's messages name the command-line flags; a client sent these JSON fields instead.
FLAG_TO_FIELD = {"-n/--n-predict": "max_tokens", "--draft-p-min": "speculative.p_min",
                 "--draft-min": "speculative.n_min", "--draft": "draft", "--temp": "temperature",
                 "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p"}


# ---------------------------------------------------------------- errors, in OpenAI's shape

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


# ---------------------------------------------------------------- request bodies

class Strict(BaseModel):
    # NaN and infinity parse as JSON in Python; they are never a valid sampling value
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Speculative(Strict):
    """llama.cpp server's per-request draft settings."""
    n_max: int | None = Field(None, ge=0)
    n_min: int | None = None
    p_min: float | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationBody(Strict):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens (chat)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None
    draft: Literal["auto"] | int | None = None  # ggufspec's own: K, 0 = the target alone, or "auto"
    lookup: bool | None = None
    hybrid: bool | None = None


class CompletionBody(GenerationBody):
    prompt: str | list[str] | list[int]


class ContentPart(Strict):
    type: str
    text: str | None = None


class Message(Strict):
    model_config = ConfigDict(extra="allow")  # name, tool_calls...: passed to the chat template
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(GenerationBody):
    messages: list[Message] = Field(min_length=1)


def generation_options(body: GenerationBody, defaults: dict) -> dict:
    """The decoder's stream() keywords: the server's defaults, overridden by what the request sets."""
    if body.n != 1:
        raise APIError(400, f"n must be 1: this server generates one choice per request, got {body.n}")
    options = dict(defaults)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None:
        options["n_predict"] = max_tokens
    for name in ("temperature", "top_k", "top_p", "min_p"):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.seed is not None:
        if body.seed < -1:
            raise APIError(400, f"seed must be >= 0 (or -1 for a random one), got {body.seed}", code="invalid_value")
        options["seed"] = None if body.seed == -1 else body.seed
    if body.draft is not None:
        options["n_draft"] = body.draft
    if body.lookup and body.hybrid:
        raise APIError(400, "choose one of lookup and hybrid", code="invalid_value")
    if body.lookup is not None or body.hybrid is not None:
        options["drafter"] = "lookup" if body.lookup else "hybrid" if body.hybrid else "model"
    spec = body.speculative
    if spec is not None:
        for name, option in (("n_max", "draft_max"), ("n_min", "draft_min"), ("p_min", "draft_p_min")):
            if getattr(spec, name) is not None:
                options[option] = getattr(spec, name)
        if spec.n_max is not None and options.get("n_draft") != "auto":  # a fixed K is capped too
            options["n_draft"] = min(options.get("n_draft", spec.n_max), spec.n_max)
    return options


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return [s for s in stops if s]


def message_dicts(messages: list[Message]) -> list[dict]:
    """Messages as the chat template wants them: content a string (text parts joined)."""
    result = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content is supported (no images or audio)", code="invalid_value")
            content = "".join(part.text or "" for part in content)
        result.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
    return result


# ---------------------------------------------------------------- stop strings

class StopFilter:
    """Holds pieces back while the text might be running into a stop string; cuts at the first one.

    Pieces go out whole, except the one a stop string starts in, which goes out trimmed (pieces
    after it never go out), so the pieces' texts always add up to what the client is sent.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""        # everything generated so far
        self.sent = 0         # characters of it released
        self.pending: list[dict] = []
        self.stopped = False

    def push(self, piece: dict) -> list[dict]:
        if not self.stops:
            return [piece]
        self.pending.append(piece)
        self.text += piece["text"]
        start = max(0, self.sent - self.longest)  # a stop string never starts in text already released
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._release(min(found))
        return self._release(len(self.text) - self._partial_stop_length())

    def flush(self) -> list[dict]:
        released, self.pending = self.pending, []
        return released

    def _partial_stop_length(self) -> int:
        """How many trailing characters are the beginning of a stop string."""
        return max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def _release(self, end: int) -> list[dict]:
        released, position = [], self.sent
        while self.pending:
            piece = self.pending[0]
            if position + len(piece["text"]) <= end:
                released.append(self.pending.pop(0))
                position += len(piece["text"])
                continue
            if self.stopped:  # the piece the stop string starts in: its part before the stop string
                if end > position:
                    released.append({**piece, "text": piece["text"][:end - position]})
                    position = end
                self.pending = []
            break
        self.sent = position
        return released


class StepTracker:
    """Which verification step each piece came from, and how many tokens that step drafted."""

    def __init__(self, stats: Stats):
        self.stats, self.step, self.drafted, self._drafted_before = stats, 0, 0, 0

    def annotate(self, piece) -> dict:
        if self.stats.n_steps != self.step:  # the first piece of a new step
            self.step = self.stats.n_steps
            self.drafted = self.stats.n_drafted - self._drafted_before
            self._drafted_before = self.stats.n_drafted
        return {"text": piece.text, "token": piece.token, "from_draft": piece.from_draft,
                "step": self.step, "drafted": self.drafted}


# ---------------------------------------------------------------- one generation at a time

class ClientGone(Exception):
    pass


class Job:
    """One request's generation. The worker thread fills `events`; the request's task reads them:
    ("started", n_prompt), ("prompt", {cache_n...}) before the first pieces, ("pieces", [piece, ...]),
    then ("done", (stats, finish_reason, estimate)) or ("error", exc)."""

    def __init__(self, *, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                 options: dict, stops: list[str]):
        self.prompt, self.messages, self.options, self.stops = prompt, messages, options, stops
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self._next_check = 0.0  # when next_event next asks whether the client is still there

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutting down): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    async def next_event(self, request: Request | None = None, poll: float = 0.25):
        """The next event; a client that disconnects meanwhile cancels the job (ClientGone).
        The check runs every `poll` seconds whether or not events are flowing."""
        while True:
            if request is not None and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + poll
                if await request.is_disconnected():
                    self.cancel()
                    raise ClientGone
            try:
                return await asyncio.wait_for(self.events.get(), poll)
            except asyncio.TimeoutError:
                pass


class Engine:
    """The decoder and its single worker thread. Jobs run in arrival order (the executor's queue)."""

    def __init__(self, decoder, max_queue: int):
        self.decoder = decoder
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggufspec-engine")
        self._lock = threading.Lock()
        self._pending = 0              # submitted and not finished, the running one included
        self._mean_seconds = 5.0       # a generation's duration, for Retry-After
        self._current: Job | None = None
        self.last: Stats | None = None   # the last finished generation's statistics (/health shows them)
        self._stopping = False

    @property
    def waiting(self) -> int:
        return max(self._pending - 1, 0)

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if self._pending > self.max_queue:  # one running and max_queue already waiting
                retry = max(1, math.ceil(self._mean_seconds * self._pending))
                raise APIError(429, f"the server is busy: {self.waiting} requests are waiting (--max-queue "
                               f"{self.max_queue}); retry later", "rate_limit_error", "queue_full",
                               headers={"Retry-After": str(retry)})
            self._pending += 1
        self._executor.submit(self._run, job)

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            if self._stopping:
                job.emit("error", shutting_down())
            elif not job.cancelled.is_set():  # a client that left while waiting costs nothing
                self._current = job
                self._generate(job)
        except Exception as exc:  # GgufspecError: the client's mistake; anything else: ours, logged
            if not isinstance(exc, GgufspecError):
                log.exception("generation failed")
            job.emit("error", exc)
        finally:
            self._current = None
            with self._lock:
                self._pending -= 1
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.perf_counter() - started)

    def _generate(self, job: Job) -> None:
        decoder = self.decoder
        prompt = decoder.render_chat(job.messages) if job.messages is not None else job.prompt
        tokens = decoder.tokenize(prompt)
        check_fits(len(tokens), job.options.get("n_predict", -1), decoder.n_ctx)
        if any(not 0 <= t < decoder.target.n_vocab for t in tokens):
            raise GgufspecError(f"prompt token ids must be in [0, {decoder.target.n_vocab})")
        stream = decoder.stream(tokens, **job.options)  # checks the options before anything runs
        stats = decoder.last_stats
        job.emit("started", len(tokens))
        stop_filter, steps = StopFilter(job.stops), StepTracker(stats)
        try:
            for piece in stream:
                if job.cancelled.is_set():
                    break
                if steps.step == 0:  # the first token: the prompt has been evaluated
                    job.emit("prompt", prompt_info(stats))
                released = stop_filter.push(steps.annotate(piece))
                if released:
                    job.emit("pieces", released)
                if stop_filter.stopped:
                    break
            else:
                if stop_filter.pending:
                    job.emit("pieces", stop_filter.flush())
        finally:
            stream.close()  # the engine keeps its caches consistent; the next prompt reuses them
        result = self.last = dataclasses.replace(stats)
        if stop_filter.stopped:
            result.stop_reason = "stop"
        # on the worker thread, the only one that changes the decoder's measured costs
        estimate = time_estimate(decoder, job.options.get("drafter", "model"), result)
        job.emit("done", (result, FINISH_REASONS.get(result.stop_reason, "stop"), estimate))

    def stop(self) -> None:
        """Shutting down: the running generation ends at its next token (its client gets what was
        generated), waiting ones get 503. Safe to call from a signal handler."""
        self._stopping = True
        current = self._current
        if current is not None:
            current.cancel()

    def close(self) -> None:
        self.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", "shutting_down")


def check_fits(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    if max_tokens > 0 and n_prompt + max_tokens > n_ctx:
        raise ContextFullError(
            f"this model's context holds {n_ctx} tokens, but the request needs {n_prompt + max_tokens} "
            f"({n_prompt} in the prompt + {max_tokens} max_tokens): shorten the prompt or lower max_tokens")
    if n_prompt >= n_ctx:
        raise ContextFullError(f"the prompt is {n_prompt} tokens but this model's context holds {n_ctx}")


# ---------------------------------------------------------------- what the chat page shows

def prompt_info(stats: Stats) -> dict:
    """The prompt as evaluated: how much of it the KV cache already held."""
    return {"n_prompt": stats.n_prompt, "cache_n": stats.n_prompt_cached,
            "prompt_ms": stats.prompt_seconds * 1000}


def time_estimate(decoder, drafter: str, stats: Stats) -> dict | None:
    """The time this answer saved (negative: lost) against the target alone, as the cost model sees
    it: the target alone takes T(1) per token, T(1) being the median of the target's recent
    single-token steps that the decoder measured (the cost model keeps the last 8; the median, not
    the least, so that a machine busy with other work now is compared with itself). None before any
    T(1) is known (a fixed K never runs the target alone; `draft: "auto"` measures it on its first
    request)."""
    if stats.n_predict == 0 or stats.decode_seconds <= 0:
        return None
    costs_by_drafter = getattr(decoder, "costs", None) or {}
    # T(1) is the target's own cost, measured under each drafter: this request's first
    ordered = [costs_by_drafter[drafter]] if drafter in costs_by_drafter else []
    ordered += [c for name, c in costs_by_drafter.items() if name != drafter]
    costs = next((c for c in ordered if c.batch_times.get(1)), None)
    if costs is None:
        return None
    t1 = statistics.median(costs.batch_times[1])
    alone = stats.n_predict * t1
    return {"t1_ms": t1 * 1000, "target_alone_ms": alone * 1000, "decode_ms": stats.decode_seconds * 1000,
            "saved_ms": (alone - stats.decode_seconds) * 1000, "speedup": alone / stats.decode_seconds,
            "target_alone": stats.n_drafted == 0}  # nothing drafted: the target alone, whatever the figures say


QUANT_IN_NAME = re.compile(r"(?i)(?:^|[-_.])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)$")


def quantization(llm) -> str | None:
    """Q4_K_M, F16...: GGUF's general.file_type, else the file name's quantization suffix."""
    import gguf
    try:
        name = gguf.LlamaFileType(int(llm.metadata["general.file_type"])).name
    except (AttributeError, KeyError, TypeError, ValueError):
        name = None
    if name and name != "GUESSED":
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    stem = Path(getattr(llm, "model_path", "") or "").stem
    match = QUANT_IN_NAME.search(stem)
    return match.group(1).upper() if match else None


def model_info(llm) -> dict | None:
    """One model of the pair as /props shows it."""
    if llm is None:
        return None
    import ctypes

    import llama_cpp
    model = llm._model.model
    n_layer = llama_cpp.llama_model_n_layer(model)
    requested = llm.model_params.n_gpu_layers  # -1 was stored as INT32_MAX: every layer
    offloaded = min(requested, n_layer + 1) if llama_cpp.llama_supports_gpu_offload() else 0
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, desc, len(desc))
    path = Path(llm.model_path)
    return {"file": path.name, "name": llm.metadata.get("general.name") or path.stem,
            "quantization": quantization(llm), "description": desc.value.decode(errors="replace"),
            "n_params": llama_cpp.llama_model_n_params(model), "size_bytes": llama_cpp.llama_model_size(model),
            "n_layer": n_layer, "n_gpu_layers": offloaded}


def pair_props(decoder, model_name: str, defaults: dict) -> dict:
    """GET /props: the pair, its placement, the request defaults. The llama-server fields
    (default_generation_settings, total_slots, model_path, build_info) are there for its clients."""
    import llama_cpp

    from .plan import build_backends
    target = model_info(decoder.target_llm)
    draft = model_info(getattr(decoder, "draft_llm", None))
    params = {"n_predict": defaults.get("n_predict", -1), "temperature": defaults.get("temperature", 0.0),
              "top_k": defaults.get("top_k", 40), "top_p": defaults.get("top_p", 0.95),
              "min_p": defaults.get("min_p", 0.05), "seed": defaults.get("seed"),
              "speculative.n_max": defaults.get("draft_max", 8), "speculative.n_min": defaults.get("draft_min", 0),
              "speculative.p_min": defaults.get("draft_p_min", 0.0)}
    return {"model": model_name, "version": __version__, "n_ctx": decoder.n_ctx, "target": target, "draft": draft,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()), "backends": build_backends(),
            "placement": decoder.placement,
            "defaults": defaults,
            "default_generation_settings": {"n_ctx": decoder.n_ctx, "params": params},
            "total_slots": 1, "model_path": str(decoder.target_llm.model_path), "build_info": f"ggufspec {__version__}"}


def chat_page() -> str:
    return resources.files("ggufspec").joinpath("static", "chat.html").read_text(encoding="utf-8")


# ---------------------------------------------------------------- OpenAI response objects

def timings(stats: Stats) -> dict:
    """llama.cpp server's `timings` block."""
    prompt_n = stats.n_prompt - stats.n_prompt_cached
    prompt_ms, predicted_ms = stats.prompt_seconds * 1000, stats.decode_seconds * 1000
    return {"cache_n": stats.n_prompt_cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": stats.prompt_tps,
            "predicted_n": stats.n_predict, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / stats.n_predict if stats.n_predict else 0.0,
            "predicted_per_second": stats.decode_tps,
            "draft_n": stats.n_drafted, "draft_n_accepted": stats.n_accept}


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": stats.n_predict,
            "total_tokens": stats.n_prompt + stats.n_predict,
            "prompt_tokens_details": {"cached_tokens": stats.n_prompt_cached}}


class Reply:
    """The JSON objects of one answer, chat or text completion, whole or in chunks."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def whole(self, pieces: list[dict], stats: Stats, finish: str, estimate: dict | None = None) -> dict:
        text = "".join(p["text"] for p in pieces)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(finish_reason=finish, logprobs=None)
        return self._object("chat.completion" if self.chat else "text_completion", [choice],
                            usage=usage(stats), timings=timings(stats),
                            ggufspec={"stats": stats.to_dict(), "estimate": estimate})

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False, **extra) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(finish_reason=finish, logprobs=None)
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def pieces_chunk(self, pieces: list[dict], prompt: dict | None = None) -> dict:
        """A chunk of text, and per token where it came from (see the README: "Streaming");
        the first one also says how much of the prompt the cache held."""
        extra = {"pieces": pieces, **({"prompt": prompt} if prompt else {})}
        return self.chunk("".join(p["text"] for p in pieces), ggufspec=extra)

    def final_chunks(self, stats: Stats, finish: str, include_usage: bool, estimate: dict | None = None) -> list[dict]:
        chunks = [self.chunk(None, finish, timings=timings(stats),
                             ggufspec={"stats": stats.to_dict(), "estimate": estimate})]
        if include_usage:
            chunks.append(self._object(chunks[0]["object"], [], usage=usage(stats), timings=timings(stats)))
        return chunks


# ---------------------------------------------------------------- the app

class V1Middleware:
    """For /v1/* and /props: 401 without `Authorization: Bearer KEY` when a key is set, and every POST
    body read as JSON whatever its Content-Type (as llama.cpp's server does: `curl -d` sends a form
    type). The page at / and /health need no key. Pure ASGI, so streaming responses pass through."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        guarded = scope.get("path", "").startswith("/v1") or scope.get("path") == "/props"
        if scope["type"] != "http" or not guarded or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                error = APIError(401, "invalid or missing API key: send the header Authorization: Bearer KEY",
                                 "authentication_error", "invalid_api_key")
                return await error.response()(scope, receive, send)
        if scope["method"] == "POST":
            headers[b"content-type"] = b"application/json"
            scope = {**scope, "headers": list(headers.items())}
        await self.app(scope, receive, send)


def create_app(decoder, *, model_name: str, defaults: dict | None = None, api_key: str | None = None,
               max_queue: int = 16, aliases: tuple[str, ...] = (), info: dict | None = None) -> FastAPI:
    """The OpenAI-compatible app over `decoder`. `defaults`: stream() keywords from the command line.
    `aliases`: other model ids accepted in requests (file names). `info`: shown in /v1/models' meta."""
    engine = Engine(decoder, max_queue)
    defaults = dict(defaults or {})
    accepted_models = {model_name, *aliases}
    created = int(time.time())

    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close)  # stops the running generation within a step

    app = FastAPI(title="ggufspec", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(V1Middleware, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        return APIError(400, validation_message(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def invalid_value(request, exc: ValidationError):
        return APIError(400, validation_message(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("request failed")
        return APIError(500, f"internal error: {exc}", "server_error").response()

    def check_model(requested: str | None) -> None:
        # Lenient like llama.cpp where it costs nothing: no model, or any of the served model's names.
        if requested and requested not in accepted_models:
            raise APIError(404, f"model {requested!r} is not served here; this server serves {model_name!r}",
                           code="model_not_found")

    @app.get("/health")
    async def health():
        last = engine.last and {"n_predict": engine.last.n_predict, "stop_reason": engine.last.stop_reason}
        return {"status": "ok", "model": model_name, "busy": engine.busy, "waiting": engine.waiting, "last": last}

    props = pair_props(decoder, model_name, defaults)  # read once, before the worker runs anything

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(chat_page(), headers={"Cache-Control": "no-cache"})

    @app.get("/props")
    async def props_endpoint():
        return props

    @app.get("/v1/models")
    async def models():
        meta = {"n_ctx": decoder.n_ctx, **(info or {})}
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "ggufspec", "meta": meta}]}

    async def answer(request: Request, body: GenerationBody, job_args: dict, chat: bool):
        check_model(body.model)
        job = Job(options=generation_options(body, defaults), stops=stop_strings(body.stop), **job_args)
        reply = Reply(model_name, chat)
        engine.submit(job)
        streaming = False
        try:
            kind, value = await job.next_event(request)  # waits its turn, then the prompt is checked
            if kind == "error":
                raise engine_error(value)
            if not body.stream:
                return await whole_answer(job, reply, request)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            response = EventSourceResponse(stream_events(job, reply, include_usage), sep="\n")
            streaming = True
            return response
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            if not streaming:  # from here on the stream's own `finally` cancels it
                job.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        return await answer(request, body, {"prompt": prompt}, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        return await answer(request, body, {"messages": message_dicts(body.messages)}, chat=True)

    return app


async def whole_answer(job: Job, reply: Reply, request: Request) -> dict:
    pieces = []
    while True:
        kind, value = await job.next_event(request)
        if kind == "pieces":
            pieces.extend(value)
        elif kind == "done":
            stats, finish, estimate = value
            return reply.whole(pieces, stats, finish, estimate)
        elif kind == "error":
            raise engine_error(value)


async def stream_events(job: Job, reply: Reply, include_usage: bool):
    """SSE events: OpenAI's chunks, then [DONE]. A client that goes away cancels the generation
    (sse-starlette cancels this generator; `finally` tells the worker, which stops at the next token)."""
    def event(obj):
        return {"data": json.dumps(obj, ensure_ascii=False)}
    prompt = None  # the prompt's figures, sent with the next pieces
    try:
        if reply.chat:
            yield event(reply.chunk("", role=True))
        while True:
            kind, value = await job.events.get()
            if kind == "prompt":
                prompt = value
            elif kind == "pieces":
                yield event(reply.pieces_chunk(value, prompt))
                prompt = None
            elif kind == "done":
                stats, finish, estimate = value
                for chunk in reply.final_chunks(stats, finish, include_usage, estimate):
                    yield event(chunk)
                break
            elif kind == "error":
                yield event(engine_error(value).body())
                break
        yield {"data": "[DONE]"}
    finally:
        job.cancel()
