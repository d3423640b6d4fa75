"""A JSON schema's `pattern` as llama-cpp-python's converter can write it (schemafollow.BoundedConverter):
anchored at both ends, \\d and \\w as classes, the string's lengths counted where the pattern repeats
one character."""
from __future__ import annotations

import re

from .errors import ToolError


# a pattern of one character (a class, \d, \w, `.` or a plain one) repeated: ^[a-z]+$, ^\d{3,5}$
ONE_CHARACTER_REPEATED = re.compile(r"\^(\[(?:\\.|[^\]\\])+\]|\\[dw]|\.|[\w -])(\*|\+|\?|\{\d+(?:,\d*)?\})?\$")


def length_in_pattern(schema: dict) -> dict:
    """pydantic's constr(pattern="^[a-z]+$", max_length=10): where the pattern repeats one character,
    the string's minLength/maxLength go into its count (^[a-z]{1,10}$), which the converter follows:
    it follows a pattern or the lengths, never both."""
    pattern, least, most = schema.get("pattern"), schema.get("minLength", 0), schema.get("maxLength")
    if not ("minLength" in schema or "maxLength" in schema) or not isinstance(pattern, str):
        return schema
    if not (found := ONE_CHARACTER_REPEATED.fullmatch(pattern)) or not all(
            type(bound) is int and bound >= 0 for bound in (least, most) if bound is not None):
        return schema  # refused by check_followed, or its bounds by length_bounds
    low, high = repeat_counts(found[2])
    low, high = max(low, least), high if most is None else most if high is None else min(high, most)
    if high is not None and low > high:
        return schema
    rest = {key: value for key, value in schema.items() if key not in ("minLength", "maxLength", "pattern")}
    return {**rest, "pattern": f"^{found[1]}{{{low},{'' if high is None else high}}}$"}


QUANTIFIERS = {None: (1, 1), "*": (0, None), "+": (1, None), "?": (0, 1)}


def repeat_counts(quantifier: str | None) -> tuple[int, int | None]:
    """(least, most) of a regex quantifier: none, *, +, ?, {m}, {m,} or {m,n} (most None: no limit)."""
    if quantifier in QUANTIFIERS:
        return QUANTIFIERS[quantifier]
    least, comma, most = re.fullmatch(r"\{(\d+)(,?)(\d*)\}", quantifier).groups()
    return int(least), int(most) if most else None if comma else int(least)


def anchored(pattern: str) -> str:
    """JSON Schema's pattern may match anywhere in the string (ECMA-262's search); the converter writes
    only ^...$, the whole string, and refused the rest ("Pattern must start with ^"). An end left open
    gets `.*` (any characters but line breaks, the converter's `.`: fewer strings, never others)."""
    start, end = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[start:len(pattern) - end]
    if start and end or (start or end) and top_level_alternation(body):
        return pattern  # whole already; or ^a|b, whose anchor binds one branch: left to the converter
    return f"^{'' if start else '.*'}({body}){'' if end else '.*'}$" if body else "^.*$"


def top_level_alternation(pattern: str) -> bool:
    """Whether `pattern` has a | outside its groups, classes and escapes."""
    depth, in_class, i = 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            return True
        i += 1
    return False


# \d and \w as GBNF classes (the converter kept them as literal text, which GBNF does not parse); the
# other class escapes could let a quote or a control character into the JSON string: refused by name
CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_"}
LITERAL_ESCAPES = ".$-/"  # escaped in a regex, plain characters in GBNF (in a class, or as one)


def class_escapes(pattern: str) -> str:
    out, i, in_class = [], 0, False
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped in CLASS_ESCAPES:
                out.append(CLASS_ESCAPES[escaped] if in_class else f"[{CLASS_ESCAPES[escaped]}]")
            elif escaped in LITERAL_ESCAPES:  # the converter passes these on as "\\." in a literal: no GBNF
                if in_class and escaped == "-" and pattern[i + 2:i + 3] != "]":  # would make a range in GBNF
                    raise ToolError(f"the pattern /{pattern}/ has \\- inside a class: put the - last in the class")
                out.append(escaped if in_class or escaped in "-/" else f"[{escaped}]")
            elif escaped in "DWsSbB":
                raise ToolError(f"the pattern /{pattern}/ uses \\{escaped}, which the grammar does not follow "
                                f"(\\d and \\w it does; write a class such as [ ] or [^0-9] instead)")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        in_class = (pattern[i] == "[") or (in_class and pattern[i] != "]")
        out.append(pattern[i])
        i += 1
    return "".join(out)
