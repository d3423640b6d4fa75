"""The target's chat template: the GGUF's own (or one given instead, llama.cpp's --chat-template), or
ChatML where it has none, rendered over a conversation in llama-cpp-python's sandboxed Jinja."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .errors import GgufspecError

# what the renderer gives the template itself: a caller's variables may not set them
RENDERER_VARIABLES = ("messages", "tools", "tool_choice", "functions", "function_call", "eos_token", "bos_token",
                      "raise_exception", "add_generation_prompt", "strftime_now")


# llama.cpp's fallback for a model without a chat template is ChatML; this one also renders tools,
# tool calls and tool results the way Hermes/Qwen models were trained to read them.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    fallback: bool  # the model has none: DEFAULT_CHAT_TEMPLATE (ChatML) stands in


def chat_template(llm: llama_cpp.Llama) -> ChatTemplate:
    """The target's chat template (GGUF `tokenizer.chat_template`, or the one `use_chat_template` gave
    it), or ChatML where it has none."""
    text = llm.metadata.get("tokenizer.chat_template")
    return ChatTemplate(text, False) if text else ChatTemplate(DEFAULT_CHAT_TEMPLATE, True)


def checked_chat_template(text: str, source: str) -> str:
    """--chat-template's value (a Jinja template, or llama.cpp's name "chatml") as a template's text,
    compiled once so that a mistake is one line before anything loads."""
    if text.strip().lower() == "chatml":
        return DEFAULT_CHAT_TEMPLATE
    if "{{" not in text and "{%" not in text:
        raise GgufspecError(f"{source}: {text[:40]!r} is no Jinja template, and of llama.cpp's built-in template "
                            "names ggufspec knows only chatml: give the template's text, or --chat-template-file")
    import jinja2.sandbox
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise GgufspecError(f"{source}: not a Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def use_chat_template(llm: llama_cpp.Llama, text: str) -> None:
    """Render chats with `text` instead of the model's own template (llama.cpp's --chat-template): every
    reader of the template (chat prompts, the tool-call format, the thinking block) sees it as the GGUF's."""
    llm.metadata["tokenizer.chat_template"] = text


def check_messages(messages) -> None:
    if (not isinstance(messages, (list, tuple)) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise GgufspecError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')


def chat_prompt(llm: llama_cpp.Llama, user: str, system: str | None = None) -> str:
    """The target's own chat template applied to one user turn (ChatML where it has none:
    `chat_template(llm).fallback` says so)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render_chat(llm, messages, warn=True)


def render_chat(llm: llama_cpp.Llama, messages: list[dict], tools: list[dict] | None = None, *, warn: bool = False,
                add_generation_prompt: bool = True, **variables) -> str:
    """The target's chat template over a conversation, ending with the assistant's turn opened (with
    `add_generation_prompt` false: ending with the last message, as the template closes it).
    llama-cpp-python's formatter renders it in a sandboxed Jinja. `tools` (OpenAI's tool objects) and
    other `variables` are passed to the template (`with_derived_variables`). A model without a template
    gets ChatML (`chat_template(llm).fallback` is then true; `warn`: a warning says so, once, where the
    caller has not said it already, as the server does when it starts)."""
    check_messages(messages)
    found = chat_template(llm)
    if found.fallback and warn:  # (Python's warnings: once per place): its markers may be no tokens of the model
        warnings.warn("the model has no chat template: the conversation is rendered as ChatML", stacklevel=3)
    template = found.text
    variables = with_derived_variables(variables)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    token_text = lambda t: (llama_cpp.llama_vocab_get_text(vocab, t) or b"").decode(errors="replace") if t >= 0 else ""
    formatter = Jinja2ChatFormatter(template=template, eos_token=token_text(llama_cpp.llama_vocab_eos(vocab)),
                                    bos_token=token_text(llama_cpp.llama_vocab_bos(vocab)),
                                    add_generation_prompt=add_generation_prompt)
    try:
        return formatter(messages=messages, tools=tools or None, **variables).prompt
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception()
        merged = system_in_first_user(messages)
        if merged is not None:  # a template without a system role (Gemma 2's raises on one)
            try:
                return formatter(messages=merged, tools=tools or None, **variables).prompt
            except Exception:
                pass
        raise GgufspecError(f"the chat template refused these messages: {exc}") from None


def with_derived_variables(variables: dict) -> dict:
    """The variables with those llama.cpp derives from them for the templates that read other names
    (its jinja caps): preserve_reasoning (--reasoning-preserve) as preserve_thinking, and its opposite
    as clear_thinking, truncate_history_thinking and drop_thinking (GLM's, Kimi's...); reasoning_effort
    also as reasoning_strength. A variable given by its own name wins, as there."""
    derived = {}
    keep = variables.get("preserve_reasoning")
    if isinstance(keep, bool):
        derived.update(preserve_thinking=keep, clear_thinking=not keep, truncate_history_thinking=not keep,
                       drop_thinking=not keep)
    effort = variables.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        derived["reasoning_strength"] = effort
    return {**derived, **variables}


def system_in_first_user(messages: list[dict]) -> list[dict] | None:
    """The conversation with its leading system message put in front of the next message, as llama.cpp
    renders it for a template without a system role (chat.cpp's system_message_not_supported); None
    where there is none to move (or either content is not text)."""
    if len(messages) < 2 or messages[0].get("role") != "system":
        return None
    system, following = messages[0].get("content"), messages[1].get("content")
    if not isinstance(system, str) or not isinstance(following, str):
        return None
    return [{**messages[1], "content": system + "\n" + following}] + messages[2:]
