"""Two GBNF grammars as one that takes what either takes: a request's tools (the answer a call) beside its
response format (the answer as JSON), as OpenAI's API takes them together and Codex's `exec --output-schema`
and the OpenAI Agents SDK's `output_type` send them. Each grammar's rules are renamed with a prefix of its own,
so that two rules of one name (each converter writes `root`, `space`, `string`...) cannot meet."""
from __future__ import annotations

import re

# what is not a rule's name, taken whole: literals, character classes, comments (a `#` in a literal is text),
# repetition counts (`{0,4}`: a schema's property "4" makes a rule named 4) and token references (`<think>`, `!<[5]>`)
NOT_NAMES = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*|\{[^}]*\}|<[^>]*>')
WORD = re.compile(r"(?<![a-zA-Z0-9-])[a-zA-Z0-9-]+(?![a-zA-Z0-9-])")  # llama.cpp's name characters
DEFINED = re.compile(r"^[ \t]*([a-zA-Z0-9-]+)[ \t]*::=", re.M)


def prefixed(gbnf: str, prefix: str) -> str:
    """`gbnf` with each rule it defines renamed `prefix` + name, where defined and where used."""
    names = set(DEFINED.findall(gbnf))

    def rename(text: str) -> str:
        return WORD.sub(lambda word: prefix + word[0] if word[0] in names else word[0], text)
    parts, end = [], 0
    for kept in NOT_NAMES.finditer(gbnf):
        parts += [rename(gbnf[end:kept.start()]), kept[0]]
        end = kept.end()
    return "".join(parts + [rename(gbnf[end:])])


def either(calls: str, answer: str) -> str:
    """GBNF whose root takes what `calls`' root takes or what `answer`'s does."""
    return f"root ::= call-root | answer-root\n{prefixed(calls, 'call-')}\n{prefixed(answer, 'answer-')}\n"
