"""OpenAI's response objects (completion, chat completion, their stream chunks) with llama.cpp's
`usage` and `timings` blocks, built from a job's events: whole, or as server-sent events."""
from __future__ import annotations

import json
import math
import time
import uuid

from fastapi import Request

from ..stats import Stats
from ..tools import new_call_id
from .choices import ChoiceState, shown_pieces, with_calls
from .constraints import Shaping
from .errors import engine_error
from .jobs import Job
from .progress import StreamExtras


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
            "draft_n": stats.n_drafted, "draft_n_accepted": stats.n_accept, "id_slot": stats.id_slot}


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": stats.n_predict,
            "total_tokens": stats.n_prompt + stats.n_predict,
            "prompt_tokens_details": {"cached_tokens": stats.n_prompt_cached}}


def probability_entry(entry: dict) -> dict:
    """A log-probability entry (its top_logprobs' too) as llama-server's post_sampling_probs writes it:
    prob and top_probs, the probabilities of the same distribution."""
    renamed = {"logprob": "prob", "top_logprobs": "top_probs"}
    return {renamed.get(key, key): (math.exp(value) if key == "logprob" and value is not None else
                                    [probability_entry(top) for top in value] if key == "top_logprobs" else value)
            for key, value in entry.items()}


class Reply:
    """The JSON objects of one answer, chat or text completion, whole or in chunks, its choices
    (`n` of them) filled as their pieces come. `post_sampling_probs`: chat's log-probabilities as
    probabilities (llama-server's field)."""

    def __init__(self, model: str, chat: bool, shape: Shaping | None = None, n: int = 1,
                 fingerprint: str | None = None, new_reasoning=None, post_sampling_probs: bool = False):
        self.model, self.chat, self.fingerprint = model, chat, fingerprint
        self.post_sampling_probs = post_sampling_probs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        # new_reasoning: a reasoning model's thinking as reasoning_content (reasoning.reasoning_content_for)
        # a stream's calls go out as they are written where they can (callstream); whole answers parse at the end
        self.choices = [ChoiceState(i, shape or Shaping(), chat, new_reasoning, stream_calls=True) for i in range(n)]

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def whole(self, stats: Stats, estimate: dict | None = None) -> dict:
        choices = []
        for state in self.choices:
            if self.chat:
                message, called = state.message(cut_short=state.finish == "length")
                choice = {"index": state.index, "message": message}
                finish = with_calls(state.finish, called)
            else:
                choice = {"index": state.index, "text": "".join(p["text"] for p in state.pieces)}
                finish = state.finish
            choice.update(finish_reason=finish, logprobs=self.logprobs(state, state.pieces))
            choices.append(choice)
        return self._object("chat.completion" if self.chat else "text_completion", choices,
                            usage=usage(stats), timings=timings(stats),
                            ggufspec={"stats": stats.to_dict(), "estimate": estimate})

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False, index: int = 0,
              logprobs: dict | None = None, tool_calls: list | None = None, reasoning: str = "", **extra) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {} if text is None else {"content": text}
            if reasoning:  # llama-server's field for a reasoning model's thinking
                delta["reasoning_content"] = reasoning
            if tool_calls:  # each with its "index"
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(finish_reason=finish, logprobs=logprobs)
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def pieces_chunks(self, index: int, pieces: list[dict], prompt: dict | None = None) -> list[dict]:
        """A chunk of text, and per token where it came from (see the README: "Streaming");
        the first one also says how much of the prompt the cache held. Nothing while all of it is held back."""
        state = self.choices[index]
        released = state.push(pieces)
        thinking = state.take_thinking()
        calls = call_deltas(state, state.take_call_events())
        if not released and not prompt and not thinking and not calls:
            return []
        extra = {"pieces": shown_pieces(released), **({"prompt": prompt} if prompt else {})}
        text = "".join(p["text"] for p in released) if released else None  # the prompt's figures alone: no content
        if thinking and not text:  # thinking alone: no content key
            text = None
        return [self.chunk(text, index=index, logprobs=self.logprobs(state, released), reasoning=thinking,
                           tool_calls=calls, ggufspec=extra)]

    def choice_end_chunks(self, index: int, stats: Stats, finish: str, estimate: dict | None) -> list[dict]:
        """What the choice held back (content, or its tool calls), then its finish_reason."""
        state = self.choices[index]
        held, content, calls = state.end(cut_short=finish == "length")
        thinking = state.take_thinking()
        chunks = []
        if held or thinking:
            text = content if content is not None or calls or thinking else ""
            streamed = len(state.streamed_calls)  # sent as they were written: not again
            rest = [{"index": streamed + i, **call} for i, call in enumerate(calls[streamed:])]
            chunks.append(self.chunk(text, index=index, logprobs=self.logprobs(state, held), tool_calls=rest,
                                     reasoning=thinking, ggufspec={"pieces": shown_pieces(held)}))
        finish = with_calls(finish, bool(calls))
        chunks.append(self.chunk(None, finish, index=index, timings=timings(stats),
                                 ggufspec={"stats": stats.to_dict(), "estimate": estimate}))
        return chunks

    def logprobs(self, state: ChoiceState, pieces: list[dict]) -> dict | None:
        """The pieces' log-probabilities in the API's shape (None: not asked for), as probabilities where
        post_sampling_probs asks (chat's entries: /v1/completions refuses it)."""
        found = state.logprobs(pieces)
        if found is None or not self.post_sampling_probs:
            return found
        return {**found, "content": [probability_entry(entry) for entry in found["content"]]}

    def usage_chunk(self, stats: Stats) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [],
                            usage=usage(stats), timings=timings(stats))


def call_deltas(state: ChoiceState, events: list[tuple]) -> list[dict]:
    """The calls being written (`ChoiceState.take_call_events`) as OpenAI's tool_calls deltas: a call's
    index, id, type and name in its first, with the arguments so far; then more of them."""
    index = len(state.streamed_calls) - sum(kind == "call" for kind, _ in events) - 1  # the call open before
    deltas: list[dict] = []
    for kind, value in events:
        if kind == "call":
            index += 1
            deltas.append({"index": index, "id": new_call_id(state.shape.fmt), "type": "function",
                           "function": {"name": value, "arguments": ""}})
        elif deltas and deltas[-1]["index"] == index:
            deltas[-1]["function"]["arguments"] += value
        else:
            deltas.append({"index": index, "function": {"arguments": value}})
    return deltas


async def whole_answer(job: Job, reply: Reply, request: Request) -> dict:
    """The answer in one object, once the job is done (a client that leaves meanwhile: ClientGone)."""
    while True:
        kind, value = await job.next_event(request)
        if kind == "pieces":
            index, pieces = value
            reply.choices[index].pieces.extend(pieces)
        elif kind == "choice":
            index, _, finish, _ = value
            reply.choices[index].finish = finish
        elif kind == "done":
            stats, estimate = value
            return reply.whole(stats, estimate)
        elif kind == "error":
            raise engine_error(value)


async def stream_events(job: Job, reply: Reply, include_usage: bool):
    """SSE events: OpenAI's chunks, then [DONE]. A client that goes away cancels the generation
    (sse-starlette cancels this generator; `finally` tells the worker, which stops at the next token)."""
    def event(obj):
        return {"data": json.dumps(obj, ensure_ascii=False)}
    prompts: dict[int, dict] = {}  # a choice's prompt figures, sent with its next pieces
    extras = StreamExtras(job)  # llama-server's prompt_progress and per-token timings, where asked
    try:
        if reply.chat:
            for state in reply.choices:
                # content null, as llama-server and OpenAI begin: an answer that only calls tools keeps it null
                yield event(reply.chunk(None, role=True, index=state.index))
        while True:
            kind, value = await job.events.get()
            for chunk in event_chunks(reply, extras, prompts, kind, value, include_usage):
                yield event(chunk)
            if kind in ("done", "error"):
                break
        yield {"data": "[DONE]"}
    finally:
        job.cancel()


def event_chunks(reply: Reply, extras: StreamExtras, prompts: dict, kind: str, value, include_usage: bool) -> list:
    """The chunks one of the job's events gives."""
    progress = extras.progress_of(kind, value)
    chunks = [reply.chunk(None, role=reply.chat, index=progress[0], prompt_progress=progress[1])] if progress else []
    if kind == "prompt":
        prompts[value[0]] = value[1]
    elif kind == "pieces":
        pieces_chunks = reply.pieces_chunks(*value, prompts.get(value[0]))
        if pieces_chunks:
            prompts.pop(value[0], None)
        stats = extras.stats_of(*value)
        chunks += [{**chunk, "timings": timings(stats)} for chunk in pieces_chunks] if stats else pieces_chunks
    elif kind == "choice":
        chunks += reply.choice_end_chunks(*value)
    elif kind == "done":
        chunks += [reply.usage_chunk(value[0])] if include_usage else []
    elif kind == "error":
        chunks += [engine_error(value).body()]
    return chunks
