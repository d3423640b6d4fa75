"""One generation at a time: the `Engine` owns the decoder and the one worker thread where every
llama.cpp call runs (the decoder is not thread-safe); a `Job` is one request's generation, handing
its pieces to the event loop through an asyncio queue. Beyond --max-queue waiting requests: 429."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from ..errors import ContextFullError, GgufspecError
from ..stats import Stats
from ..stops import StopFilter
from .errors import APIError
from .speculation import StepTracker, prompt_info, time_estimate

log = logging.getLogger("ggufspec.server")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "n_predict": "length", "context": "length"}


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
        tokens = self._prompt_tokens(job)
        stream = decoder.stream(tokens, **job.options)  # checks the options before anything runs
        stats = decoder.last_stats
        job.emit("started", len(tokens))
        try:
            stopped = relay(stream, stats, job)
        finally:
            stream.close()  # the engine keeps its caches consistent; the next prompt reuses them
        result = self.last = dataclasses.replace(stats)
        if stopped:
            result.stop_reason = "stop"
        # on the worker thread, the only one that changes the decoder's measured costs
        estimate = time_estimate(decoder, job.options.get("drafter", "model"), result)
        job.emit("done", (result, FINISH_REASONS.get(result.stop_reason, "stop"), estimate))

    def _prompt_tokens(self, job: Job) -> list[int]:
        """The job's prompt (or conversation, through the chat template) as tokens that fit the context."""
        decoder = self.decoder
        prompt = decoder.render_chat(job.messages) if job.messages is not None else job.prompt
        tokens = decoder.tokenize(prompt)
        check_fits(len(tokens), job.options.get("n_predict", -1), decoder.n_ctx)
        if any(not 0 <= t < decoder.target.n_vocab for t in tokens):
            raise GgufspecError(f"prompt token ids must be in [0, {decoder.target.n_vocab})")
        return tokens

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


def relay(stream, stats: Stats, job: Job) -> bool:
    """The decoder's pieces to the job's events until a stop string, the end, or a cancel; whether
    a stop string ended it."""
    stop_filter, steps = StopFilter(job.stops), StepTracker(stats)
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
    return stop_filter.stopped


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", "shutting_down")


def check_fits(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    if max_tokens > 0 and n_prompt + max_tokens > n_ctx:
        raise ContextFullError(
            f"this model's context holds {n_ctx} tokens, but the request needs {n_prompt + max_tokens} "
            f"({n_prompt} in the prompt + {max_tokens} max_tokens): shorten the prompt or lower max_tokens")
    if n_prompt >= n_ctx:
        raise ContextFullError(f"the prompt is {n_prompt} tokens but this model's context holds {n_ctx}")
