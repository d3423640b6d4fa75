"""Request bodies (pydantic), and what they ask of the decoder: its stream() keywords, the prompt or
the conversation, the stop strings."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from ..chat_templates import RENDERER_VARIABLES
from ..sampling import LLAMACPP_FILTERS
from .errors import APIError

MAX_SAMPLERS = 64   # names or letters in a request's `samplers` (a dozen kinds, each listed once)
MAX_BREAKERS = 64   # a request's dry_sequence_breakers


class Strict(BaseModel):
    # NaN and infinity parse as JSON in Python; they are never a valid sampling value
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # fields the OpenAI API documents as nullable that have a default here: null means the default
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.NULL_IS_DEFAULT):
            data = {key: value for key, value in data.items() if not (value is None and key in cls.NULL_IS_DEFAULT)}
        return data


class Speculative(Strict):
    """llama.cpp server's per-request draft settings."""
    n_max: int | None = Field(None, ge=0, strict=True)
    n_min: int | None = Field(None, strict=True)
    p_min: float | None = Field(None, strict=True)


class SchemaFormat(Strict):
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: SchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")  # llama.cpp: json_object may carry a schema


class StreamOptions(Strict):
    NULL_IS_DEFAULT = ("include_usage",)
    include_usage: bool = Field(False, strict=True)


class GenerationBody(Strict):
    # numbers and flags strictly typed, as OpenAI's API checks them ("5" or true is not a max_tokens)
    NULL_IS_DEFAULT = ("n", "stream", "ignore_eos", "echo", "logprobs", "timings_per_token", "return_progress",
                       "post_sampling_probs", "n_indent")
    model: str | None = None
    max_tokens: int | None = Field(None, strict=True)
    max_completion_tokens: int | None = Field(None, strict=True)  # OpenAI's newer name for max_tokens (chat)
    n_predict: int | None = Field(None, strict=True)  # llama.cpp's name (llama-server reads it here too): first
    temperature: float | None = Field(None, strict=True)  # an integer is a number too; true or "1" is not
    top_p: float | None = Field(None, strict=True)
    top_k: int | None = Field(None, strict=True)
    min_p: float | None = Field(None, strict=True)
    typical_p: float | None = Field(None, strict=True)        # llama.cpp's samplers: 1 off
    top_n_sigma: float | None = Field(None, strict=True)      # <= 0 off
    xtc_probability: float | None = Field(None, strict=True)  # 0 off
    xtc_threshold: float | None = Field(None, strict=True)    # above 0.5 off
    dynatemp_range: float | None = Field(None, strict=True)   # 0 off
    dynatemp_exponent: float | None = Field(None, strict=True)
    mirostat: int | None = Field(None, ge=0, le=2, strict=True)  # 1, 2: llama.cpp's Mirostat in place of the chain
    mirostat_tau: float | None = Field(None, strict=True)
    mirostat_eta: float | None = Field(None, strict=True)
    seed: int | None = Field(None, strict=True)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16, strict=True)  # choices, in as many slots at once as are free
    n_cmpl: int | None = Field(None, ge=1, le=16, strict=True)  # llama-server's name for `n`, first where both are sent
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None
    draft: Literal["auto"] | StrictInt | None = None  # ggufspec's own: K, 0 = the target alone, or "auto"
    lookup: bool | None = Field(None, strict=True)
    hybrid: bool | None = Field(None, strict=True)
    cache_prompt: bool | None = Field(None, strict=True)  # llama.cpp's: False evaluates the whole prompt again (default: reuse)
    lora: Any = None  # llama-server's [{"id": N, "scale": S}, ...]: the LoRA scales it runs under (`adapters`)
    # what changes the distribution: OpenAI's, then llama.cpp's
    logit_bias: dict[str, float | bool] | list[list[Any]] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    presence_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    repeat_penalty: float | None = Field(None, gt=0, strict=True)   # 1.0: off
    repeat_last_n: int | None = Field(None, ge=-1, strict=True)     # -1: the whole context, 0: off
    dry_multiplier: float | None = Field(None, strict=True)         # llama.cpp's DRY: 0 off
    dry_base: float | None = Field(None, ge=1, strict=True)
    dry_allowed_length: int | None = Field(None, ge=0, strict=True)
    dry_penalty_last_n: int | None = Field(None, ge=-1, strict=True)  # -1: the whole context, 0: off
    # llama.cpp matches each breaker against the whole vocabulary (about 20 ms over 151k tokens): a few do
    dry_sequence_breakers: list[str] | None = Field(None, min_length=1, max_length=MAX_BREAKERS)
    # what the answer must be: OpenAI's response_format, llama.cpp's grammar (GBNF) and json_schema
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict | None = None
    ignore_eos: bool = Field(False, strict=True)  # llama.cpp's: the end-of-generation tokens never chosen (a bias of -inf)
    # llama-server's: the most tokens a <think> block may hold before </think> is forced (-1: the server's)
    reasoning_budget_tokens: int | None = Field(None, ge=-1, strict=True)
    thinking_budget_tokens: int | None = Field(None, ge=-1, strict=True)  # its other name (Anthropic's, passed on)
    reasoning_budget_message: str | None = None  # ...and the text forced before that </think>
    # ...and the block's tags, which ggufspec's are (constraints.reasoning_budget: others refused)
    reasoning_budget_start_tag: str | None = None
    reasoning_budget_end_tags: list[str] | None = None
    reasoning_budget_end_tag: str | None = None  # its single-tag name (end_tags first where both are sent)
    sse_ping_interval: int | None = Field(None, strict=True)  # llama-server's: this stream's pings (<= 0: none)
    # llama.cpp's sampler chain: its order (names or letters), and what acts only within it (`samplers`)
    samplers: Annotated[str, Field(max_length=MAX_SAMPLERS)] | Annotated[list[str], Field(max_length=MAX_SAMPLERS)] \
        | None = None
    min_keep: int | None = Field(None, ge=0, strict=True)
    adaptive_target: float | None = Field(None, le=1, strict=True)  # adaptive-p, where `samplers` lists it (< 0: off)
    adaptive_decay: float | None = Field(None, ge=0, le=0.99, strict=True)
    # llama-server's stream extras: each chunk's timings so far; the prompt's progress before the first token
    timings_per_token: bool = Field(False, strict=True)
    return_progress: bool = Field(False, strict=True)
    # llama-server's log-probabilities: the n likeliest tokens at each position, with the chosen one's (its
    # name on every route), and as probabilities (prob / top_probs) rather than logprob / top_logprobs
    n_probs: int | None = Field(None, ge=0, le=20)
    post_sampling_probs: bool = Field(False, strict=True)
    # llama-server's line limits (stops.LineLimits): a line less indented than n_indent ends the answer;
    # past t_max_predict_ms it ends at the next newline (<= 0: no limit)
    n_indent: int = Field(0, ge=0, strict=True)
    t_max_predict_ms: int | None = Field(None, strict=True)
    n_cache_reuse: int | None = Field(None, ge=0, strict=True)  # llama-server's KV shifting: 0 (off) only

    @model_validator(mode="after")
    def _n_cmpl_is_n(self):
        if self.n_cmpl is not None:
            self.n = self.n_cmpl
        return self

    @model_validator(mode="after")
    def _no_cache_shifting(self):
        if self.n_cache_reuse:  # as serve's --cache-reuse (unsupported_flags)
            raise APIError(400, f"n_cache_reuse {self.n_cache_reuse} is not supported: ggufspec reuses the prefix "
                                "a slot holds, never chunks moved within the cache (llama.cpp's KV shifting); leave "
                                "it out or send 0", code="unsupported_parameter", param="n_cache_reuse")
        return self



class CompletionBody(GenerationBody):
    prompt: list[int] | str | list[str] | list[list[int]]  # ids first: a long list of ids is checked as ints at once
    logprobs: int | None = Field(None, ge=0, le=20, strict=True)  # the legacy API: how many alternatives per token
    # OpenAI's, refused rather than ignored (as llama-server does): an answer without them would look whole
    echo: bool = Field(False, strict=True)
    suffix: str | None = None
    best_of: int | None = None
    grammar_lazy: bool = Field(False, strict=True)  # llama-server's: the grammar waits for grammar_triggers


class InfillFile(Strict):
    text: str
    filename: str | None = None


class NativeBody(CompletionBody):
    """llama.cpp's own /completion and /infill: llama-server's field names (n_predict, n_probs, stop,
    cache_prompt... are GenerationBody's already); /infill's prompt is optional, the text typed after
    input_prefix."""
    # llama-server's mixed prompt too, ids and texts in one list ([755, " add"]: protocols.llamacpp)
    prompt: list[int] | str | list[str] | list[list[int]] | list[int | str] = ""
    return_tokens: bool = False
    input_prefix: str | None = None
    input_suffix: str | None = None
    input_extra: list[InfillFile] = Field(default_factory=list)
    response_fields: list[str] | None = None  # the answer's fields to send ("timings/prompt_n": one inside)


class ContentPart(Strict):
    type: str
    text: str | None = None


class CalledFunction(Strict):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict | None = None  # OpenAI's is a JSON text; some clients send the object


class ToolCallItem(Strict):
    """An assistant message's earlier call, checked here: the chat template reads its fields."""
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str = "function"
    function: CalledFunction


class Message(Strict):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: passed to the chat template
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallItem] | None = None


class ChatBody(GenerationBody):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    # llama-server's: variables for the chat template ({"enable_thinking": false} for Qwen3), and where a
    # reasoning model's <think> block goes (reasoning_content, or left in content: "none")
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["auto", "deepseek", "deepseek-legacy", "none"] | None = None
    reasoning_effort: str | None = None  # OpenAI's; "none" turns thinking off, others go to the template
    # llama-server's: the thinking may be ended while it runs (POST /v1/chat/completions/control, `control`)
    reasoning_control: bool = Field(False, strict=True)
    # vLLM's and transformers' (llama-server reads them): the last message continued, or a new turn (chatturn)
    continue_final_message: StrictBool | Literal["content", "reasoning_content"] | None = None
    add_generation_prompt: bool | None = Field(None, strict=True)
    echo: bool = Field(False, strict=True)  # llama-server's: the continued message in the answer (refused)
    parse_tool_calls: bool | None = Field(None, strict=True)  # llama-server's: false leaves calls as text


def template_variables(body: ChatBody, defaults: dict | None = None) -> dict:
    """The chat template's variables: the server's --chat-template-kwargs, then the request's, then
    reasoning_effort (llama-server's rules: "none" is enable_thinking false; another effort is passed
    on as `reasoning_effort`, which gpt-oss's template reads)."""
    variables = {**(defaults or {}), **(body.chat_template_kwargs or {})}
    taken = [name for name in body.chat_template_kwargs or {} if name in RENDERER_VARIABLES]
    if taken:
        raise APIError(400, f"chat_template_kwargs.{taken[0]} is set by the server itself: leave it out",
                       code="invalid_value", param="chat_template_kwargs")
    if not isinstance(variables.get("enable_thinking", False), bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be true or false, got "
                            f"{variables['enable_thinking']!r}", code="invalid_value", param="chat_template_kwargs")
    if body.reasoning_effort == "none":
        variables["enable_thinking"] = False
    elif body.reasoning_effort:
        variables["reasoning_effort"] = body.reasoning_effort
    return variables


def request_options(body: GenerationBody, defaults: dict) -> dict:
    """The decoder's stream() keywords: the server's defaults, overridden by what the request sets."""
    options = dict(defaults)
    max_tokens = next((n for n in (body.n_predict, body.max_completion_tokens, body.max_tokens) if n is not None), None)
    if max_tokens is not None:
        # 0: the prompt alone, into the cache, as llama-server takes n_predict 0 (and Anthropic max_tokens 0)
        if max_tokens == 0 and body.n_predict is None and not isinstance(body, NativeBody):
            raise APIError(400, "max_tokens must be >= 1, got 0", code="invalid_value")
        options["n_predict"] = max_tokens
    for name in ("temperature", "top_k", "top_p", "min_p", *LLAMACPP_FILTERS):
        if getattr(body, name) is not None:
            options[name] = getattr(body, name)
    if body.seed is not None:
        if body.seed < -1:
            raise APIError(400, f"seed must be >= 0 (or -1 for a random one), got {body.seed}", code="invalid_value")
        options["seed"] = None if body.seed == -1 else body.seed
    if body.draft is not None:
        options["n_draft"] = body.draft
    if body.cache_prompt is not None:
        options["cache_prompt"] = body.cache_prompt
    if body.lookup and body.hybrid:
        raise APIError(400, "choose one of lookup and hybrid", code="invalid_value")
    if body.lookup is not None or body.hybrid is not None:
        options["drafter"] = "lookup" if body.lookup else "hybrid" if body.hybrid else "model"
    spec = body.speculative
    if spec is not None:
        for name, option in (("n_max", "draft_max"), ("n_min", "draft_min"), ("p_min", "draft_p_min")):
            if getattr(spec, name) is not None:
                options[option] = getattr(spec, name)
        if spec.n_max is not None and options.get("n_draft") != "auto":  # a fixed K is capped too
            options["n_draft"] = min(options.get("n_draft", spec.n_max), spec.n_max)
    return options


def line_limits(body: GenerationBody) -> dict | None:
    """llama-server's n_indent and t_max_predict_ms as stops.LineLimits' keywords (None: neither is set)."""
    limit_ms = min(body.t_max_predict_ms or 0, 10 ** 15)  # no later than 30,000 years: past a float's range, as never
    seconds = limit_ms / 1000 if limit_ms > 0 else None
    return {"n_indent": body.n_indent, "time_limit_s": seconds} if body.n_indent or seconds else None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """The request's stop strings as a list; empty ones stop nothing."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return [s for s in stops if s]


MAX_CHOICES = 128  # prompts x n in one /v1/completions request


def completion_prompts(body: CompletionBody) -> list[str | list[int]]:
    """/v1/completions' prompts: a text or token ids, or a list of them (each answered by `n`
    choices, all in the slots at once); what it cannot do, refused."""
    if body.echo:
        raise APIError(400, "echo is not supported: the prompt's log-probabilities are not computed",
                       code="unsupported_parameter")
    if body.best_of is not None and body.best_of > 1:
        raise APIError(400, "best_of is not supported: n gives several choices", code="unsupported_parameter")
    if body.grammar_lazy and (body.grammar or body.json_schema is not None):
        raise APIError(400, "grammar_lazy is not supported (the grammar applies from the first token here): leave "
                            "it out, or send tools to /v1/chat/completions", code="unsupported_parameter")
    prompt = body.prompt
    batch = isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                      or all(isinstance(p, list) for p in prompt))
    if not batch:
        return [prompt]  # one text, one prompt's ids, or llama-server's mixed ids and texts
    if len(prompt) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompt)} prompts x n {body.n} is more than the {MAX_CHOICES} choices one "
                       "request may ask for: send them in several requests", code="invalid_value")
    return prompt  # all texts or all lists of ids: the body's checks saw to that


def single_prompt(body: CompletionBody) -> str | list[int]:
    """llama-server's /completion prompt: a text, token ids, or a list of one of them."""
    prompts = completion_prompts(body)
    if len(prompts) != 1:
        raise APIError(400, f"one prompt per request here, got {len(prompts)}: send each in a request of its "
                       "own, or a list of them to /v1/completions")
    return prompts[0]


MEDIA_PARTS = ("image_url", "input_audio", "file")


def message_dicts(messages: list[Message]) -> list[dict]:
    """Messages as the chat template wants them: content a string (text parts joined)."""
    result = []
    for i, m in enumerate(messages):
        calls = [call.model_dump(exclude_none=True) for call in m.tool_calls or []]
        if m.content is None and not (m.role == "assistant" and calls):
            # as OpenAI's API: only an assistant message that calls tools may go without content
            kind = "an assistant message without tool_calls" if m.role == "assistant" else f"a {m.role} message"
            raise APIError(400, f"messages[{i}].content is required for {kind}", code="invalid_value")
        content = content_text(m.content, f"messages[{i}].content")
        # OpenAI's developer messages are the system's instructions, which chat templates know by that name
        role = "system" if m.role == "developer" else m.role
        result.append({**(m.model_extra or {}), "role": role, "content": content,
                       **({"tool_calls": calls} if calls else {})})
    return result


def content_text(content: str | list[ContentPart] | None, where: str) -> str:
    """A message's content as one string: its text parts joined."""
    if not isinstance(content, list):
        return content or ""
    for j, part in enumerate(content):
        if part.type in MEDIA_PARTS:
            raise APIError(400, f"{where}[{j}]: only text content is supported (no images, audio or files)",
                           code="invalid_value")
        if part.type != "text":
            raise APIError(400, f"{where}[{j}].type: unknown content part type {part.type!r} (text is "
                                f"supported)", code="invalid_value")
        if part.text is None:
            raise APIError(400, f"{where}[{j}].text is required for a text part", code="invalid_value")
    return "".join(part.text for part in content)
