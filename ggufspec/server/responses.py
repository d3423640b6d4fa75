"""OpenAI's response objects (completion, chat completion, their stream chunks) with llama.cpp's
`usage` and `timings` blocks, built from a job's events: whole, or as server-sent events."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request

from ..stats import Stats
from .errors import engine_error
from .jobs import Job


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


async def whole_answer(job: Job, reply: Reply, request: Request) -> dict:
    """The answer in one object, once the job is done (a client that leaves meanwhile: ClientGone)."""
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
