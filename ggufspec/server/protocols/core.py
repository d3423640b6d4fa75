"""The one request and the one answer that every protocol translates to and from.

The request is OpenAI chat's body (`ChatBody`): it already holds all that the engine takes (messages,
tools and tool_choice, sampling, stops, response_format and grammars, ggufspec's drafting fields),
and its checks (`shaping`, `request_options`) are the 400s every protocol gives. `Serving.submit`
turns it into a `Job` on the one engine, so drafting, constraints, the n-gram pool and the
statistics are the same whichever API a client speaks.

The answer is a sequence of `Text` (and a reasoning model's `Thinking`), `Calls` and `End`: the
job's pieces with the text a tool call may have begun in held back (`ChoiceState`, as chat streams
do), then the parsed calls, then why it ended. Where a call can go out as it is written
(server.callstream), `CallBegun` and `CallArguments` come first, and `Calls` says which of its calls
they were. Each protocol renders that sequence whole or as its own stream events."""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from ... import fim
from ... import tools as toolkit
from ...stats import Stats
from ..chatturn import AnswerStart, ChatSettings, chat_text
from ..choices import ChoiceState, with_calls
from ..constraints import Shaping, shaping
from ..control import Controls
from ..adapters import requested_scales
from ..errors import APIError, engine_error, validation_message
from ..guard import validated_data
from ..jobs import ClientGone, Engine, Job
from ..props import system_fingerprint
from .. import resumable
from ..samplers import sampler_chain
from ...sampling import LLAMACPP_FILTERS
from ..schemas import ChatBody, GenerationBody, message_dicts, request_options, stop_strings

# Fields of the OpenAI body that other protocols may send as extras (llama.cpp's and ggufspec's own).
ENGINE_EXTRAS = ("seed", "min_p", "draft", "lookup", "hybrid", "speculative", "cache_prompt", "repeat_penalty",
                 "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                 "dry_sequence_breakers", "frequency_penalty", "presence_penalty", "logit_bias", "grammar", "json_schema",
                 "ignore_eos", "chat_template_kwargs", "reasoning_budget_tokens", "thinking_budget_tokens",
                 "reasoning_budget_message", "lora", "sse_ping_interval", "samplers", *LLAMACPP_FILTERS)
PING_NEVER = 10 ** 9  # seconds: a longer sse_ping_interval (past a float's range even) is taken as this


@dataclass(frozen=True)
class Text:
    text: str
    logprobs: tuple = ()  # its tokens' entries (OpenAI's chat shape), where the request asked for them


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON text


@dataclass(frozen=True)
class Calls:
    calls: list[Call]
    # the calls sent as they were written (CallBegun, CallArguments), the first of `calls`, each
    # (name, its arguments as sent, whether they were whole); one cut short may be missing from `calls`
    streamed: tuple = ()


@dataclass(frozen=True)
class CallBegun:
    """A call being written (server.callstream): its name; its arguments follow as CallArguments."""
    name: str


@dataclass(frozen=True)
class CallArguments:
    delta: str  # more of the arguments' JSON text, as written


@dataclass(frozen=True)
class Evaluated:
    """The prompt is in: of its n_prompt tokens, n_cached came from the cache (before the first text)."""
    n_prompt: int
    n_cached: int


@dataclass(frozen=True)
class End:
    reason: str                   # "end" (end of sequence), "stop_sequence", "length", "tool_calls"
    stats: Stats
    stop_sequence: str | None = None
    estimate: dict | None = None  # the time saved against the target alone (ggufspec.estimate)


@dataclass
class Serving:
    """What the protocols need of the app: the engine, the decoder, the chat template's tool format,
    the command line's defaults (`chat`: its rules for chat requests) and the served model's names."""
    engine: Engine
    decoder: object
    tool_format: toolkit.ToolFormat
    defaults: dict
    model_name: str
    accepted_models: set = field(default_factory=set)
    thinking: tuple[bool, bool] = (False, False)  # reasoning.template_thinking: the template's <think> block
    fingerprint: str | None = None  # OpenAI's system_fingerprint (props.system_fingerprint)
    template_defaults: dict = field(default_factory=dict)  # --chat-template-kwargs: every request's variables
    reasoning_format: str = "auto"  # --reasoning-format: chat answers' thinking in reasoning_content, or not
    controls: Controls = field(default_factory=Controls)  # running chat completions, for their control requests
    sse_ping_interval: int = 30  # --sse-ping-interval: a stream's keep-alive pings (0 or less: none)
    chat: ChatSettings = field(default_factory=ChatSettings)  # --prefill-assistant, --skip-chat-parsing...
    default_stops: tuple[str, ...] = ()  # serve -r: the stop strings of a request that gives none (llama-server's)
    start_lora: tuple[float, ...] = ()  # the LoRA scales `fingerprint` was computed under (the command line's)
    _fingerprints: dict = field(default_factory=dict)  # other scales' fingerprints (`fingerprint_of`)

    def check_model(self, requested: str | None) -> None:
        # Lenient like llama.cpp where it costs nothing: no model, or any of the served model's names.
        if requested and requested not in self.accepted_models:
            raise APIError(404, f"model {requested!r} is not served here; this server serves {self.model_name!r}",
                           code="model_not_found")

    def call_id(self, prefix: str) -> str:
        """A new tool call's id: the protocol's kind (toolu_..., call_...), or the 9 letters and digits
        that Mistral's templates insist on when the conversation comes back."""
        if self.tool_format.name == "mistral":
            return toolkit.new_call_id(self.tool_format)
        return prefix + uuid.uuid4().hex[:24]

    def chat_body(self, translated: dict, extras: dict | None = None, names: dict | None = None) -> ChatBody:
        """The internal request: a protocol's translation, with the engine fields it passed through; a
        bad value a 400 naming the protocol's fields (`names`: chat's name -> the protocol's)."""
        passed = {name: value for name, value in (extras or {}).items() if name in ENGINE_EXTRAS}
        try:
            return validated_data(ChatBody, {**passed, **translated})  # thousands of messages a slice at a time
        except ValidationError as exc:
            raise renamed(APIError(400, validation_message(exc.errors())), names) from None

    def shape(self, body: ChatBody) -> Shaping:
        target, llm = self.decoder.target, self.decoder.target_llm
        return shaping(body, self.tool_format, target.n_vocab, lambda: target.end_of_generation_ids,
                       lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=False),
                       template_defaults=self.chat.template_defaults(self.template_defaults), thinks=self.thinking[0],
                       parse_calls=not self.chat.skip_chat_parsing)

    async def submit(self, body: GenerationBody, prefill: AnswerStart | str = "", names: dict | None = None, *,
                     prompt: str | list[int] | None = None, prompts: list | None = None, n: int = 1,
                     fit_to_context: bool = True, line_limits: dict | None = None) -> Job:
        """The request as a job on the engine; a bad value raises APIError 400, the fields it names
        renamed by `names` (chat's to the protocol's). The job renders `body.messages` through the chat
        template, or takes `prompt` (or each of `prompts`) as it is (/v1/completions); `n` choices of
        each (OpenAI's `n`), in as many slots at once as are free. With `fit_to_context` its max_tokens
        is lowered to what the context has room for (agents ask for more than it holds; OpenAI's chat
        API refuses such a request instead, as it always did).
        `prefill`: where the answer starts (chatturn.AnswerStart: a continued message), or Anthropic's
        prefill, a text written after the template's assistant turn, which the answer continues."""
        def prepared() -> dict:  # off the event loop: thousands of messages take a while
            if prompts is not None or prompt is not None:
                source = {"prompts": prompts if prompts is not None else [prompt]}
            else:
                source = {"messages": message_dicts(body.messages)}
            options, shape = sampler_chain(body, request_options(body, self.defaults), self.shape(body),
                                           self.defaults.get("constraints"), self.defaults.get("adaptive_target", -1) >= 0)
            stops = stop_strings(body.stop) or list(self.default_stops)
            return {"options": options, "stops": stops, "shape": shape, **source}
        try:
            lora = self.lora_of(body)
            job = Job(**await asyncio.to_thread(prepared), n=n, fit_to_context=fit_to_context, prefill=prefill,
                      line_limits=line_limits, timings_per_token=body.stream and body.timings_per_token,
                      return_progress=body.stream and body.return_progress)
        except APIError as exc:
            raise renamed(exc, names) from None
        job.lora = lora
        job.sse_ping_interval = self.sse_ping_interval if body.sse_ping_interval is None else \
            min(body.sse_ping_interval, PING_NEVER)
        self.engine.submit(job)
        return job

    def lora_of(self, body) -> tuple[float, ...] | None:
        """The target's LoRA scales the request runs under: its `lora` field's, else those POST /lora-adapters
        set last (at first, the command line's); None where the target has no adapters."""
        scales = self.engine.lora_scales if body.lora is None else requested_scales(body.lora, self.decoder)
        return scales or None  # (): no adapters

    def fingerprint_of(self, job) -> str | None:
        """The system fingerprint of a job's answer (`fingerprint_for` its LoRA scales)."""
        return self.fingerprint_for(job.lora)

    def fingerprint_for(self, lora: tuple[float, ...] | None) -> str | None:
        """The server's system fingerprint, but with these LoRA scales where they differ from those set at
        start (they change the target's logits)."""
        if lora is None or lora == self.start_lora:
            return self.fingerprint
        if lora not in self._fingerprints:
            self._fingerprints[lora] = system_fingerprint(self.decoder, lora=lora)
        return self._fingerprints[lora]

    async def fim(self, prefix: str, suffix: str, *, status: int, **options) -> list[int]:
        """A fill-in-the-middle prompt's tokens (`fim.fim_prompt`'s options), built off the event loop; a
        model without FIM tokens is refused with `status` (llama-server's /infill: 501)."""
        try:
            return await asyncio.to_thread(fim.fim_prompt, self.decoder, prefix, suffix, **options)
        except fim.FimUnsupportedError as exc:
            kind = "not_supported_error" if status == 501 else "invalid_request_error"
            raise APIError(status, str(exc), kind, "fim_not_supported") from None

    async def render(self, body: ChatBody, prefill: AnswerStart | str = "", names: dict | None = None) -> str:
        """The prompt as the request would be rendered through the chat template (its tools included);
        a bad value's fields renamed by `names`, as `submit` does."""
        def rendered() -> str:  # off the event loop
            try:
                shape, messages = self.shape(body), message_dicts(body.messages)
            except APIError as exc:
                raise renamed(exc, names) from None
            try:
                return chat_text(self.decoder, messages, shape, prefill)[0]
            except Exception as exc:  # the template refusing the messages: the client's mistake
                raise engine_error(exc) from None
        return await asyncio.to_thread(rendered)

    async def count_tokens(self, body: ChatBody, prefill: AnswerStart | str = "", names: dict | None = None) -> int:
        """The prompt's length in tokens, as the request would be rendered (its tools included)."""
        prompt = await self.render(body, prefill, names)
        return len(await asyncio.to_thread(self.decoder.tokenize, prompt))


def renamed(exc: APIError, names: dict | None) -> APIError:
    """The error with the request fields it names renamed from chat's to the protocol's."""
    for chat_name, name in (names or {}).items():
        exc.message = exc.message.replace(chat_name, name)
        exc.param = exc.param and exc.param.replace(chat_name, name)
    return exc


async def started(job: Job, request: Request | None) -> int:
    """The prompt's length once the job has started; its errors until then as APIError (with a
    `request`, a client gone meanwhile: ClientGone)."""
    kind, value = await job.next_event(request)
    if kind == "error":
        raise engine_error(value)
    return value


class PlainText:
    """The answer's text as it is (reasoning.ThinkingSplitter tells a reasoning model's thinking apart)."""

    def push(self, text: str) -> list:
        return [Text(text)]

    def flush(self) -> list:
        return []


async def answer_events(job: Job, request: Request | None = None, splitter=None, stream_calls: bool = False):
    """The job's answer as Text (and, through `splitter`, Thinking), Calls and End; an error from
    the engine raises APIError. With a `request`, a client that leaves cancels the job (ClientGone).
    `stream_calls`: a call goes out as it is written where it can (CallBegun, CallArguments)."""
    state = ChoiceState(0, job.shape, chat=True, stream_calls=stream_calls)
    splitter = splitter or PlainText()
    logprobs: list[dict] = []  # of pieces whose text has not gone out yet
    while True:
        kind, value = await (job.next_event(request) if request is not None else job.events.get())
        if kind == "pieces":
            pieces = state.push(value[1])
            logprobs += [p["logprobs"] for p in pieces if "logprobs" in p]
            text = "".join(p["text"] for p in pieces)
            if text:  # a token that ends mid-character has no text: nothing to send yet
                for event in with_logprobs(splitter.push(text), logprobs):
                    yield event
            for event in call_events(state.take_call_events()):
                yield event
        elif kind == "choice":
            _, stats, _, estimate = value
            # the text held back: content, or the calls and what is not them
            held, content, calls = state.end(cut_short=stats.stop_reason in ("n_predict", "context"))
            logprobs += [p["logprobs"] for p in held if "logprobs" in p and not calls]
            for event in with_logprobs((splitter.push(content) if content else []) + splitter.flush(), logprobs):
                yield event
            streamed = tuple(tuple(call) for call in state.streamed_calls)
            if calls or streamed:
                yield Calls([Call(c["function"]["name"], c["function"]["arguments"]) for c in calls], streamed)
            yield End(end_reason(stats, bool(calls)), stats, job.stop_sequence, estimate)
        elif kind == "prompt":
            yield Evaluated(value[1]["n_prompt"], value[1]["cache_n"])
        elif kind == "error":
            raise engine_error(value)
        elif kind == "done":
            return


def call_events(events: list[tuple]) -> list:
    """ChoiceState's call events as the answer's, a push's arguments in one CallArguments."""
    made = []
    for kind, value in events:
        if kind == "arguments" and made and isinstance(made[-1], CallArguments):
            made[-1] = CallArguments(made[-1].delta + value)
        else:
            made.append(CallBegun(value) if kind == "call" else CallArguments(value))
    return made


def with_logprobs(events: list, logprobs: list[dict]) -> list:
    """The events, the first Text carrying the log-probabilities of the tokens its text came from
    (`logprobs` emptied). Where the text was all thinking they are dropped: no API reports those."""
    if not events:
        return events
    first = next((i for i, e in enumerate(events) if isinstance(e, Text)), None)
    if first is not None and logprobs:
        events = [*events[:first], Text(events[first].text, tuple(logprobs)), *events[first + 1:]]
    logprobs.clear()
    return events


def end_reason(stats: Stats, called: bool) -> str:
    """Why the answer ended; one cut by max_tokens or the context says so, calls or not (llama-server's
    finish_reason "length" whatever it parsed; a call cut in two is dropped, the complete ones kept)."""
    return with_calls({"eos": "end", "stop": "stop_sequence"}.get(stats.stop_reason, "length"), called)


def arguments_object(arguments: str) -> dict:
    """A call's JSON arguments as an object (a grammar makes them valid; a free answer may not be)."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def joined_text(parts: list[str]) -> str:
    """Text blocks of one message as one content string (the template sees one)."""
    return "\n".join(part for part in parts if part)


async def respond(job: Job, request: Request, stream: bool, new_state, new_splitter=lambda: None):
    """The submitted job's answer, rendered by a protocol's state (`new_state(n_prompt)`: its
    `start()`, `on(event)` and `heartbeat()` give stream events, `whole()` the answer, `error(APIError)` a
    stream's error event), whole or streamed (`answer_or_stream`)."""
    async def whole(n_prompt: int) -> dict:
        state = new_state(n_prompt)
        async for event in answer_events(job, request, new_splitter()):
            state.on(event)
        return state.whole()

    async def events(n_prompt: int):
        state = new_state(n_prompt)
        try:
            for event in state.start():
                yield event
            async for answer_event in with_heartbeats(answer_events(job, splitter=new_splitter(), stream_calls=True),
                                                      job.sse_ping_interval):
                for event in state.heartbeat() if answer_event is HEARTBEAT else state.on(answer_event):
                    yield event
        except APIError as exc:  # after the stream started: the protocol's error event ends it
            yield state.error(exc)
        finally:  # a client that leaves closes the stream: the worker stops at the next token
            job.cancel()

    return await answer_or_stream(job, request, stream, whole, events)


HEARTBEAT = object()  # `with_heartbeats`' word that nothing came for a while


async def with_heartbeats(events, seconds: float):
    """`events`, and HEARTBEAT each time `seconds` pass without one (0 or less: never). A protocol's own
    keep-alive event goes out then (Anthropic's `ping`, a numbered `response.in_progress`), through a
    prompt evaluated for minutes or a tool call held back until it is whole: SSE comments (the transport's
    pings) are dropped by clients' event parsers, and Codex, timing its stream by events, gave up after
    300 s of them and sent the request again (audit; openai/codex#31539)."""
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
                await asyncio.sleep(0)  # where the next event is ready, one turn of the loop brings it: no timer
            if not pending.done():
                done, _ = await asyncio.wait({pending}, timeout=seconds if seconds > 0 else None)
                if not done:
                    yield HEARTBEAT
                    continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # the consumer left mid-wait: the answer's generator stops where it waits
            pending.cancel()
            await asyncio.wait({pending})  # (its cancellation is the generator's end; waiting raises nothing)
        await events.aclose()


async def answer_or_stream(job: Job, request: Request, stream: bool, whole, events):
    """Every protocol's answer: `whole(n_prompt)` (a coroutine: the answer's JSON object) or
    `events(n_prompt)` (an async generator of SSE events that cancels the job when it ends), once
    the job has started, so that its errors until then are HTTP statuses. A client gone before the
    answer cancels it; a stream naming its conversation (X-Conversation-Id) is `resumable`."""
    streaming = False
    conversation = resumable.conversation_id(request) if stream else None
    # as llama-server: its stream exists at once, and no longer depends on the connection (a page reloaded
    # while the prompt is evaluated reads it too)
    session = resumable.open_stream(request, conversation, job) if conversation else None
    try:
        n_prompt = await started(job, None if session else request)
        if not stream:
            return JSONResponse(await whole(n_prompt))
        if session is not None and session.cancelled:  # stopped (DELETE) before it began
            raise ClientGone
        ping = max(job.sse_ping_interval, 0)  # a keep-alive comment every N seconds through a long prompt
        response = resumable.resumable_response(session, events(n_prompt), ping) if session \
            else EventSourceResponse(events(n_prompt), sep="\n", ping=ping)
        streaming = True
        return response
    except ClientGone:
        return JSONResponse({}, status_code=499)  # nginx's "client closed request"; nobody reads it
    finally:
        if not streaming:  # from here on the stream's own `finally` cancels it
            job.cancel()
            if session is not None:  # refused before it began: no stream left behind
                resumable.drop(request, session)


def sse(event: str | None, data: dict) -> dict:
    return {**({"event": event} if event else {}), "data": json.dumps(data, ensure_ascii=False)}
