"""A chat request's conversation as the prompt: the server's rules for it (`ChatSettings`: llama-server's
--prefill-assistant, --skip-chat-parsing, --reasoning-preserve) and where the answer starts (`AnswerStart`).

A last assistant message is the start of the answer, which the model continues (llama-server's
prefill_assistant, on by default; vLLM's and transformers' `continue_final_message` ask for it by
name): the conversation before it is rendered, the template's assistant turn opened, and the message
written after it. The answer is what follows, whole and streamed, as Anthropic's prefill. Where the
template knows a <think> block the message goes in llama-server's tags: `<think>{reasoning_content}
</think>{content}` to continue the content, `<think>{reasoning_content}` to continue the thinking
(continue_final_message "reasoning_content"). `add_generation_prompt` false without a continuation:
the prompt ends with the last message, as the template closes it."""
from __future__ import annotations

from dataclasses import dataclass

from .. import load
from .. import tools as toolkit
from ..thinking import CLOSE, OPEN
from .constraints import Shaping
from .errors import APIError
from .schemas import ChatBody, Message, content_text


@dataclass(frozen=True)
class ChatSettings:
    """serve's rules for chat requests: a last assistant message continued (--prefill-assistant); the
    answer left unparsed, thinking and calls in its content (--skip-chat-parsing); the template's
    preserve_reasoning variable (--reasoning-preserve; None: not given, on as llama-server's default)."""
    prefill_assistant: bool = True
    skip_chat_parsing: bool = False
    preserve_reasoning: bool | None = None

    def template_defaults(self, given: dict) -> dict:
        """Every request's template variables: --chat-template-kwargs' (`given`) and preserve_reasoning,
        which llama-server sets unless they set it (the flag over them, as when it comes after them)."""
        if self.preserve_reasoning is None:
            return {"preserve_reasoning": True, **given}
        return {**given, "preserve_reasoning": self.preserve_reasoning}


@dataclass(frozen=True)
class AnswerStart:
    """Where the answer starts after the rendered conversation. `into`: the part of the continued
    message that the answer goes on with ("content" or "reasoning_content"; None: a turn of its own,
    after the template's assistant turn where `generation_prompt`, else right after the last message).
    `thinks`: the template knows a <think> block, so the continued message is written in its tags."""
    into: str | None = None
    content: str = ""
    reasoning: str = ""
    thinks: bool = False
    generation_prompt: bool = True

    def after(self, turn: str) -> tuple[str, str]:
        """(the template's assistant turn as it is kept, the continued message as written after it): in
        a template that knows thinking, the turn up to a <think> it opens, and the message's own block."""
        if not self.thinks:
            return turn, self.content
        opened = turn.find(OPEN)
        head = turn[:opened] if opened >= 0 else turn
        return head, OPEN + self.reasoning + (CLOSE + self.content if self.into == "content" else "")


def answer_start(body: ChatBody, settings: ChatSettings, thinks: bool) -> tuple[ChatBody, AnswerStart]:
    """The conversation to render and where the answer starts, by llama-server's rules: a last assistant
    message is continued where --prefill-assistant is on (it is by default) or continue_final_message
    asks; a request that also asks for a new turn (add_generation_prompt true), or would continue what
    cannot be continued, is a 400."""
    messages, mode = body.messages, continue_mode(body.continue_final_message)
    generation_prompt = body.add_generation_prompt is not False  # llama-server's default: true
    if mode is None and settings.prefill_assistant and messages[-1].role == "assistant" and len(messages) > 1:
        if messages[-2].role == "assistant":
            raise invalid(f"messages[{len(messages) - 2}] and messages[{len(messages) - 1}] are both the "
                          "assistant's: the last is the start of the answer, continued (--prefill-assistant); "
                          "join them into one", "messages")
        mode, generation_prompt = "auto", False
    if mode is None:
        return body, AnswerStart(generation_prompt=generation_prompt)
    if generation_prompt:
        raise invalid("continue_final_message and add_generation_prompt are both true: the continued message is "
                      "the answer's start, not a new turn; send add_generation_prompt false", "add_generation_prompt")
    if body.echo:
        raise invalid("echo is not supported on chat: the answer is what follows the continued message; "
                      "put its content in front yourself", "echo")
    index = len(messages) - 1
    content, reasoning = continued_parts(messages[index], index, len(messages))
    if mode == "auto":  # llama-server's: the thinking where the message has only that
        mode = "reasoning_content" if reasoning and not content else "content"
    if mode == "reasoning_content" and not thinks:
        raise invalid("continue_final_message \"reasoning_content\": the chat template has no <think> block to "
                      "continue; continue the content instead", "continue_final_message")
    return (body.model_copy(update={"messages": messages[:-1]}),
            AnswerStart(mode, content, reasoning, thinks=thinks, generation_prompt=False))


def continue_mode(value) -> str | None:
    """continue_final_message as llama-server reads it: true (what the message holds decides),
    "content" or "reasoning_content"; false or absent: none."""
    return {True: "auto", "content": "content", "reasoning_content": "reasoning_content"}.get(value)


def continued_parts(message: Message, index: int, n_messages: int) -> tuple[str, str]:
    """The continued message's (content, reasoning_content); content parts joined by blank lines, as
    llama-server writes them. Only an assistant's message without calls, after another, continues."""
    where = f"messages[{index}]"
    if message.role != "assistant":
        raise invalid(f"continue_final_message continues the conversation's last message, which must be the "
                      f"assistant's: {where} is a {message.role} message", "continue_final_message")
    if n_messages < 2:
        raise invalid("continue_final_message: the conversation is only the assistant's message; put the "
                      "messages it answers before it", "messages")
    if message.tool_calls:
        raise invalid(f"{where} calls tools: an assistant message with tool_calls cannot be continued; send "
                      "the calls' results (tool messages) after it", "messages")
    reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    if not isinstance(reasoning, str):
        raise invalid(f"{where}.reasoning_content must be a string", "messages")
    if message.content is None:
        raise invalid(f"{where}.content is required for an assistant message without tool_calls", "messages")
    content_text(message.content, f"{where}.content")  # its parts checked: text only
    if isinstance(message.content, list):
        return "\n\n".join(part.text for part in message.content), reasoning
    return message.content, reasoning


def invalid(message: str, param: str) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


# ---------------------------------------------------------------- the prompt

def chat_prompt(decoder, messages: list[dict], shape: Shaping, add_generation_prompt: bool = True) -> str:
    """A conversation (and the tools its plan offers) through the target's chat template."""
    plan, fmt = shape.plan, shape.fmt or toolkit.detect_format(load.chat_template(decoder.target_llm).text)
    prepared = toolkit.prepare_messages(messages, fmt, plan.tools)
    return load.render_chat(decoder.target_llm, prepared, tools=plan.tools if fmt.native else None,
                            add_generation_prompt=add_generation_prompt, **shape.template_variables)


def chat_text(decoder, messages: list[dict], shape: Shaping, start: AnswerStart | str = "") -> tuple[str, bool]:
    """The prompt: the conversation through the chat template and the answer's start after it (`start`:
    an AnswerStart, or Anthropic's prefill, a text after the assistant's turn as it is); and whether the
    answer starts inside a <think> block."""
    if isinstance(start, str):
        rendered = chat_prompt(decoder, messages, shape)
        return rendered + start, opens_thinking(rendered, start)
    if start.into is None:
        rendered = chat_prompt(decoder, messages, shape, start.generation_prompt)
        return rendered, opens_thinking(rendered, "")
    # llama-server's: the conversation closed, then the assistant's turn (what adding it adds) and the message
    closed, opened = (chat_prompt(decoder, messages, shape, generation_prompt) for generation_prompt in (False, True))
    turn, written = start.after(opened[shared_length(closed, opened):])
    return closed + turn + written, opens_thinking(closed + turn, written)


def shared_length(a: str, b: str) -> int:
    """How many characters `a` and `b` begin with in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def opens_thinking(rendered: str, prefill: str) -> bool:
    """Whether the answer starts inside a <think> block: the template's assistant turn opened it
    (DeepSeek-R1's; Qwen3's never) and the prefill did not close it, or the prefill opened one."""
    last_open, last_close = prefill.rfind(OPEN), prefill.rfind(CLOSE)
    if last_open > last_close:
        return True
    return rendered.rstrip().endswith(OPEN) and last_close < 0
