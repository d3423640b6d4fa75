"""Each API a translation at the edge of one internal request and answer (core.py): the request is
OpenAI chat's body, submitted as a job to the one engine; the answer is its text, tool calls and
end, which each protocol renders whole or as its own stream.

- core.py: `Serving` (submit, count tokens, model names), the answer's events, `answer_or_stream`
- openai_chat.py: OpenAI's Chat Completions and Completions, `/v1/chat/completions` and
  `/v1/completions` (the chat page, aider, opencode): the request's own shape; responses.py renders
  their answers
- anthropic.py: Anthropic's Messages API, `/v1/messages` and `/v1/messages/count_tokens` (Claude Code)
- openai_responses.py: OpenAI's Responses API, `/v1/responses` (Codex)
- llamacpp.py: llama-server's own `/completion` and `/infill` (its editor plugins' code completion)
- reasoning.py: a reasoning model's `<think>` block, as thinking blocks and reasoning items
"""
from __future__ import annotations

from fastapi import FastAPI

from . import anthropic, llamacpp, openai_chat, openai_responses
from .anthropic import model_fields as anthropic_model
from .core import Serving
from .reasoning import template_thinking

__all__ = ["Serving", "add_routes", "anthropic_model"]


def add_routes(app: FastAPI, serving: Serving) -> None:
    """Every API's routes."""
    serving.thinking = template_thinking(serving.decoder)  # before the worker runs anything
    openai_chat.add_routes(app, serving)
    anthropic.add_routes(app, serving)
    openai_responses.add_routes(app, serving)
    llamacpp.add_routes(app, serving)
