"""OpenAI's Chat Completions and Completions APIs, `/v1/chat/completions` and `/v1/completions` (the
chat page's, aider's, opencode's): the internal request's own shape, so the body goes to the engine as
it is (schemas.py reads it); responses.py renders its answer, with several choices, logprobs and
llama.cpp's `timings`."""
from __future__ import annotations

from fastapi import FastAPI, Request

from ..errors import APIError
from ..responses import Reply, stream_events, whole_answer
from ..schemas import ChatBody, CompletionBody, GenerationBody, single_prompt
from .core import Serving, answer_or_stream


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        prompt = single_prompt(body)
        if body.suffix:  # insert text between the prompt and the suffix: a code model's fill in the middle
            if not isinstance(prompt, str):
                raise APIError(400, "suffix needs prompt as text, not token ids", code="invalid_value")
            prompt = await serving.fim(prompt, body.suffix, status=400, trim=False)
        return await answer(serving, request, body, chat=False, prompt=prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        return await answer(serving, request, body, chat=True)


async def answer(serving: Serving, request: Request, body: GenerationBody, chat: bool, prompt=None):
    """The body as a job on the engine (its messages, or /v1/completions' prompt), answered whole or as
    OpenAI's chunks. A max_tokens beyond the context is refused, as OpenAI's API does, not lowered."""
    serving.check_model(body.model)
    job = await serving.submit(body, prompt=prompt, n=body.n, fit_to_context=False)
    reply = Reply(serving.model_name, chat, job.shape, body.n)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await answer_or_stream(job, request, body.stream, lambda n_prompt: whole_answer(job, reply, request),
                                  lambda n_prompt: stream_events(job, reply, include_usage))
