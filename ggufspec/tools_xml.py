"""The qwen3_xml family of tool calls: Qwen3-Coder's, and Qwen3.5's and Nemotron 3 Nano's (their chat
templates are derived from it). Their templates render a call, and taught the model to write it, as

    <tool_call>
    <function=NAME>
    <parameter=PARAM>
    VALUE
    </parameter>
    </function>
    </tool_call>

(or, at times, the same without its `<tool_call>` lines: a bare call, taken where it names a known
function), where a value is raw text: a string as it is, any other JSON value as its JSON text. The tool's
parameter schema says which a value is (a string parameter's `123` is the text "123", an integer
parameter's the number), as llama.cpp's parser reads it (common/parsers/qwen3-coder.cpp): a parameter
that may be a string is JSON only where its text is JSON of another type it allows, one that may not
is JSON where its text is JSON at all, else the text.

The grammar is llama.cpp's too: required parameters in any order (up to 6 of them, then in the
schema's), then optional ones; a string's text anything without `</parameter>` in it (its minLength
and maxLength not followed, as llama.cpp's: a count of characters that keeps `</parameter>` out needs a
rule per length, and one that refuses `<` would refuse a file's text to a write_file tool); a value of
other types JSON by the schema (the caller's converter writes those rules); an enum one of its values' texts.

tools.py dispatches to this module; it imports nothing from tools.py (which imports it).
"""
from __future__ import annotations

import json
import math
import re

from .gbnftrie import TrieWriter
from .schemafollow import local_target, normalized

CLOSE = "</parameter>"
BARE_START = "<function="  # a call without its <tool_call>, as Qwen3-Coder writes one at times
CALL_OPEN = re.compile(r"<tool_call>|" + BARE_START)
FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>")
FUNCTION_CLOSE = re.compile(r"\s*</function>(?:\s*</tool_call>)?")
CLOSE_AFTER_JSON = re.compile(r"\s*</parameter>")
SPACE = re.compile(r"\s*")
MAX_PERMUTED = 6  # llama.cpp's COMMON_CHAT_MAX_PERMUTE: past it, required parameters in the schema's order
NL = "\n"
TEXT_RULE = "tx-text"  # a string value: any text without </parameter>


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON")


JSON = json.JSONDecoder(parse_constant=_no_constant)


def is_xml_template(template: str) -> bool:
    """llama.cpp's test (common/chat.cpp): a template that writes `<tool_call>`, `<function=` and
    `<parameter=`, unless it writes them without newlines between (another model's format)."""
    return ("<tool_call>" in template and "<function=" in template and "<parameter=" in template
            and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in template)


class ToolNames(frozenset):
    """A request's tool names, with each tool's parameters schema (`schemas`), by which the qwen3_xml
    parser tells a parameter's string value from its JSON one."""

    schemas: dict

    def __new__(cls, tools: list[dict]):
        names = super().__new__(cls, (t["function"]["name"] for t in tools))
        names.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        return names


# ---------------------------------------------------------------- what a schema allows

def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"  # integer and number alike: a parser cannot tell 5 from 5 (nor 5.0)
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def value_types(schema, root: dict, seen: tuple = ()) -> frozenset | None:
    """The JSON types a parameter's schema allows ("integer" as "number"); None: any (no type said)."""
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        ref = schema["$ref"]
        target = local_target(root, ref) if isinstance(ref, str) and ref not in seen else None
        return None if target is None else value_types(target, root, (*seen, ref))
    if "const" in schema:
        return frozenset({json_type(schema["const"])})
    if isinstance(schema.get("enum"), list):
        return frozenset(json_type(value) for value in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            branches = [value_types(branch, root, seen) for branch in schema[key]]
            return None if None in branches else frozenset().union(*branches)
    kind = schema.get("type")
    if isinstance(kind, (str, list)):
        return frozenset("number" if k == "integer" else k for k in ([kind] if isinstance(kind, str) else kind))
    for branch in schema.get("allOf") or []:
        if (types := value_types(branch, root, seen)) is not None:
            return types
    if "properties" in schema or "additionalProperties" in schema:
        return frozenset({"object"})
    return frozenset({"array"}) if "items" in schema else None


def _parameter_schema(schemas: dict, function: str, parameter: str):
    root = schemas.get(function)
    properties = root.get("properties") if isinstance(root, dict) else None
    schema = properties.get(parameter) if isinstance(properties, dict) else None
    return schema, root if isinstance(root, dict) else {}


# ---------------------------------------------------------------- parsing an answer

def parse(text: str, schemas: dict) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]): the calls in an answer, the text around them content. A call
    cut short (no `</function>`) or malformed is no call: it and what follows stay content. A bare call
    (`<function=` without `<tool_call>`) must name a known function (a key of `schemas`): other text
    that merely looks like one, as a message explaining the format, stays content."""
    content, calls, position = [], [], 0
    while opening := CALL_OPEN.search(text, position):
        start, bare = opening.start(), opening[0] == BARE_START
        call = _call_at(text, start if bare else opening.end(), schemas)
        if call is None or (bare and call[0] not in schemas):
            break
        name, arguments, end = call
        content.append(text[position:start])
        calls.append((name, arguments))
        position = end
    content.append(text[position:])
    return "".join(content), calls


def _call_at(text: str, position: int, schemas: dict):
    opening = FUNCTION_OPEN.match(text, position)
    if not opening:
        return None
    name, arguments, position = opening[1].strip(), {}, opening.end()
    while parameter := PARAMETER_OPEN.match(text, position):
        schema, root = _parameter_schema(schemas, name, parameter[1].strip())
        types = value_types(schema, root) if schema is not None else None
        found = _value_at(text, parameter.end(), types)
        if found is None:
            return None
        arguments[parameter[1].strip()], position = found
    closing = FUNCTION_CLOSE.match(text, position)
    if not closing:
        return None
    rest = text[closing.end():].strip()
    cut = rest and "</tool_call>" not in closing[0] and "</tool_call>".startswith(rest)
    return name, arguments, len(text) if cut else closing.end()  # a </tool_call> cut short: the call's too


def _value_at(text: str, position: int, types: frozenset | None):
    """A parameter's value from `position` (just after `<parameter=...>`) and where its `</parameter>`
    ends, or None (no `</parameter>`)."""
    if types is not None and "string" not in types:  # JSON by its schema: its strings may hold </parameter>
        try:
            value, end = JSON.raw_decode(text, SPACE.match(text, position).end())
            if (after := CLOSE_AFTER_JSON.match(text, end)) and _finite(value):
                return value, after.end()
        except ValueError:
            pass
    close = text.find(CLOSE, position)
    if close < 0:
        return None
    raw = text[position:close]
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    return typed_value(raw, types), close + len(CLOSE)


def typed_value(raw: str, types: frozenset | None):
    """A value's text as the JSON value its schema's types make of it (see the module's docstring)."""
    if types == frozenset({"string"}):
        return raw
    try:
        value = JSON.decode(raw)
    except ValueError:
        return raw
    if not _finite(value):  # 1e999: Python's inf, which no client's JSON holds
        return raw
    if types is None or "string" not in types or json_type(value) in types:
        return value
    return raw


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    return True


# ---------------------------------------------------------------- rendering a conversation

def with_text_values(message: dict) -> dict:
    """An assistant message's calls as these templates iterate them (`arguments|items`): arguments a
    mapping (never a JSON text), each value the text the model writes (a string as it is, any other
    value as its JSON text: the templates' `|string` would write Python's True and None)."""
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**(call.get("function") or {}),
                                   "arguments": text_arguments((call.get("function") or {}).get("arguments"))}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def text_arguments(arguments) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = JSON.decode(arguments) if arguments.strip() else {}
        except ValueError:
            return {"arguments": arguments}  # not JSON: shown as the text it is
    if arguments is None:
        return {}
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    return {key: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            for key, value in arguments.items()}


# ---------------------------------------------------------------- grammars

def call_rules(tools: list[dict], converter, *, only: str | None, parallel: bool) -> str:
    """GBNF rules (and root) for calls in this format: one call (of `only` when named) or, `parallel`,
    one or more, whitespace (`tc-ws`) between. The JSON values' rules are visited into `converter`,
    whose grammar the caller writes beside these (raw text here: the caller's JSON-string fixes would
    break it). Raises ValueError for a parameter nothing can follow."""
    rules, functions = excluding(TEXT_RULE, CLOSE), []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        schema = normalized(json.loads(json.dumps(function["parameters"])))
        resolved = converter.resolve_refs(normalized(json.loads(json.dumps(function["parameters"]))), f"tool{i}")
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        resolved_properties = resolved.get("properties") if isinstance(resolved.get("properties"), dict) else {}
        required = [n for n in schema.get("required") or [] if isinstance(n, str)]
        required_rules, optional_rules = [], []
        for j, parameter in enumerate(dict.fromkeys([*properties, *required])):
            rule = f"tx-{i}-{j}"
            value = _value_rule(properties.get(parameter, {}), resolved_properties.get(parameter, {}), schema,
                                converter, f"{rule}-value")
            rules.append(f'{rule} ::= {gbnf_literal(f"<parameter={parameter}>{NL}")} {value} "\\n</parameter>\\n"')
            (required_rules if parameter in required else optional_rules).append(rule)
        arguments = _permuted(f"tx-{i}-args", required_rules, rules)
        if optional_rules:
            arguments += f' ({" | ".join(optional_rules)})*'
        opening = gbnf_literal(f"<function={function['name']}>\n")
        rules.append(f"tx-{i} ::= " + " ".join(part for part in (opening, arguments, '"</function>\\n"') if part))
        functions.append(f"tx-{i}")
    rules.append(f"tx-call ::= {' | '.join(functions)}")
    rules.append('tx-one ::= "<tool_call>\\n" tx-call "</tool_call>"')
    # a bare call too: the lazy grammar starts at `<function=` as well, and must take what follows it
    rules.append("tx-any ::= tx-one | tx-call")
    rules.append("root ::= tx-any" + (" (tc-ws tx-any)*" if parallel else ""))
    return "\n".join(rules)


def _value_rule(schema: dict, resolved: dict, root: dict, converter, name: str) -> str:
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = dict.fromkeys(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                              for v in (values if isinstance(values, list) else []))
        texts = [text for text in texts if CLOSE not in text]
        if not texts:
            raise ValueError(f"nothing can follow {name} (an empty enum)")
        return TrieWriter(gbnf_literal, converter._add_rule, name).choice([(text, "") for text in texts]) or '""'
    types = value_types(schema, root)
    if types is None or "string" in types:  # as llama.cpp: a value that may be a string is free text
        return TEXT_RULE
    return converter.visit(resolved, name)


def _permuted(prefix: str, parts: list[str], rules: list[str]) -> str:
    """The parts in any order (llama.cpp's permute: a rule per set of parts left), or in theirs past
    MAX_PERMUTED; "" for none."""
    if len(parts) <= 1 or len(parts) > MAX_PERMUTED:
        return " ".join(parts)
    for left in range(1, 1 << len(parts)):
        options = [f"{part} {prefix}-{left & ~(1 << k)}" if left & ~(1 << k) else part
                   for k, part in enumerate(parts) if left & (1 << k)]
        rules.append(f"{prefix}-{left} ::= {' | '.join(options)}")
    return f"{prefix}-{(1 << len(parts)) - 1}"


def excluding(name: str, word: str) -> list[str]:
    """GBNF rules for any text that does not contain `word`, as llama.cpp writes them
    (gbnf_excluding_grammar): the word's automaton, every state accepting, and the character that
    would complete the word never allowed."""
    def state_name(state: int) -> str:
        return name if state == 0 else f"{name}-{state}"

    def after(state: int, char: str) -> int:  # the longest start of the word the text so far ends with
        text = word[:state] + char
        return next((k for k in range(min(len(text), len(word)), 0, -1) if text.endswith(word[:k])), 0)

    rules = []
    for state in range(len(word)):
        buckets, specific = {}, []
        for char in sorted(set(word)):
            target = after(state, char)
            if target:
                specific.append(char)
                if target < len(word):
                    buckets.setdefault(target, []).append(char)
        options = [""] + [f"[{_class_chars(chars)}] {state_name(target)}" for target, chars in sorted(buckets.items())]
        options.append(f"[^{_class_chars(specific)}] {name}")
        rules.append(f"{state_name(state)} ::= " + " | ".join(options))
    return rules


def _class_chars(chars) -> str:
    return "".join("\\" + c if c in "-]\\[" else c for c in chars)


def gbnf_literal(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char in "\n\r\t":
            escaped.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\x{ord(char):02X}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'
