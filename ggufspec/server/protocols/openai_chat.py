"""OpenAI's Chat Completions and Completions APIs, `/v1/chat/completions` and `/v1/completions` (the
chat page's, aider's, opencode's): the internal request's own shape, so the body goes to the engine as
it is (schemas.py reads it); responses.py renders its answer, with several choices, logprobs and
llama.cpp's `timings`."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from ..jobs import Job
from ..responses import Reply, stream_events, whole_answer
from ..schemas import (ChatBody, CompletionBody, GenerationBody, message_dicts, request_options, single_prompt,
                       stop_strings)
from .core import Serving, answer_or_stream


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        return await answer(serving, request, body, {"prompt": single_prompt(body.prompt)}, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        messages = await asyncio.to_thread(message_dicts, body.messages)  # thousands of them take a while
        return await answer(serving, request, body, {"messages": messages}, chat=True)


async def answer(serving: Serving, request: Request, body: GenerationBody, job_args: dict, chat: bool):
    """The body as a job on the engine, answered whole or as OpenAI's chunks."""
    serving.check_model(body.model)
    shape = serving.shape(body)
    job = Job(options=request_options(body, serving.defaults), stops=stop_strings(body.stop), shape=shape, n=body.n,
              **job_args)
    reply = Reply(serving.model_name, chat, shape, body.n)
    serving.engine.submit(job)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await answer_or_stream(job, request, body.stream, lambda n_prompt: whole_answer(job, reply, request),
                                  lambda n_prompt: stream_events(job, reply, include_usage))
