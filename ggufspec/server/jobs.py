"""Generations at once, one per slot: the `Engine` owns the decoder and a worker thread per slot
(`--parallel`), where every llama.cpp call runs; the slots take turns and their decodes meet in one
batch per step (`ggufspec.slots`). A `Job` is one request's generation, handing its pieces to the
event loop through an asyncio queue; a request for several choices (OpenAI's `n`, a list of prompts)
runs them in up to as many slots at once, in `Part`s. Beyond --max-queue parts waiting for a slot: 429."""
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

from ..errors import CacheFullError, ContextFullError, GgufspecError
from ..lora import scales_of
from ..checks import check_token_ids
from ..stats import Stats
from ..stops import LineLimits, StopFilter
from .chatturn import AnswerStart, chat_text
from .choices import logprob_entry
from .constraints import Shaping, engine_constraints
from .errors import APIError
from .metrics import Metrics
from .progress import PromptProgress
from .speculation import StepTracker, prompt_info, time_estimate

log = logging.getLogger("ggufspec.server")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "n_predict": "length", "context": "length"}


class ClientGone(Exception):
    pass


class Job:
    """One request's generation: `n` choices of each prompt (`prompts`, /v1/completions' list; else
    `prompt`, or `messages` through the chat template), choice `i * n + j` being prompt i's j-th. The
    worker threads fill `events`; the request's task reads them: ("started", n_prompt), ("progress", (index,
    prompt_progress)) while a prompt is evaluated (return_progress), ("prompt", (index, {cache_n...})) before a
    choice's first pieces, ("pieces", (index, [piece, ...])), ("choice", (index, stats,
    finish_reason, estimate)) as each choice ends, then ("done", (stats of them all, estimate)) or
    ("error", exc), once whichever part of it fails first."""

    def __init__(self, *, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                 prompts: list | None = None, options: dict, stops: list[str], shape: Shaping | None = None,
                 n: int = 1, fit_to_context: bool = False, prefill: AnswerStart | str = "",
                 line_limits: dict | None = None, timings_per_token: bool = False, return_progress: bool = False):
        self.prompts = prompts if prompts is not None else [prompt]
        self.messages, self.options, self.stops = messages, options, stops
        # where the answer starts (chatturn): a continued message, or Anthropic's prefill, a text it continues
        self.prefill = prefill
        # max_tokens as a ceiling that the context lowers, not a demand it refuses (Anthropic's
        # max_tokens is required, and agents ask for tens of thousands whatever the context)
        self.fit_to_context = fit_to_context
        self.shape, self.n = shape or Shaping(), n
        self.n_choices = n * len(self.prompts)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self._next_check = 0.0  # when next_event next asks whether the client is still there
        self.progressed_at = time.monotonic()  # the last token or event (a hung RPC worker stops them)
        self.stop_sequence: str | None = None  # the stop string that ended the last choice, if one did
        self.stop_sequences: dict[int, str] = {}  # ... and each choice's, by index
        self.started = False  # "started" sent (once: a prompt that found no room starts again)
        self.line_limits = line_limits  # stops.LineLimits' keywords (/infill's n_indent, t_max_predict_ms)
        # llama-server's stream extras: pieces carry the statistics so far; "progress" events while the prompt is in
        self.timings_per_token, self.return_progress = timings_per_token, return_progress
        self.opens_thinking = False  # the rendered prompt ends in <think>: the answer starts inside it
        self.sse_ping_interval = 30  # seconds between its stream's keep-alive pings (0 or less: none)
        self.lora: tuple[float, ...] | None = None  # the target's LoRA scales it runs under (None: the context's)
        self._lock = threading.Lock()  # the parts' shared state below
        self._tokens: list | Exception | None = None  # every prompt's tokens (or why they cannot run)
        self._results: dict[int, Stats] = {}  # each ended choice's statistics, by index
        self._parts_left = 0
        self.failed = False  # an "error" went out: the other parts stop, and "done" never comes

    def parts(self, n_parts: int) -> list["Part"]:
        """The choices shared among up to `n_parts` parts, round robin, so that the first ones end first."""
        n_parts = max(1, min(n_parts, self.n_choices))
        self._parts_left = n_parts
        return [Part(self, list(range(p, self.n_choices, n_parts))) for p in range(n_parts)]

    def start(self, n_prompt: int) -> None:
        with self._lock:  # "started" before any part's pieces
            if not self.started:
                self.started = True
                self.emit("started", n_prompt)

    def prompt_tokens(self, tokenize) -> list[list[int]]:
        """Every prompt's tokens, made once by the first part that asks (`tokenize(job, prompt)`),
        so that a prompt that cannot run fails the request before any choice is generated."""
        with self._lock:
            if self._tokens is None:
                try:
                    self._tokens = [tokenize(self, prompt) for prompt in self.prompts]
                except Exception as exc:
                    self._tokens = exc
        if isinstance(self._tokens, Exception):
            raise self._tokens
        return self._tokens

    def choice_ended(self, index: int, stats: Stats) -> None:
        with self._lock:
            self._results[index] = stats

    def part_ended(self) -> Stats | None:
        """A part has ended; the statistics of every choice where it was the last and none failed."""
        with self._lock:
            self._parts_left -= 1
            if self._parts_left or self.failed or not self._results:
                return None
            return summed(self._results, self.n)

    def fail(self, exc: Exception) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        self.cancelled.set()  # the other parts stop at their next token
        self.emit("error", exc)

    def gone(self) -> bool:
        """Whether its client has left: asked between a long prompt's chunks and while it waits for
        room in the cache, which are progress too (not a hung RPC worker: `stalled_seconds`)."""
        self.progressed_at = time.monotonic()
        return self.cancelled.is_set()

    def emit(self, kind: str, value: Any = None) -> None:
        self.progressed_at = time.monotonic()
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


@dataclasses.dataclass(eq=False)
class Part:
    """Some of a job's choices, generated one after another in one slot."""
    job: Job
    choices: list[int]


class Engine:
    """The decoder's slots and a worker thread each. Jobs start in arrival order as slots free up."""

    def __init__(self, decoder, max_queue: int):
        self.decoder = decoder
        self.slots = decoder.slots
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="ggufspec-slot")
        self._lock = threading.RLock()  # `waiting` takes it too, also from within `submit`
        self._pending = 0              # submitted and not finished, the running ones included
        self._queued: set[Part] = set()  # submitted and not started
        self._mean_seconds = 5.0       # a generation's duration, for Retry-After
        self._current: set[Part] = set()
        self.last: Stats | None = None   # the last finished generation's statistics (/health shows them)
        self.metrics = Metrics()        # every choice's, summed (/metrics with `serve --metrics`)
        self.special = False            # serve -sp: control tokens in answers as their text (llama-server's)
        self.lora_scales = scales_of(decoder.target_llm)  # of requests without `lora` (POST /lora-adapters)
        self._stopping = False

    @property
    def waiting(self) -> int:
        """Parts waiting for a slot. Those whose client left are not counted: they cost nothing when
        their turn comes (`_run`), so they do not hold a place in the queue (llama-server drops them too)."""
        with self._lock:  # the workers add and discard meanwhile
            return sum(not part.job.cancelled.is_set() for part in self._queued)

    @property
    def running(self) -> int:
        with self._lock:
            return self._pending - len(self._queued)

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0

    @property
    def stalled_seconds(self) -> float:
        """How long a running generation has gone without a token (0 when none runs): what `serve
        --rpc`'s supervisor compares with --rpc-timeout to find a hung worker."""
        now = time.monotonic()
        return max((now - part.job.progressed_at for part in list(self._current)), default=0.0)

    def submit(self, job: Job) -> None:
        """The job's parts (as many as slots, where the queue has room for them), each to wait for a
        slot; a 429 where not even one finds a place."""
        with self._lock:
            if self._stopping:
                raise shutting_down()
            room = len(self.slots) + self.max_queue - self.running - self.waiting
            if room < 1:  # every slot busy, max_queue waiting
                retry = max(1, math.ceil(self._mean_seconds * (self.waiting + 1) / len(self.slots)))
                raise APIError(429, f"the server is busy: {self.waiting} requests are waiting for one of "
                               f"{len(self.slots)} slots (--max-queue {self.max_queue}); retry later",
                               "rate_limit_error", "queue_full", headers={"Retry-After": str(retry)})
            parts = job.parts(min(len(self.slots), room))
            self._pending += len(parts)
            self._queued.update(parts)
        for part in parts:
            self._executor.submit(self._run, part)

    def _run(self, part: Part) -> None:
        job = part.job
        with self._lock:
            self._queued.discard(part)
        started, ran = time.perf_counter(), False
        try:
            if self._stopping:
                job.fail(shutting_down())
            elif not job.cancelled.is_set():  # a client that left while waiting costs nothing
                ran = True
                job.progressed_at = time.monotonic()
                self._current.add(part)
                self._generate(part)
        # GgufspecError, APIError: the client's mistake or the shutdown; anything else: ours, logged
        except Exception as exc:
            if not isinstance(exc, (GgufspecError, APIError)):
                log.exception("generation failed")
            job.fail(exc)
        finally:
            self._current.discard(part)
            with self._lock:
                self._pending -= 1
                if ran:  # what a generation takes, for Retry-After
                    self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.perf_counter() - started)
            self._part_ended(job)

    def _part_ended(self, job: Job) -> None:
        try:
            total = job.part_ended()
            if total is not None:  # the job's last part: its answer is whole
                self.last = total
                job.emit("done", (total, time_estimate(self.decoder, job.options.get("drafter", "model"), total)))
        except Exception as exc:  # never a request left waiting for its "done"
            log.exception("ending a generation failed")
            job.fail(exc)

    def _generate(self, part: Part) -> None:
        job = part.job
        every_tokens = job.prompt_tokens(self._prompt_tokens)
        options = dict(job.options)
        constraints = engine_constraints(job.shape, self._single_tokens(job.shape.triggers),
                                         options.pop("constraints", None))
        if constraints is not None and constraints.tracks_thinking and job.messages is not None:
            # where the rendered prompt (and prefill) left the answer: inside a <think> block or not
            constraints = dataclasses.replace(constraints, thinking_opened=job.opens_thinking)
        if constraints is not None:
            options["constraints"] = constraints
        if job.shape.logprobs is not None:
            options["logprobs"] = job.shape.logprobs
        while part.choices and not job.cancelled.is_set():
            prompt_index = part.choices[0] // job.n
            try:  # a prompt that found no room in the unified cache: again once a slot ends
                self.slots.retrying(lambda: self._generate_in_a_slot(part, prompt_index, every_tokens[prompt_index],
                                                                     options), given_up=job.gone,
                                    patience=None)  # until its client leaves, as before
            except CacheFullError:
                if self._stopping and job.cancelled.is_set():
                    raise shutting_down()
                raise

    def _generate_in_a_slot(self, part: Part, prompt_index: int, tokens: list[int], options: dict) -> None:
        """The part's choices of one prompt, one after another in the slot caching most of it (the
        choices after the first find it cached), until they are done or the job is cancelled."""
        job = part.job
        with self.slots.use(tokens, job.lora) as decoder:  # the slot caching most of the prompt, its turns begun
            pieces = PieceMaker(decoder, job, self._marker_texts(job.shape), self.special)
            while part.choices and part.choices[0] // job.n == prompt_index and not job.cancelled.is_set():
                index = part.choices[0]
                choice_options = dict(options)
                room = decoder.n_ctx - len(tokens)  # a max_tokens the context lowers: this prompt's room, not another's
                if job.fit_to_context and choice_options.get("n_predict", -1) > room > 0:
                    choice_options["n_predict"] = room
                if job.options.get("seed") is not None:  # each of a prompt's choices its own seed
                    choice_options["seed"] = job.options["seed"] + index % job.n
                self._choice(decoder, job, tokens, choice_options, index, pieces)
                part.choices.pop(0)

    def _choice(self, decoder, job: Job, tokens: list[int], options: dict, index: int, pieces: "PieceMaker") -> None:
        stream = decoder.stream(tokens, **options)  # checks the options before anything runs
        stats = decoder.last_stats
        job.start(len(tokens))
        contexts = [ctx for ctx in (decoder.target, decoder.draft) if ctx is not None]
        for ctx in contexts:  # a client gone stops a long prompt, or the draft's catch-up, between chunks
            ctx.should_stop = job.gone
        if job.return_progress:  # asked between the prompt's chunks, it also says how far the prompt got
            decoder.target.should_stop = PromptProgress(job, index, decoder.target, stats)
        try:
            ended_by = relay(stream, stats, job, index, pieces)
        finally:
            stream.close()  # the engine keeps its caches consistent; the next prompt reuses them
            for ctx in contexts:
                ctx.should_stop = None
            self.metrics.add(stats)  # cut short or not, its tokens were computed
        if self._stopping and job.cancelled.is_set():
            # cut short by the shutdown: an error, not a finish_reason that says the answer is whole
            # (a stream has its tokens already; an answer not streamed is a 503 to retry elsewhere)
            raise shutting_down()
        if job.failed:  # another part failed: its error is the answer
            return
        result = dataclasses.replace(stats)
        if ended_by:  # a stop string, or a line limit (llama-server's stop_type "limit")
            result.stop_reason = {"stop": "stop", "limit": "n_predict"}[ended_by]
        # in the slot's turn, the only one that changes the decoder's measured costs
        estimate = time_estimate(decoder, options.get("drafter", "model"), result)
        job.choice_ended(index, result)
        job.emit("choice", (index, result, FINISH_REASONS.get(result.stop_reason, "stop"), estimate))

    def _prompt_tokens(self, job: Job, prompt) -> list[int]:
        """A prompt of the job (or its conversation, through the chat template) as tokens that fit the context."""
        decoder = self.decoder
        if job.messages is not None:
            prompt, job.opens_thinking = chat_text(decoder, job.messages, job.shape, job.prefill)
        n_predict = job.options.get("n_predict", -1)
        if isinstance(prompt, str):  # a max_tokens that the context lowers (fit_to_context) refuses nothing
            tokens = tokenize_within(decoder, prompt, -1 if job.fit_to_context else n_predict)
        else:
            tokens = decoder.tokenize(prompt)
        check_fits(len(tokens), -1 if job.fit_to_context else n_predict, decoder.n_ctx)  # (lowered per prompt: _choices)
        check_token_ids(tokens, decoder.target.n_vocab)  # the engine's own check, before a slot is chosen
        return tokens

    def _single_tokens(self, texts) -> tuple[int, ...]:
        """The ids of those `texts` that are one token (special tokens included): lazy grammar triggers."""
        return tuple(self._one_token_each(texts))

    def _one_token_each(self, texts) -> dict[int, str]:
        """{id: text} for those `texts` that are one token (special tokens included)."""
        found = {}
        for text in texts:
            ids = self.decoder.target_llm.tokenize(text.encode(), add_bos=False, special=True)
            if len(ids) == 1:
                found[ids[0]] = text
        return found

    def _marker_texts(self, shape: Shaping) -> dict[int, str]:
        """Control tokens that start a tool call ([TOOL_CALLS], <|python_tag|>) print nothing: their
        text, so that the call can be parsed (and shows, if it cannot)."""
        if not (shape.plan.parse or shape.plan.tools):  # parsed, or left as text (parse_tool_calls false)
            return {}
        # the format's call openers, whether a lazy grammar waits for them or not (a forced call, a call or a
        # format under one grammar: `shape.triggers` is empty there, and a Mistral call lost its [TOOL_CALLS])
        return {token: text for token, text in self._one_token_each(shape.plan.triggers).items()
                if not self.decoder.target.piece(token)}

    def stop(self) -> None:
        """Shutting down: the running generations end at their next token (a stream keeps what it was
        sent, then an error event says the answer was cut short), waiting ones get 503. Safe to call
        from a signal handler."""
        self._stopping = True
        for part in list(self._current):
            part.job.cancel()

    def close(self) -> None:
        self.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)


class PieceMaker:
    """A decoder's Piece as the dict that streams: StepTracker's fields, the text of a marker token (or,
    with `special`, of any control token), and its log-probabilities (an OpenAI chat entry) when the
    request asked for them."""

    def __init__(self, decoder, job: Job, markers: dict[int, str], special: bool = False):
        self.decoder, self.markers, self.logprobs = decoder, markers, job.shape.logprobs is not None
        self.special = special
        target = decoder.target

        def token_bytes(token: int) -> bytes:  # a control token prints nothing: its name, as OpenAI's
            return target.piece(token) or target.token_text(token)
        self.token_bytes = token_bytes

    def __call__(self, piece, steps: StepTracker) -> dict:
        made = steps.annotate(piece)
        if piece.token in self.markers:
            made["text"] = self.markers[piece.token]
        elif self.special and not made["text"] and not self.decoder.target.piece(piece.token):  # a control token
            made["text"] = self.decoder.target.token_text(piece.token).decode("utf-8", "replace")
        if self.logprobs:
            token_bytes = self.token_bytes
            top = [(token_bytes(token), value) for token, value in getattr(piece, "top_logprobs", ())]
            made["logprobs"] = logprob_entry(token_bytes(piece.token), getattr(piece, "logprob", None), top)
            made["top_ids"] = [token for token, _ in getattr(piece, "top_logprobs", ())]  # llama-server's n_probs
        return made


def relay(stream, stats: Stats, job: Job, index: int = 0, make=None) -> str | None:
    """The decoder's pieces to the job's events until a stop string, a line limit, the end, or a
    cancel; "stop" where a stop string ended it, "limit" where a line limit did (`job.line_limits`)."""
    stop_filter, steps = StopFilter(job.stops), StepTracker(stats)
    limits = LineLimits(**job.line_limits) if job.line_limits else None
    make = make or (lambda piece, tracker: tracker.annotate(piece))
    for n_pieces, piece in enumerate(stream):
        job.progressed_at = time.monotonic()  # a token, whether or not a stop string holds it back
        if job.cancelled.is_set():
            break
        if n_pieces == 0:  # the choice's first token: its prompt has been evaluated
            job.emit("prompt", (index, prompt_info(stats)))
        released = stop_filter.push(make(piece, steps))
        if limits is not None:
            released = limits.apply(released)
        if released:
            if job.timings_per_token:  # a copy: the worker goes on counting while the loop renders it
                released[-1]["stats"] = dataclasses.replace(stats)
            job.emit("pieces", (index, released))
        if limits is not None and limits.stopped:
            return "limit"
        if stop_filter.stopped:
            job.stop_sequence = job.stop_sequences[index] = stop_filter.matched
            return "stop"
    else:
        if stop_filter.pending:
            held = stop_filter.flush()
            job.emit("pieces", (index, limits.apply(held) if limits is not None else held))
            if limits is not None and limits.stopped:
                return "limit"
    return None


def summed(results: dict[int, Stats], n: int) -> Stats:
    """The choices' statistics (by index; `n` per prompt) as one answer's: each prompt once (its
    first choice's figures: the later ones find it cached), the generated tokens and times summed."""
    ordered = [results[index] for index in sorted(results)]
    firsts = {index // n: results[index] for index in sorted(results, reverse=True)}  # each prompt's first
    totals = {name: sum(getattr(stats, name) for stats in ordered)
              for name in ("n_predict", "decode_seconds", "n_drafted", "n_accept", "n_steps", "n_draft_steps",
                           "draft_seconds", "target_seconds")}
    prompts = {name: sum(getattr(stats, name) for stats in firsts.values())
               for name in ("n_prompt", "n_prompt_cached", "prompt_seconds")}
    return dataclasses.replace(ordered[-1], **prompts, **totals)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", "shutting_down")


def tokenize_within(decoder, text: str, max_tokens: int) -> list[int]:
    """`text`'s tokens, refused (ContextFullError) without tokenizing it all when a part of it already
    does not fit the context: prefixes four times longer each time, from a few characters per token of
    the context, so that a prompt of megabytes costs what a context's worth of it does."""
    n_ctx = decoder.n_ctx
    room = n_ctx - max(max_tokens, 0)
    size = max(PREFIX_CHARS_PER_TOKEN * n_ctx, 4096)
    while size < len(text):
        n_prefix = len(decoder.tokenize(text[:size]))
        if n_prefix - PREFIX_SLACK > room or n_prefix - PREFIX_SLACK >= n_ctx:  # the cut may merge a few tokens
            n_prefix -= PREFIX_SLACK
            wanted = f" + {max_tokens} max_tokens" if max_tokens > 0 else ""
            raise ContextFullError(
                f"the prompt is more than {n_prefix} tokens (its first {size} characters alone are){wanted}, but "
                f"this model's context holds {n_ctx}: shorten the prompt" + (" or lower max_tokens" if wanted else ""))
        size *= 4
    return decoder.tokenize(text)


PREFIX_CHARS_PER_TOKEN = 8  # the first prefix tried: this many characters per token of the context
PREFIX_SLACK = 8  # tokens that a prefix may have more than the whole text has there (a cut word)


def check_fits(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    if n_prompt >= n_ctx:  # first: lowering max_tokens cannot help
        raise ContextFullError(f"the prompt is {n_prompt} tokens but this model's context holds {n_ctx}")
    if max_tokens > 0 and n_prompt + max_tokens > n_ctx:
        raise ContextFullError(
            f"this model's context holds {n_ctx} tokens, but the request needs {n_prompt + max_tokens} "
            f"({n_prompt} in the prompt + {max_tokens} max_tokens): shorten the prompt or lower max_tokens")
