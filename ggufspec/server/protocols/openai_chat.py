"""OpenAI's Chat Completions and Completions APIs, `/v1/chat/completions` and `/v1/completions` (the
chat page's, aider's, opencode's): the internal request's own shape, so the body goes to the engine as
it is (schemas.py reads it); responses.py renders its answer, with several choices, logprobs and
llama.cpp's `timings`. A chat's last assistant message is the answer's start, which the model
continues (llama-server's --prefill-assistant, continue_final_message: chatturn.py)."""
from __future__ import annotations

from fastapi import FastAPI, Request

from ..chatturn import AnswerStart, answer_start
from ..errors import APIError
from ..responses import Reply, stream_events, whole_answer
from ..schemas import ChatBody, CompletionBody, GenerationBody, completion_prompts, line_limits
from .. import control
from .core import Serving, answer_or_stream
from .reasoning import reasoning_content_for


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        prompts = completion_prompts(body)
        if body.post_sampling_probs:
            raise APIError(400, "post_sampling_probs is not supported here: /v1/completions' logprobs are OpenAI's "
                                "lists of log-probabilities; ask /completion or /v1/chat/completions for probabilities",
                           code="unsupported_parameter", param="post_sampling_probs")
        if body.suffix:  # insert text between each prompt and the suffix: a code model's fill in the middle
            if not all(isinstance(prompt, str) for prompt in prompts):
                raise APIError(400, "suffix needs prompt as text, not token ids", code="invalid_value")
            prompts = [await serving.fim(prompt, body.suffix, status=400, trim=False) for prompt in prompts]
        return await answer(serving, request, body, chat=False, prompts=prompts)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")  # as llama-server, for a client whose base URL lacks /v1
    async def chat_completions(request: Request, body: ChatBody):
        return await answer(serving, request, body, chat=True)

    control.add_routes(app, serving.controls)  # POST /v1/chat/completions/control

    @app.post("/apply-template")
    async def apply_template(body: ChatBody):
        """llama-server's: the prompt the chat template makes of the messages (and tools), not run."""
        return {"prompt": await serving.render(*conversation(serving, body))}

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    async def input_tokens(body: ChatBody):
        """llama-server's: the prompt's length in tokens, as the request would be rendered."""
        return {"input_tokens": await serving.count_tokens(*conversation(serving, body)),
                "object": "response.input_tokens"}


def conversation(serving: Serving, body: ChatBody) -> tuple[ChatBody, AnswerStart]:
    """The conversation to render, and where its answer starts (a last assistant message continued)."""
    return answer_start(body, serving.chat, serving.thinking[0])


async def answer(serving: Serving, request: Request, body: GenerationBody, chat: bool, prompts=None):
    """The body as a job on the engine (its messages, or /v1/completions' prompts, `n` choices each,
    index i * n + j for prompt i's j-th, in the slots at once), answered whole or as OpenAI's chunks.
    A max_tokens beyond the context is a ceiling the context lowers (the answer ends with "length" where the
    context is full), as llama-server's: opencode asks for 32,000 tokens whatever the context (OpenAI's own API
    refuses; an agent's every turn would)."""
    serving.check_model(body.model)
    start = ""
    if chat:
        body, start = conversation(serving, body)
    job = await serving.submit(body, start, prompts=prompts, n=body.n, fit_to_context=True,
                               line_limits=line_limits(body))
    reasoning = reasoning_content_for(serving, body, job) if chat else None
    reply = Reply(serving.model_name, chat, job.shape, job.n_choices, serving.fingerprint_of(job), reasoning,
                  post_sampling_probs=body.post_sampling_probs)
    if chat:
        serving.controls.add(reply.id, job, job.shape.constraints.get("reasoning_control"))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await answer_or_stream(job, request, body.stream, lambda n_prompt: whole_answer(job, reply, request),
                                  lambda n_prompt: stream_events(job, reply, include_usage))
