"""Tool calling and structured output, model family by family: how a conversation with tools is
rendered, what a call looks like in a model's output (parsed into OpenAI's `tool_calls`), and the GBNF
grammars that make a call, or a JSON answer, valid whatever the model's skill.

Pure functions over texts, templates and JSON schemas: no model is needed to test them.

The families (what their chat templates taught them to write):
- hermes (Qwen 2.5/3, Hermes 2 Pro, and ggufspec's ChatML fallback): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- llama3 (Llama 3.1+): the whole message is `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`
- qwen3_xml (Qwen3-Coder, Qwen3.5, Nemotron 3 Nano): `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...`
  (tools_xml.py: values typed by the tool's schema, as llama.cpp's parser and grammar do), or the same
  call without its `<tool_call>` (Qwen3-Coder writes one at times), of a known function
A template that does not mention tools is taught the hermes format by a system message.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from llama_cpp.llama_grammar import JSON_GBNF

from . import tools_xml
from .errors import ToolError
from .schemafollow import (MAX_OPTIONAL, BoundedConverter, check_followed, check_shapes, grammar_for, normalized,
                           patterns_it_can_follow, root_ref_inlined)

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PYTHON_TAG = "<|python_tag|>"
FENCED = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
# a message that starts like this may be a call as a whole (JSON, perhaps in a ```json block)
WHOLE_CALL_OPENINGS = ("{", "```json", PYTHON_TAG)
# where a call may begin: streaming holds the text back from there (a qwen3_xml call may start bare, at
# `<function=`: held back in every family, as every family's answer is parsed for the others' calls too)
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", PYTHON_TAG, tools_xml.BARE_START)
# whitespace between the parts of a call: bounded, so a grammar cannot let a model loop on newlines
GRAMMAR_WS = "tc-ws ::= [ \\t\\n]{0,4}"
# what a negated class inside a JSON string must leave out too: the converter's `char` ([^"\\]), its
# pattern `dot` ([^\x0A\x0D]) and a pattern's [^0-9] let a raw newline, a quote or a backslash in: no JSON
NOT_IN_JSON_STRINGS = r'"\\\x7F\x00-\x1F'


@dataclass(frozen=True)
class ToolFormat:
    name: str            # hermes | llama3 | mistral | qwen3_xml
    native: bool         # the chat template renders `tools` itself
    start: str           # the text a call starts with
    args_key: str        # "arguments" (hermes, mistral) or "parameters" (llama3)
    # mistral's newer templates (Devstral, Ministral 3, Small 3.2): `[TOOL_CALLS]name[ARGS]{...}` for each
    # call, Small 3.2's with `[CALL_ID]` and a 9-character id before `[ARGS]`: "[ARGS]" or "[CALL_ID]"
    named: str = ""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str       # a JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of a generation."""
    tools: list | None            # passed to the chat template (None: tools are not offered)
    parse: bool                   # parse the answer for calls
    grammar: str | None = None    # GBNF the answer (or, lazily, a call) must follow
    lazy: bool = False            # the grammar applies once a trigger appears
    triggers: tuple[str, ...] = ()   # texts that start a call (lazy grammar: patterns / tokens)
    forced: bool = False          # the answer is calls only
    names: frozenset = field(default_factory=frozenset)   # a tools_xml.ToolNames: with the tools' schemas


def detect_format(template: str) -> ToolFormat:
    """The family a chat template belongs to, from the markers its text contains."""
    native = "tools" in template
    if "[TOOL_CALLS]" in template:
        named = next((marker for marker in ("[CALL_ID]", "[ARGS]") if marker in template), "")
        return ToolFormat("mistral", native, "[TOOL_CALLS]", "arguments", named)
    if tools_xml.is_xml_template(template):  # before hermes: its calls start with <tool_call> too
        return ToolFormat("qwen3_xml", True, "<tool_call>", "arguments")
    if "<tool_call>" in template:
        return ToolFormat("hermes", native, "<tool_call>", "arguments")
    if "<|start_header_id|>" in template and native:
        return ToolFormat("llama3", native, "{", "parameters")
    return ToolFormat("hermes", False, "<tool_call>", "arguments")


# ---------------------------------------------------------------- the request's tools

def check_tools(tools: list[dict] | None) -> list[dict]:
    """OpenAI's tool objects, checked: each {"type": "function", "function": {"name", "parameters"?}}."""
    checked = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}")
        if any(name == t["function"]["name"] for t in checked):
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice: tool names must be unique")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        checked.append({"type": "function", "function": {**function, "parameters": parameters or {"type": "object"}}})
    return checked


def chosen_function(tool_choice, tools: list[dict]) -> str | None:
    """The function name a tool_choice names ({"type": "function", "function": {"name"}}), else None."""
    if not isinstance(tool_choice, dict):
        if tool_choice not in (None, "auto", "none", "required"):
            raise ToolError(f"tool_choice must be auto, none, required or a named function, got {tool_choice!r}")
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError('tool_choice must be auto, none, required or {"type": "function", "function": '
                        '{"name": ...}} naming one of the tools')
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools")
    return name


def plan_tools(tools: list[dict] | None, tool_choice, parallel: bool | None, fmt: ToolFormat) -> ToolPlan:
    """tools + tool_choice (auto, none, required, a named function) as a generation's plan."""
    tools = check_tools(tools)
    named = chosen_function(tool_choice, tools)
    if not tools:
        if tool_choice not in (None, "auto", "none"):
            raise ToolError("tool_choice needs tools")
        return ToolPlan(None, parse=False)
    if tool_choice == "none":
        return ToolPlan(None, parse=False)
    names = tools_xml.ToolNames(tools)
    forced = named is not None or tool_choice == "required"
    grammar = call_grammar(tools, fmt, only=named, parallel=parallel is not False and named is None)
    return ToolPlan(tools, parse=True, grammar=grammar, lazy=not forced, triggers=trigger_texts(fmt),
                    forced=forced, names=names)


def trigger_texts(fmt: ToolFormat) -> tuple[str, ...]:
    """The texts that start a call: under `auto`, the lazy grammar takes over from there. A qwen3_xml
    call may start bare, at `<function=` (llama.cpp triggers there too; the grammar's root takes both);
    `<tool_call>` first: where one piece holds both, the pattern listed first fires, from the wrapper."""
    if fmt.name == "qwen3_xml":
        return (fmt.start, tools_xml.BARE_START)
    return (PYTHON_TAG,) if fmt.name == "llama3" else (fmt.start,)


def trigger_patterns(fmt: ToolFormat, names: frozenset = frozenset()) -> tuple[str, ...]:
    """Regexes (searched in the text so far) whose match starts a call; the grammar takes the text
    from the match's start, and llama.cpp aborts the process where the grammar does not take it. A
    llama3 call is a whole message: `{"name": "<a tool>"` at its start, spaced as the grammar spaces it
    (a JSON answer, `{"name": "Alice"` or `{\\n  "name"`, stays free: content, or a call if parsed as one)."""
    if fmt.name == "llama3":
        known = "|".join(sorted(name.replace(".", "\\.") for name in names))
        return (r'^[ \t\n]{0,4}\{ ?"name"' + (f' ?: ?"(?:{known})"' if known else ""), re.escape(PYTHON_TAG))
    return tuple(re.escape(text) for text in trigger_texts(fmt))


# ---------------------------------------------------------------- rendering a conversation

def prepare_messages(messages: list[dict], fmt: ToolFormat, tools: list | None) -> list[dict]:
    """Messages as templates want them: a call's arguments as an object (templates `tojson` them);
    for a template that knows no tools, calls and results written out in the hermes format and the
    tools described in the system message."""
    prepared = [_with_object_arguments(m) for m in messages]
    if fmt.name == "qwen3_xml":  # the template iterates `arguments|items` and writes each value as text
        prepared = [tools_xml.with_text_values(m) for m in prepared]
    if fmt.native:
        return prepared
    prepared = [_as_plain_text(m) for m in prepared]
    if tools:
        prompt = tools_system_prompt(tools)
        if prepared and prepared[0]["role"] == "system":
            prepared[0] = {**prepared[0], "content": prepared[0]["content"] + "\n\n" + prompt}
        else:
            prepared.insert(0, {"role": "system", "content": prompt})
    return prepared


def tools_system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


def _with_object_arguments(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # not JSON: the template shows it as the string it is
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def _as_plain_text(message: dict) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    if message["role"] == "assistant" and message.get("tool_calls"):
        calls = [f'<tool_call>\n{json.dumps({"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}, ensure_ascii=False)}\n</tool_call>'
                 for c in message["tool_calls"]]
        text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
        return {"role": "assistant", "content": text}
    return message


# ---------------------------------------------------------------- parsing an answer

def parse_calls(text: str, fmt: ToolFormat, names: frozenset = frozenset()) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) in a model's answer: the family's own format first, then the others.
    Text that is not a well-formed call stays content; content without anything in it is None."""
    parsers = {"hermes": _parse_hermes, "qwen3_xml": _parse_xml, "mistral": _parse_mistral,
               "llama3": _parse_json_message}
    order = [fmt.name] + [name for name in parsers if name != fmt.name]
    for name in order:
        content, calls = parsers[name](text, names)
        if calls:
            return (content.strip() or None), calls
    return text, []


def _call_from(obj, names: frozenset, need_known: bool = False) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} as a ToolCall (arguments as JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if need_known and obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if arguments is None and need_known:
        return None
    if isinstance(arguments, str):  # the arguments as a JSON text (OpenAI's shape): JSON a client can load
        try:
            arguments = JSON.decode(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(arguments if arguments is not None else {}, ensure_ascii=False))


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON")  # Python's decoder takes NaN and Infinity; clients' do not


JSON = json.JSONDecoder(parse_constant=_no_constant)


def _json_at(text: str, position: int):
    """The JSON value starting at `position` (whitespace skipped) and where it ends, or (None, position)."""
    while position < len(text) and text[position].isspace():
        position += 1
    try:
        return JSON.raw_decode(text, position)
    except ValueError:
        return None, position


def _parse_hermes(text: str, names: frozenset) -> tuple[str, list[ToolCall]]:
    content, calls, position = [], [], 0
    while (start := text.find("<tool_call>", position)) >= 0:
        obj, end = _json_at(text, start + len("<tool_call>"))
        call = _call_from(obj, names)
        if call is None:
            break
        close = text.find("</tool_call>", end)
        end = close + len("</tool_call>") if close >= 0 and not text[end:close].strip() else end
        content.append(text[position:start])
        calls.append(call)
        position = end
    content.append(text[position:])
    return "".join(content), calls


def _parse_xml(text: str, names: frozenset) -> tuple[str, list[ToolCall]]:
    content, calls = tools_xml.parse(text, getattr(names, "schemas", {}))
    return content, [ToolCall(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]


def _parse_mistral(text: str, names: frozenset) -> tuple[str, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    position = start + len("[TOOL_CALLS]")
    obj, end = _json_at(text, position)
    if obj is None and text.startswith("[", end):
        obj, end = _cut_array(text, end)
    if isinstance(obj, list):
        calls = [_call_from(item, names) for item in obj]
        return (text[:start] + text[end:], calls) if calls and all(calls) else (text, [])
    calls = []  # the newer form: name[ARGS]{...}, repeated
    pattern = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\][A-Za-z0-9_-]*)?(?:\[ARGS\])?")
    while (match := pattern.match(text, position)) and match.end() < len(text):
        arguments, end = _json_at(text, match.end())
        if not isinstance(arguments, dict):
            break
        calls.append(ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False)))
        position = end
    return (text[:start] + text[position:], calls) if calls else (text, [])


def _cut_array(text: str, bracket: int):
    """Nemo's list of calls cut short (by max_tokens, or a stop), `[{...}, {"name": "f", "argu`: its
    complete items and the text's end, the cut item dropped. Its text is the start of a call, no content
    (and without a marker the server could not tell it from content to strip); the finish reason,
    "length", says the answer was cut, as the hermes parser keeps the calls before a cut one. A list
    that closes is malformed, not cut: (None, bracket), and it stays content."""
    if not _unclosed(text, bracket):
        return None, bracket
    items, position = [], bracket + 1
    while True:
        item, end = _json_at(text, position)
        if not text[position:end].strip():  # no whole item here (JSON's null is one): the cut one
            break
        items.append(item)
        if not (comma := LIST_COMMA.match(text, end)):
            break
        position = comma.end()
    return (items or None), len(text)


LIST_COMMA = re.compile(r"\s*,")


def _unclosed(text: str, opening: int) -> bool:
    """Whether the JSON array or object opening at `opening` runs to the end of the text unclosed
    (brackets inside strings aside): cut there, rather than malformed."""
    depth, in_string, escaped = 0, False, False
    for char in text[opening:]:
        if in_string:  # an escaped character never ends the string
            in_string, escaped = escaped or char != '"', not escaped and char == "\\"
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}" and (depth := depth - 1) == 0:
            return False
    return True


def _parse_json_message(text: str, names: frozenset) -> tuple[str, list[ToolCall]]:
    """The whole answer is one call or several separated by `;`, each naming a known function: llama3's
    format, and what models of other families write when they answer a call in a ```json block."""
    body = text.strip()
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    fenced = FENCED.match(body)
    body = fenced.group(1) if fenced else body
    calls, position = [], 0
    while position < len(body):
        obj, end = _json_at(body, position)
        call = _call_from(obj, names, need_known=True)
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and (body[position].isspace() or body[position] == ";"):
            position += 1
    return "", calls


def call_start(text: str, fmt: ToolFormat) -> int | None:
    """Where, in an answer so far, a call may have begun (a marker, or the start of one at the end):
    streaming holds the text back from there. None: all of it is content."""
    begun = text.lstrip()
    if any(opening.startswith(begun) or begun.startswith(opening) for opening in WHOLE_CALL_OPENINGS):
        return 0
    found = [i for marker in CALL_MARKERS if (i := text.find(marker)) >= 0]
    if found:
        return min(found)
    partial = [len(text) - k for marker in CALL_MARKERS for k in range(1, len(marker)) if text.endswith(marker[:k])]
    return min(partial, default=None)


def new_call_id(fmt: ToolFormat) -> str:
    """A call's id: Mistral's templates insist on 9 letters and digits."""
    if fmt.name == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def openai_tool_calls(calls: list[ToolCall], fmt: ToolFormat) -> list[dict]:
    return [{"id": new_call_id(fmt), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


# ---------------------------------------------------------------- grammars

def call_grammar(tools: list[dict], fmt: ToolFormat, *, only: str | None = None, parallel: bool = True) -> str:
    """GBNF for the family's call syntax with valid arguments: one call (of `only` when named) or,
    `parallel`, one or more."""
    # integer bounds followed too (a tool's "level" from 1 to 5 took 99); what the grammar cannot follow
    # is not refused here, as response_format's is: agents send large tool schemas and check the arguments
    converter = BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives, named, xml = [], [], ""
    try:
        if fmt.name == "qwen3_xml":  # its own rules (raw text values) beside the converter's JSON values
            xml = tools_xml.call_rules(tools, converter, only=only, parallel=parallel)
        for i, tool in enumerate(tools if not xml else []):
            function = tool["function"]
            if only is not None and function["name"] != only:
                continue
            check_shapes(function["parameters"])
            parameters = patterns_it_can_follow(normalized(json.loads(json.dumps(function["parameters"]))))
            parameters = converter.resolve_refs(root_ref_inlined(parameters), f"tool{i}")
            alternatives.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                                  fmt.args_key: parameters},
                                 "required": ["name", fmt.args_key]})
            if fmt.named:
                named.append(f'"{function["name"]}" tc-mid {converter.visit(parameters, f"tc-args-{i}")}')
        if not fmt.named and not xml:
            converter.visit(alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}, "tc-call")
        rules = json_strings_only(converter.format_grammar())
        if empty := re.search(r"^(\S+) ::=\s*$", rules, re.M):  # an enum or anyOf of nothing: llama.cpp refuses it
            raise ValueError(f"nothing can follow {empty[1]} (an empty enum or anyOf)")
    except Exception as exc:  # the converter's asserts, KeyErrors and ValueErrors alike
        raise ToolError(f"a tool's parameters are not a JSON schema this server can follow: {schema_problem(exc)}") from None
    if xml:
        return f"{rules}\n{xml}\n{GRAMMAR_WS}\n"
    if fmt.named:  # as llama.cpp's grammar for Ministral 3: each call its own [TOOL_CALLS], no space
        mid = '"[CALL_ID]" [a-zA-Z0-9]{9} "[ARGS]"' if fmt.named == "[CALL_ID]" else '"[ARGS]"'
        one = f'tc-call ::= {" | ".join(named)}\ntc-mid ::= {mid}'
        root = f'{one}\nroot ::= "[TOOL_CALLS]" tc-call' + (' ("[TOOL_CALLS]" tc-call)*' if parallel else "")
    elif fmt.name == "mistral":
        calls = 'tc-call (tc-ws "," tc-ws tc-call)*' if parallel else "tc-call"
        root = f'root ::= "[TOOL_CALLS]" tc-ws "[" tc-ws {calls} tc-ws "]"'
    elif fmt.name == "llama3":
        root = f'root ::= ("{PYTHON_TAG}")? tc-ws tc-call'
    else:
        one = 'tc-one ::= "<tool_call>" tc-ws tc-call tc-ws "</tool_call>"'
        root = f"{one}\nroot ::= tc-one" + (" (tc-ws tc-one)*" if parallel else "")
    return f"{rules}\n{root}\n{GRAMMAR_WS}\n"


def schema_grammar(schema) -> str:
    """GBNF for JSON that follows `schema`, by llama-cpp-python's converter (a copy of an older
    llama.cpp json-schema-to-grammar) with integer bounds added (`schemafollow`). A constraint it
    would drop is refused (`check_followed`): an answer that breaks the schema it was asked to follow
    is worse than an error."""
    if not isinstance(schema, dict):
        raise ToolError(f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        check_shapes(schema, max_optional=MAX_OPTIONAL)
        schema = normalized(schema)
        check_followed(schema, schema)
        return json_strings_only(grammar_for(schema))
    except ToolError:
        raise
    except RecursionError:
        raise ToolError("the JSON schema is nested too deeply to follow: flatten it, or name its parts in $defs") \
            from None
    except Exception as exc:  # a keyword of the wrong type ("required": 5, "$ref": 5...) deep inside
        raise ToolError(f"the JSON schema cannot be followed: {schema_problem(exc)}") from None


GBNF_LITERAL_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def json_strings_only(grammar: str) -> str:
    """The grammar with each negated class ([^...]: only ever inside a JSON string) leaving out what a
    JSON string cannot hold raw, as llama.cpp's own converter writes `char`."""
    return GBNF_LITERAL_OR_CLASS.sub(lambda m: "[^" + NOT_IN_JSON_STRINGS + m[0][2:] if m[0].startswith("[^")
                                     else m[0], grammar)


def schema_problem(exc: Exception) -> str:
    """The converter's complaint as one line for an HTTP client (it speaks of its own CLI flags)."""
    message = " ".join(str(exc).split())
    if "Fetching remote schemas" in message:
        return "a $ref to a remote schema (https://...) is not fetched: put the schema inline, under $defs"
    if message.startswith("Error resolving ref"):
        return message.split(":")[0].replace("stdin", "") + " (no such definition)"
    return message[:300]


def json_object_grammar() -> str:
    """GBNF for any JSON object (response_format {"type": "json_object"})."""
    return JSON_GBNF
