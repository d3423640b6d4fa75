"""OpenAI's Responses API (`POST /v1/responses`), what Codex speaks: its body translated into the
internal request, the answer rendered as a `response` or as its stream events (`sequence_number`,
`output_index` and the items' ids, as the SDK's `responses.stream()` helper needs them).

Stateless, as Ollama's: nothing is stored, so `previous_response_id` is a 400 that says to send the
whole conversation. Translation: `instructions` and system or developer messages are the system
message; `message` items are messages; `function_call` items are the assistant's tool calls and
`function_call_output` items the tool's results; `reasoning` items are dropped (a reasoning model's
`<think>` block comes back as one, reasoning.py). `tools` are flat
function tools (hosted tools, web search and the like, are not offered); `text.format` json_schema
or json_object is structured output through the grammar path, as chat's `response_format`."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field

from ..errors import APIError
from ..responses import timings
from ..schemas import ChatBody, Strict
from .core import CallArguments, CallBegun, Calls, End, Evaluated, Serving, Text, joined_text, respond, sse
from .reasoning import Thinking, splitter_for

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
SYSTEM_ROLES = ("system", "developer")
# a session a hosted model began (Codex's freeform apply_patch, its local shell) holds these: calls and results
CALLS = ("function_call", "custom_tool_call", "local_shell_call")
CALL_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
# what OpenAI's servers did or keep (a web search, a hosted MCP server's calls): not for this model
DROPPED_ITEMS = ("reasoning", "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                 "mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response", "compaction")
# a compacted history's summary is encrypted for OpenAI's models: the model here is told it is missing
COMPACTED = ("The conversation before this point was compacted by another server; its summary cannot be read "
             "here, so earlier details may be missing.")


class Part(Strict):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None


class Item(Strict):
    model_config = ConfigDict(extra="allow")
    type: str | None = None          # "message" when left out (an EasyInputMessage)
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None       # function_call, function_call_output
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class TextOptions(Strict):
    format: dict | None = None


class ResponsesBody(Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # engine extras pass through (core.ENGINE_EXTRAS)
    NULL_IS_DEFAULT = ("stream",)
    model: str | None = None
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    max_output_tokens: int | None = Field(None, ge=1, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)  # alternatives per token, as chat's (whose limit it has)
    include: list[str] | None = None  # "message.output_text.logprobs": each token's log-probability
    temperature: float | None = Field(None, ge=0, le=2, strict=True)  # OpenAI's range for this API
    top_p: float | None = Field(None, strict=True)
    top_k: int | None = Field(None, strict=True)
    stop: str | list[str] | None = None  # not OpenAI's here, but harmless to honour
    text: TextOptions | None = None
    stream: bool = Field(False, strict=True)
    previous_response_id: str | None = None
    conversation: str | dict | None = None  # a stored conversation (refused: nothing is stored)
    prompt: dict | None = None              # a stored prompt template (refused likewise)
    metadata: dict | None = None
    reasoning: dict | None = None  # its effort as chat's reasoning_effort ("none": no thinking)


# ---------------------------------------------------------------- the request

LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for them


# chat's field names in an error: this API's (in this order: the longer first)
NAMES = {"response_format.json_schema.": "text.format.", "response_format": "text.format",
         "max_tokens": "max_output_tokens", "].function.": "].", "reasoning_effort": "reasoning.effort"}


def chat_request(body: ResponsesBody, serving: Serving) -> ChatBody:
    for stored in ("previous_response_id", "conversation", "prompt"):  # what the server would have kept
        if getattr(body, stored, None) is not None:
            raise APIError(400, f"{stored}: this server keeps no responses, conversations or prompts (it is "
                                "stateless); send the whole conversation in input", code="invalid_value")
    translated: dict[str, Any] = {"messages": conversation(body), "max_tokens": body.max_output_tokens,
                                  "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                                  "stop": body.stop, "parallel_tool_calls": body.parallel_tool_calls,
                                  "reasoning_effort": (body.reasoning or {}).get("effort")}
    tools = [{"type": "function", "function": {key: t[key] for key in ("name", "description", "parameters") if key in t}}
             for t in body.tools or [] if isinstance(t, dict) and t.get("type", "function") == "function"]
    if tools:
        translated["tools"] = tools
    if body.tool_choice is not None:
        translated["tool_choice"] = tool_choice(body.tool_choice)
    form = (body.text.format if body.text else None) or {"type": "text"}
    if form.get("type") == "json_schema":
        translated["response_format"] = {"type": "json_schema", "json_schema": {
            "name": form.get("name"), "schema": form.get("schema"), "strict": form.get("strict")}}
    elif form.get("type") != "text":
        translated["response_format"] = form
    if body.top_logprobs is not None or LOGPROBS in (body.include or []):
        translated.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    if not translated["messages"]:
        raise APIError(400, "input holds no message to answer (reasoning items are dropped)", code="invalid_value")
    return serving.chat_body(translated, body.model_extra, names=NAMES)


def tool_choice(choice: str | dict):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be auto, none, required or {"type": "function", "name": ...}',
                   code="invalid_value")


def conversation(body: ResponsesBody) -> list[dict]:
    """The input as OpenAI chat's messages; the instructions and every system or developer message
    first, as one system message (templates want it there)."""
    if isinstance(body.input, str):
        items = [Item(role="user", content=body.input)]
    else:
        items = body.input
    system = [body.instructions] if body.instructions else []
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind, where = item.type or "message", f"input[{i}]"
        if kind == "message" and item.content is None:
            raise APIError(400, f"{where}.content is required for a message item", code="invalid_value")
        if kind == "message" and item.role in SYSTEM_ROLES:
            system.append(content_text(item.content, where))
        elif kind == "message":
            if item.role not in ("user", "assistant"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {item.role!r}")
            messages.append({"role": item.role, "content": content_text(item.content, where)})
        elif kind in CALLS:
            add_call(messages, item, where)
        elif kind in CALL_OUTPUTS:
            output = item.output if isinstance(item.output, str) else output_text(item.output, f"{where}.output")
            call_id = item.call_id or (item.model_extra or {}).get("id") or ""
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "compaction" and COMPACTED not in system:
            system.append(COMPACTED)
        elif kind not in DROPPED_ITEMS:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported here (this server keeps no state)")
    return ([{"role": "system", "content": joined_text(system)}] if system else []) + messages


def add_call(messages: list[dict], item: Item, where: str) -> None:
    """A function_call item (or a custom tool's or the local shell's, from a session a hosted model began) as a
    tool call of the assistant message before it (or of a new one)."""
    extra = item.model_extra or {}
    name = "local_shell" if item.type == "local_shell_call" else item.name
    if not name:
        raise APIError(400, f"{where}.name: a {item.type} item needs the function's name")
    arguments = (item.arguments or "{}" if item.type == "function_call" else
                 json.dumps({"input": extra.get("input", "")}) if item.type == "custom_tool_call" else
                 json.dumps(extra.get("action") or {}))
    call = {"id": item.call_id or "", "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        last["content"] = last["content"] or None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def output_text(content: list[Part] | None, where: str) -> str:
    """A call's output parts as text: an image (Codex's view_image) a placeholder, not a 400 that every later
    turn of the session would get too."""
    return joined_text([f"[{'an image' if part.type == 'input_image' else 'a file'} not shown: this model reads "
                        "text only]" if part.type in ("input_image", "input_file") else content_text([part], where)
                        for part in content or []])


def content_text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise APIError(400, f"{where}.content[{j}]: only text content is supported (no images or files)")
        texts.append(part.text if part.text is not None else part.refusal or "")
    return joined_text(texts)


# ---------------------------------------------------------------- the answer

def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponseState:
    """One answer as a `response`, item by item; each step also gives the stream events that say so
    (numbered), so that a stream's final response and a whole answer are the same object."""

    def __init__(self, serving: Serving, body: ResponsesBody):
        self.id, self.created = new_id("resp_"), int(time.time())
        self.model, self.body, self.call_id = serving.model_name, body, serving.call_id
        self.output: list[dict] = []
        self.open: dict | None = None   # the message or reasoning item that more text extends
        self.calling: dict | None = None  # the function call being written (callstream), its arguments growing
        self.sequence = 0
        self.status, self.extra = "in_progress", {}

    def event(self, kind: str, **fields) -> dict:
        number, self.sequence = self.sequence, self.sequence + 1
        return sse(kind, {"type": kind, "sequence_number": number, **fields})

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def heartbeat(self) -> list[dict]:
        """Nothing new for a while (a long prompt): the response still in progress, numbered as any event
        (the SDK's stream helper takes it as it takes the first), without the output so far."""
        return [self.event("response.in_progress", response={**self.response(), "output": []})]

    def on(self, event) -> list[dict]:
        if isinstance(event, Evaluated):
            return []
        if isinstance(event, Text):
            return self.text(event.text, "message", event.logprobs)
        if isinstance(event, Thinking):
            return self.text(event.text, "reasoning")
        if isinstance(event, CallBegun):
            return self.close() + self.call_done() + self.call_begun(event.name)
        if isinstance(event, CallArguments):
            self.calling["arguments"] += event.delta
            return [self.event("response.function_call_arguments.delta", item_id=self.calling["id"],
                               output_index=self.output.index(self.calling), delta=event.delta)]
        if isinstance(event, Calls):
            # the last call sent as written is whole unless the answer was cut short in it
            events = self.close() + self.call_done(whole=len(event.calls) >= len(event.streamed))
            rest = event.calls[len(event.streamed):]
            return events + [e for call in rest for e in self.function_call(call.name, call.arguments)]
        return self.end(event)

    def call_begun(self, name: str) -> list[dict]:
        self.calling = {"type": "function_call", "id": new_id("fc_"), "call_id": self.call_id("call_"), "name": name,
                        "arguments": "", "status": "in_progress"}
        return [self.add(self.calling)]

    def call_done(self, whole: bool = True) -> list[dict]:
        """The call being written, done: its arguments as they were sent ("incomplete" where cut short)."""
        item, self.calling = self.calling, None
        if item is None:
            return []
        item["status"], index = "completed" if whole else "incomplete", self.output.index(item)
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def add(self, item: dict) -> dict:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))

    def text(self, text: str, kind: str = "message", logprobs: tuple = ()) -> list[dict]:
        """More text of the answer (a message item, with its tokens' logprobs where asked for) or of its
        reasoning (a reasoning item)."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            if kind == "message":
                self.open = {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
                             "content": []}
                events.append(self.add(self.open))
                self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                events.append(self.event("response.content_part.added", **self.where(), part=self.open["content"][0]))
            else:
                self.open = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "status": "in_progress",
                             "content": [{"type": "reasoning_text", "text": ""}]}
                events.append(self.add(self.open))
        self.open["content"][0]["text"] += text
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", **self.where(), delta=text)]
        self.open["content"][0]["logprobs"] += logprobs
        return events + [self.event("response.output_text.delta", **self.where(), delta=text, logprobs=list(logprobs))]

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def close(self, status: str = "completed") -> list[dict]:
        """The open item, done ("incomplete": cut short by max_output_tokens, as OpenAI marks it)."""
        if self.open is None:
            return []
        part, where, item = self.open["content"][0], self.where(), self.open
        item["status"], self.open = status, None
        if item["type"] == "reasoning":
            return [self.event("response.reasoning_text.done", **where, text=part["text"]),
                    self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        return [self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def function_call(self, name: str, arguments: str) -> list[dict]:
        item = {"type": "function_call", "id": new_id("fc_"), "call_id": self.call_id("call_"), "name": name,
                "arguments": "", "status": "in_progress"}
        events = [self.add(item)]
        index = len(self.output) - 1
        item.update(arguments=arguments, status="completed")
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=name,
                       arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item)]

    def end(self, end: End) -> list[dict]:
        self.status = "incomplete" if end.reason == "length" else "completed"
        events = self.close(self.status)
        if not any(item["type"] != "reasoning" for item in self.output):  # an empty answer is still a message
            events += self.text("") + self.close(self.status)
        stats = end.stats
        self.extra = {"timings": timings(stats), "ggufspec": {"stats": stats.to_dict(), "estimate": end.estimate},
                      "usage": {"input_tokens": stats.n_prompt,
                                "input_tokens_details": {"cached_tokens": stats.n_prompt_cached},
                                "output_tokens": stats.n_predict, "output_tokens_details": {"reasoning_tokens": 0},
                                "total_tokens": stats.n_prompt + stats.n_predict}}
        return events + [self.event(f"response.{self.status}", response=self.response())]

    def error(self, error: APIError) -> dict:
        return self.event("error", code=error.code, message=error.message, param=None)

    def whole(self) -> dict:
        return self.response()

    def response(self) -> dict:
        body = self.body
        form = (body.text.format if body.text else None) or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "model": self.model, "output": self.output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": None, "store": False, "temperature": body.temperature,
                "top_p": body.top_p, "text": {"format": form}, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "truncation": "disabled", "user": None, "usage": None, **self.extra}


# ---------------------------------------------------------------- the route

def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/responses")
    @app.post("/responses")  # as llama-server, for a client whose base URL lacks /v1
    async def responses(request: Request, body: ResponsesBody):
        serving.check_model(body.model)
        chat = await asyncio.to_thread(chat_request, body, serving)  # thousands of items take a while
        job = await serving.submit(chat, names=NAMES)
        return await respond(job, request, body.stream, lambda n_prompt: ResponseState(serving, body),
                             lambda: splitter_for(serving, job))

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def input_tokens(body: ResponsesBody):
        """OpenAI's (`client.responses.input_tokens.count`): the input's length in tokens as the request
        would be rendered, its instructions and tools included."""
        serving.check_model(body.model)
        chat = await asyncio.to_thread(chat_request, body, serving)
        return {"object": "response.input_tokens", "input_tokens": await serving.count_tokens(chat, names=NAMES)}
