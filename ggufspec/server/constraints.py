"""What a request asks of the distribution and the shape of its answer: logit_bias and the penalties,
a grammar (tools, response_format, llama.cpp's `grammar` / `json_schema`), logprobs. Checked here, on
the event loop, so that a bad value is a 400 naming its field; turned into the engine's `Constraints`
on the worker thread, where the model is (a trigger text's token id needs the vocabulary)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .. import tools as toolkit
from ..errors import GgufspecError
from ..gbnfmerge import either
from ..thinking import CLOSE, OPEN, ReasoningControl
from .errors import APIError
from .schemas import ChatBody, CompletionBody, GenerationBody, NativeBody, template_variables

NO_GRAMMAR = (None, False, ())


@dataclass(frozen=True)
class Shaping:
    """A request's constraints (the engine's Constraints keywords, trigger texts not yet tokens),
    its tool plan and how many log-probabilities per token it wants."""
    constraints: dict = field(default_factory=dict)
    triggers: tuple[str, ...] = ()
    plan: toolkit.ToolPlan = toolkit.ToolPlan(None, parse=False)
    fmt: toolkit.ToolFormat | None = None
    logprobs: int | None = None   # None: none; 0: the chosen token's; n: and the n likeliest
    template_variables: dict = field(default_factory=dict)  # the chat template's (schemas.template_variables)


def shaping(body: GenerationBody, fmt: toolkit.ToolFormat, n_vocab: int, end_ids=lambda: (),
            tokenize=None, template_defaults: dict | None = None, thinks: bool = False,
            parse_calls: bool = True) -> Shaping:
    """The request's constraints, tools, logprobs and chat template variables, checked (APIError 400
    naming the field). `end_ids()`: the tokens that end a generation, which `ignore_eos` rules out;
    `tokenize(text)`: the tokens of a logit_bias key that is a text; `template_defaults`: the server's
    chat template variables; `thinks`: the chat template knows a <think> block, which a format (a
    schema, a tool call) then shapes the answer after, not the thinking; `parse_calls` false: calls are
    left in the answer's text (--skip-chat-parsing), as a request's parse_tool_calls false leaves them."""
    plan = tool_plan(body, fmt) if isinstance(body, ChatBody) else toolkit.ToolPlan(None, parse=False)
    if not parse_calls or getattr(body, "parse_tool_calls", None) is False:  # the grammar, if any, still applies
        plan = dataclasses.replace(plan, parse=False)
    grammar, lazy, triggers = response_grammar(body)
    if plan.grammar is not None and grammar is not None and not plan.forced:
        # tools and a format (OpenAI's API takes both: Codex's --output-schema, the Agents SDK's output_type):
        # the answer is a call, or the format's; from its first token, so no prose before a call either
        grammar, lazy, triggers = either(plan.grammar, grammar), False, ()
    elif plan.grammar is not None:  # calls only where they are forced: the format is for a later answer
        grammar, lazy, triggers = plan.grammar, plan.lazy, plan.triggers
    bias = logit_bias(body.logit_bias, n_vocab, tokenize) if body.logit_bias else {}
    if body.ignore_eos:
        bias.update(dict.fromkeys(end_ids(), -math.inf))
    constraints = {**penalties(body), **({"logit_bias": bias} if bias else {}), **reasoning_budget(body)}
    if isinstance(body, ChatBody) and body.reasoning_control:
        constraints["reasoning_control"] = ReasoningControl()  # the job's, armed by its completion id (`control`)
    if grammar is not None:
        constraints["grammar"] = grammar
        if lazy:
            constraints["grammar_patterns"] = toolkit.trigger_patterns(fmt, plan.names)
        if thinks and isinstance(body, ChatBody) and body.grammar is None:  # a raw grammar is the whole output's
            constraints["grammar_outside_thinking"] = True
    variables = template_variables(body, template_defaults) if isinstance(body, ChatBody) else {}
    return Shaping(constraints, triggers if lazy else (), plan, fmt, requested_logprobs(body), variables)


def tool_plan(body: ChatBody, fmt: toolkit.ToolFormat) -> toolkit.ToolPlan:
    try:
        return toolkit.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, fmt)
    except GgufspecError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def response_grammar(body: GenerationBody) -> tuple[str | None, bool, tuple]:
    """(GBNF, lazy, triggers) for response_format, `grammar` or `json_schema`: at most one of them."""
    asked = [name for name in ("response_format", "grammar", "json_schema") if getattr(body, name) is not None]
    form = body.response_format
    if form is not None and form.type == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise APIError(400, f"send one of {' and '.join(asked)}, not both", code="invalid_value")
    try:
        if body.grammar is not None:
            if not body.grammar.strip():
                raise APIError(400, "grammar is empty", code="invalid_value")
            return body.grammar, False, ()
        if body.json_schema is not None:
            return toolkit.schema_grammar(body.json_schema), False, ()
        if form is None or form.type == "text":
            return NO_GRAMMAR
        if form.type == "json_object":
            grammar = toolkit.schema_grammar(form.schema_) if form.schema_ else toolkit.json_object_grammar()
            return grammar, False, ()
        schema = form.json_schema.schema_ if form.json_schema is not None else None
        if schema is None:
            raise APIError(400, "response_format.json_schema.schema is missing", code="invalid_value")
        return toolkit.schema_grammar(schema), False, ()
    except GgufspecError as exc:
        raise APIError(400, f"response_format: {exc}" if form is not None else str(exc), code="invalid_value") from None


def reasoning_budget(body: GenerationBody) -> dict:
    """llama-server's reasoning_budget_tokens (or thinking_budget_tokens; -1: the server's
    --reasoning-budget) and reasoning_budget_message, as Constraints keywords."""
    check_thinking_tags(body)
    budget = next((n for n in (body.reasoning_budget_tokens, body.thinking_budget_tokens) if n is not None), -1)
    found = {"reasoning_budget": budget} if budget != -1 else {}
    if body.reasoning_budget_message is not None:
        found["reasoning_budget_message"] = body.reasoning_budget_message
    return found


def check_thinking_tags(body: GenerationBody) -> None:
    """llama-server's reasoning_budget_start_tag and reasoning_budget_end_tags (or _end_tag): the block the
    budget counts. ggufspec's is always <think>...</think>: those are taken, any other is a 400."""
    end_tags = body.reasoning_budget_end_tags
    if end_tags is None and body.reasoning_budget_end_tag is not None:
        end_tags = [body.reasoning_budget_end_tag]
    given = [("reasoning_budget_start_tag", body.reasoning_budget_start_tag, OPEN)]
    given += [("reasoning_budget_end_tags", tag, CLOSE) for tag in end_tags or () if tag]  # empty ones: none, as there
    for name, tag, known in given:
        if tag is not None and tag.strip() != known:
            raise APIError(400, f"{name} {tag!r} is not supported: the thinking block ggufspec tracks is always "
                                f"{OPEN}...{CLOSE}; leave it out", code="unsupported_parameter", param=name)


REQUEST_PENALTIES = ("frequency_penalty", "presence_penalty", "repeat_penalty", "repeat_last_n", "dry_multiplier",
                  "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")


def penalties(body: GenerationBody) -> dict:
    """frequency/presence penalties (OpenAI's), repeat_penalty and repeat_last_n (llama.cpp's; -1: the
    whole sequence, as there), and llama.cpp's DRY."""
    given = {name: getattr(body, name) for name in REQUEST_PENALTIES if getattr(body, name) is not None}
    if "dry_sequence_breakers" in given:
        given["dry_sequence_breakers"] = tuple(given["dry_sequence_breakers"])
    return given


def logit_bias(bias: dict | list, n_vocab: int, tokenize=None) -> dict[int, float]:
    """OpenAI's {"token id": bias} (-100..100), or llama.cpp's [[id, bias], ...]; `false`: never. A key
    that is no integer is a text, as llama-server takes it: each of its tokens gets the bias."""
    pairs = bias.items() if isinstance(bias, dict) else [tuple(pair) if len(pair) == 2 else (pair, None)
                                                         for pair in bias]
    checked = {}
    for key, value in pairs:
        tokens = bias_tokens(key, n_vocab, tokenize)
        if value is False:
            value = -math.inf
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100] (or false), got {value!r} for "
                                f"{key!r}", code="invalid_value")
        checked.update(dict.fromkeys(tokens, float(value)))
    return checked


def bias_tokens(key, n_vocab: int, tokenize=None) -> list[int]:
    """The tokens a logit_bias key names: a token id, or a text's tokens (llama-server's
    common_tokenize, no BOS, special tokens as plain text)."""
    try:
        token = int(key)
    except (TypeError, ValueError):
        tokens = tokenize(key) if isinstance(key, str) and tokenize is not None else []
        if not tokens:
            raise APIError(400, f"logit_bias keys must be token ids or texts, got {key!r}",
                           code="invalid_value") from None
        return tokens
    if not 0 <= token < n_vocab:
        raise APIError(400, f"logit_bias: token id {token} is not in [0, {n_vocab})", code="invalid_value")
    return [token]


def requested_logprobs(body: GenerationBody) -> int | None:
    """How many alternatives per token the request wants (0: the chosen token's alone; None: none):
    OpenAI's logprobs (and chat's top_logprobs), or llama-server's n_probs, which it reads on every route
    (on /completion logprobs is its other name; its 0 is none)."""
    if isinstance(body, ChatBody):
        if body.logprobs:
            return body.top_logprobs or 0
        if body.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value")
        return body.n_probs or None
    if isinstance(body, CompletionBody):
        if body.n_probs is not None or isinstance(body, NativeBody):
            return (body.n_probs if body.n_probs is not None else body.logprobs) or None
        return body.logprobs
    return None


def engine_constraints(shape: Shaping, trigger_tokens: tuple[int, ...], defaults=None):
    """The engine's Constraints for a request: what it sets over the server's defaults (`serve`'s
    --logit-bias, penalty and grammar flags; None: none), or None when neither asks for any."""
    if not shape.constraints:
        return defaults
    from ..processing import Constraints
    options = dict(shape.constraints)
    if "grammar_patterns" in options:
        options["grammar_trigger_tokens"] = trigger_tokens
    for name in ("grammar_patterns", "grammar_trigger_tokens"):
        if name in options:
            options[name] = tuple(options[name])
    return dataclasses.replace(defaults, **options) if defaults is not None else Constraints(**options)
