"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), what Claude Code
speaks: its body translated into the internal request, the answer rendered as a `message` or as
Anthropic's stream events. Errors under these paths have Anthropic's shape (errors.py).

Translation: `system` (a string or text blocks) is the system message; a user message's
`tool_result` blocks become tool messages (an `is_error` result says so), its text blocks one user
message; an assistant's `tool_use` blocks become its tool calls (the input as JSON arguments);
`thinking` blocks are dropped (the template never sees them). A reasoning model's `<think>` block
comes back as a `thinking` block (reasoning.py). `tools` are the functions of OpenAI
chat (Anthropic's server tools, such as web search, run at Anthropic: they are not offered), and
`tool_choice` auto, any, tool and none are auto, required, a named function and none;
`output_config.format` (a JSON schema) is structured output, as chat's `response_format`."""
from __future__ import annotations

import asyncio
import datetime
import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field

from ..errors import APIError
from ..responses import timings
from ..schemas import ChatBody, Strict
from .core import CallArguments, CallBegun, Calls, End, Evaluated, Serving, Text, arguments_object, joined_text, respond, sse
from .reasoning import Thinking, splitter_for

STOP_REASONS = {"end": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# the model's earlier reasoning, and what Anthropic's servers did (a web search's call and results): not rendered
DROPPED_BLOCKS = ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result")
# in a tool's result, where the whole session would otherwise be refused from then on (the history keeps it)
NOT_SHOWN = "[{kind} not shown: this model reads text only]"
# chat's field names in an error: this API's (a tool is {"name", "input_schema"}, not {"function": ...})
NAMES = {"response_format": "output_config.format", "].function.parameters": "].input_schema",
         "].function.": "].", "thinking_budget_tokens": "thinking.budget_tokens"}


class Block(Strict):
    model_config = ConfigDict(extra="allow")  # cache_control, citations...: not ours to use
    type: str
    text: str | None = None
    id: str | None = None            # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None   # tool_result
    content: str | list["Block"] | None = None
    is_error: bool | None = None


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Strict):
    type: str | None = None          # "custom" or none; server tools ("web_search_20250305"...) are skipped
    name: str
    description: str | None = None
    input_schema: dict | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None  # structured output, through the grammar path
    effort: str | None = None           # accepted; a local model has one effort


class CountTokensBody(Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # engine extras pass through (core.ENGINE_EXTRAS)
    model: str | None = None         # any name: Claude Code asks for its own models' names
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict | None = None     # enabled / disabled: the template's enable_thinking (thinking_variables)


class MessagesBody(CountTokensBody):
    max_tokens: int = Field(ge=0, strict=True)  # required, as Anthropic's API has it; 0: the prompt into the cache
    stop_sequences: list[str] | None = None
    stream: bool = Field(False, strict=True)
    temperature: float | None = Field(None, ge=0, le=1, strict=True)  # Anthropic's range (OpenAI's is 0-2)
    top_p: float | None = Field(None, ge=0, le=1, strict=True)
    top_k: int | None = Field(None, ge=0, strict=True)
    metadata: dict | None = None
    output_config: OutputConfig | None = None


# ---------------------------------------------------------------- the request

def chat_request(body: CountTokensBody, serving: Serving) -> tuple[ChatBody, str]:
    """The internal request, and the prefill: a last assistant message is the answer's start, which
    the model continues (and the answer is what follows it, as Anthropic's is); under serve's
    --no-prefill-assistant a whole turn, as llama-server's /v1/messages takes it."""
    messages, prefill = conversation(body), ""
    if serving.chat.prefill_assistant and len(messages) > 1 and messages[-1]["role"] == "assistant" \
            and not messages[-1].get("tool_calls"):
        prefill = messages.pop()["content"] or ""
    translated: dict = {"messages": messages}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": tool_schema(t, i)}}
             for i, t in enumerate(body.tools or []) if t.type in (None, "custom")]
    if tools:
        translated["tools"] = tools
    if body.tool_choice is not None:
        choice = body.tool_choice
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice.name is required when tool_choice.type is \"tool\"")
        if choice.type == "tool" and any(t.name == choice.name and t.type not in (None, "custom") for t in body.tools or []):
            raise APIError(400, f"tool_choice names {choice.name!r}, a server tool ({server_tool_type(body, choice.name)}) "
                                "that Anthropic's servers run: a local model cannot run it, so it is not offered")
        translated["tool_choice"] = (TOOL_CHOICES[choice.type] if choice.type != "tool"
                                     else {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            translated["parallel_tool_calls"] = False
    translated.update(thinking_variables(body))
    if isinstance(body, MessagesBody):
        # max_tokens 0: the prompt into the cache, nothing generated (llama.cpp's n_predict 0)
        translated.update({"max_tokens" if body.max_tokens else "n_predict": body.max_tokens},
                          temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)
        form = body.output_config.format if body.output_config else None
        if form is not None:
            translated["response_format"] = {"type": "json_schema", "json_schema": {"schema": form.schema_}}
    return serving.chat_body(translated, body.model_extra, names=request_names(body)), prefill


def server_tool_type(body: CountTokensBody, name: str) -> str:
    return next(t.type for t in body.tools or [] if t.name == name)


def thinking_variables(body: CountTokensBody) -> dict:
    """`thinking` as the chat template's enable_thinking (Qwen3's and others' switch): "disabled" turns
    it off, "enabled" on, its budget_tokens the thinking's budget (llama-server's thinking_budget_tokens);
    the request's own chat_template_kwargs (an engine extra) say it first."""
    kind = (body.thinking or {}).get("type")
    if kind not in ("enabled", "disabled"):
        return {}
    given = (body.model_extra or {}).get("chat_template_kwargs")
    variables = {"chat_template_kwargs": {"enable_thinking": kind == "enabled",
                                          **(given if isinstance(given, dict) else {})}}
    if kind == "enabled" and "budget_tokens" in body.thinking:
        variables["thinking_budget_tokens"] = body.thinking["budget_tokens"]
    return variables


def request_names(body: CountTokensBody) -> dict:
    """NAMES, and chat's tools[j] as the request's own index: server tools are not passed on, so the
    custom tools after one move up (a marker keeps tools[0] -> tools[1] from going on to tools[2])."""
    kept = [i for i, t in enumerate(body.tools or []) if t.type in (None, "custom")]
    moved = {f"tools[{j}]": f"tools[\0{i}]" for j, i in enumerate(kept) if i != j}
    return {**NAMES, **moved, **({"\0": ""} if moved else {})}


def tool_schema(tool: AnthropicTool, i: int) -> dict:
    """A custom tool's input_schema, which Anthropic's API requires (server tools have none)."""
    if tool.input_schema is None:
        raise APIError(400, f"tools[{i}].input_schema is required: the JSON schema of the tool's input")
    if tool.input_schema.get("type") != "object":  # as Anthropic's API: a tool's input is an object
        raise APIError(400, f"tools[{i}].input_schema.type must be \"object\"")
    return tool.input_schema


def conversation(body: CountTokensBody) -> list[dict]:
    """The messages as OpenAI chat's, which the chat template renders."""
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else joined_text(
            [block_text(b, f"system[{j}]") for j, b in enumerate(body.system)])
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(assistant_message(message.content, f"messages[{i}]"))
        else:
            messages += user_messages(message.content, f"messages[{i}]")
    return messages


def block_text(block: Block, where: str) -> str:
    if block.type == "text":
        if block.text is None:
            raise APIError(400, f"{where}.text is required for a text block")
        return block.text
    if block.type in DROPPED_BLOCKS:
        return ""
    if block.type in ("image", "document"):
        raise APIError(400, f"{where}: only text content is supported (no images or documents)")
    raise APIError(400, f"{where}: a content block of type {block.type!r} is not supported here")


def user_messages(blocks: list[Block], where: str) -> list[dict]:
    """Tool results (each a tool message), then the text blocks as one user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise APIError(400, f"{where}.content[{j}].tool_use_id: a tool_result block needs the id of "
                                    f"its tool_use")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": result_text(block, f"{where}.content[{j}]")})
        else:
            texts.append(block_text(block, f"{where}.content[{j}]"))
    if texts or not results:
        results.append({"role": "user", "content": joined_text(texts)})
    return results


def result_text(block: Block, where: str) -> str:
    content = block.content
    text = content if isinstance(content, str) else joined_text(
        [result_part(b, f"{where}.content[{k}]") for k, b in enumerate(content or [])])
    return f"Error: {text}" if block.is_error else text


def result_part(block: Block, where: str) -> str:
    """A tool result's block as text: an image or a document (Claude Code reading a picture) a placeholder, not
    a 400 that every later turn of the session would get too; Claude Code's tool search (`tool_reference`)
    and a `search_result` as what they say."""
    extra = block.model_extra or {}
    if block.type in ("image", "document"):
        return NOT_SHOWN.format(kind="an image" if block.type == "image" else "a document")
    if block.type == "tool_reference":
        return f"Tool available: {extra.get('tool_name', '')}"
    if block.type == "search_result":
        texts = [block_text(b, f"{where}.content[{k}]") for k, b in enumerate(block.content or [])] \
            if isinstance(block.content, list) else [block.content or ""]
        return joined_text([f"{extra.get('title', '')} ({extra.get('source', '')})", *texts])
    return block_text(block, where)


def assistant_message(blocks: list[Block], where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if block.type == "tool_use":
            if not block.name:
                raise APIError(400, f"{where}.content[{j}].name: a tool_use block needs the tool's name")
            if not isinstance(block.input, dict):
                raise APIError(400, f"{where}.content[{j}].input: a tool_use block's input must be an object")
            calls.append({"id": block.id or "", "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
        else:
            texts.append(block_text(block, f"{where}.content[{j}]"))
    text = joined_text(texts)
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


# ---------------------------------------------------------------- the answer

class MessageState:
    """One answer as Anthropic's `message`, built block by block; each step also gives the stream
    events that say so, so that a stream and a whole answer are the same message."""

    def __init__(self, serving: Serving, n_prompt: int):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model, self.n_prompt, self.call_id = serving.model_name, n_prompt, serving.call_id
        self.content: list[dict] = []
        self.open_kind: str | None = None   # "text", "thinking" or "tool_use": the last block, still open
        self.streamed: list[int] = []       # the blocks of the calls sent as they were written
        self.started = False                # message_start sent
        self.ending: dict = {}

    def start(self) -> list[dict]:
        return []  # message_start waits for the prompt's evaluation: its usage splits off the cached tokens

    def heartbeat(self) -> list[dict]:
        """Nothing new for a while (a long prompt, before message_start too): Anthropic's own keep-alive
        event, which its SDKs skip wherever it comes."""
        return [sse("ping", {"type": "ping"})]

    def message_start(self, n_cached: int) -> list[dict]:
        self.started = True
        usage = {"input_tokens": self.n_prompt - n_cached, "cache_read_input_tokens": n_cached,
                 "cache_creation_input_tokens": 0, "output_tokens": 0}
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [sse("message_start", {"type": "message_start", "message": message}), sse("ping", {"type": "ping"})]

    def on(self, event) -> list[dict]:
        if not self.started:  # the prompt's evaluation, or (no token came) the end, says what was cached
            n_cached = (event.n_cached if isinstance(event, Evaluated) else
                        event.stats.n_prompt_cached if isinstance(event, End) else 0)
            return self.message_start(n_cached) + self.on(event)
        if isinstance(event, Evaluated):
            return []
        if isinstance(event, Text):
            return self.extend("text", event.text)
        if isinstance(event, Thinking):
            return self.extend("thinking", event.text)
        if isinstance(event, CallBegun):
            events = self.close() + self.open({"type": "tool_use", "id": self.call_id("toolu_"), "name": event.name,
                                                "input": {}})
            self.open_kind = "tool_use"
            self.streamed.append(len(self.content) - 1)
            return events
        if isinstance(event, CallArguments):
            delta = {"type": "input_json_delta", "partial_json": event.delta}
            return [sse("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                "delta": delta})]
        if isinstance(event, Calls):
            return self.calls_end(event)
        return self.end(event)

    def calls_end(self, event: Calls) -> list[dict]:
        """The calls sent as written get their parsed input (one cut short: what was sent of it); the
        others go out whole."""
        events = self.close()
        for i, (block, (_, sent, _)) in enumerate(zip(self.streamed, event.streamed)):
            self.content[block]["input"] = arguments_object(event.calls[i].arguments if i < len(event.calls) else sent)
        rest = event.calls[len(event.streamed):]
        return events + [e for call in rest for e in self.tool_use(call.name, call.arguments)]

    def extend(self, kind: str, text: str) -> list[dict]:
        """More text of a text or thinking block (a new block when the last one is another kind)."""
        events = []
        if self.open_kind != kind:
            events += self.close()
            # a thinking block's signature proves it came from Anthropic: none here (it is dropped when sent back)
            events += self.open({"type": "text", "text": ""} if kind == "text" else
                                {"type": "thinking", "thinking": "", "signature": ""})
            self.open_kind = kind
        self.content[-1][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return events + [sse("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                     "delta": delta})]

    def tool_use(self, name: str, arguments: str) -> list[dict]:
        events = self.close()
        arguments_json = arguments_object(arguments)
        events += self.open({"type": "tool_use", "id": self.call_id("toolu_"), "name": name, "input": {}})
        self.content[-1]["input"] = arguments_json
        delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments_json, ensure_ascii=False)}
        events.append(sse("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                  "delta": delta}))
        return events + self.close(force=True)

    def open(self, block: dict) -> list[dict]:
        self.content.append(dict(block))
        return [sse("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                            "content_block": block})]

    def close(self, force: bool = False) -> list[dict]:
        if not (self.open_kind or force):
            return []
        self.open_kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def end(self, end: End) -> list[dict]:
        stats = end.stats
        stop_sequence = end.stop_sequence if end.reason == "stop_sequence" else None
        self.ending = {"stop_reason": STOP_REASONS[end.reason], "stop_sequence": stop_sequence,
                       "usage": {"input_tokens": stats.n_prompt - stats.n_prompt_cached,
                                 "cache_read_input_tokens": stats.n_prompt_cached,
                                 "cache_creation_input_tokens": 0, "output_tokens": stats.n_predict},
                       "timings": timings(stats), "ggufspec": {"stats": stats.to_dict(), "estimate": end.estimate}}
        delta = {"type": "message_delta", "delta": {"stop_reason": self.ending["stop_reason"],
                                                    "stop_sequence": stop_sequence},
                 "usage": self.ending["usage"], "timings": self.ending["timings"]}
        return self.close() + [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]

    def whole(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, **self.ending}

    def error(self, error: APIError) -> dict:
        return sse("error", error.body("/v1/messages"))  # Anthropic's shape (errors.error_body)


# ---------------------------------------------------------------- the routes

def model_fields(model_name: str, created: int) -> dict:
    """A model's fields in Anthropic's list of models (/v1/models answers both APIs' fields)."""
    when = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "display_name": model_name, "created_at": when}


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request, body: MessagesBody):
        chat, prefill = await asyncio.to_thread(chat_request, body, serving)  # thousands of messages take a while
        job = await serving.submit(chat, prefill, names=request_names(body))
        return await respond(job, request, body.stream, lambda n_prompt: MessageState(serving, n_prompt),
                             lambda: splitter_for(serving, job))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensBody):
        chat, prefill = await asyncio.to_thread(chat_request, body, serving)
        return {"input_tokens": await serving.count_tokens(chat, prefill, names=request_names(body))}
