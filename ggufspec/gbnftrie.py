"""Alternatives that share their beginnings, written as a tree (a trie) in GBNF.

llama.cpp's grammar sampler keeps one stack per alternative a text could still be in, and checks every
candidate token against every stack. An enum written as llama.cpp's converter writes it,
`"\\"red\\"" | "\\"green\\"" | ...`, is one stack per value at its first character: with the demo's
152k-token vocabulary a position's mask cost 0.35 s for 100 values and 24 s for 5,000 (the quote they
all begin with included). Written as a tree, `"\\"" ("red\\"" | "green\\"" | ...)` with each shared
prefix once, a position has at most one stack per distinct next character. The language is the same
text for text, so the masks, and every answer, are too (tests/test_gbnftrie.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

# llama.cpp's GBNF parser recurses once per parenthesised group: a tree deeper than this goes on in
# rules of its own ("a" | "aa" | "aaa" ... nests once per value)
MAX_NESTING = 32


def common_prefix(texts: Sequence[str]) -> str:
    first, last = min(texts), max(texts)
    n = 0
    while n < len(first) and first[n] == last[n]:
        n += 1
    return first[:n]


class TrieWriter:
    """`literal(text)`: GBNF for the text as it is (the converter's `_format_literal`); `add_rule(name,
    body)`: a named rule, its name back (the converter's `_add_rule`), for subtrees past MAX_NESTING."""

    def __init__(self, literal: Callable[[str], str], add_rule: Callable[[str, str], str], name: str):
        self.literal, self.add_rule, self.name = literal, add_rule, name or "root"

    def choice(self, entries: Sequence[tuple[str, str]], depth: int = 0) -> str:
        """GBNF for one of `entries`, each (text, tail): the text as a literal, then the tail (a GBNF
        expression, "" for none). Entries with the same text and tail are one alternative."""
        if depth >= MAX_NESTING:  # the subtree as a rule of its own, nesting from 0 again
            tree = self.choice(entries)
            return self.add_rule(f"{self.name}-trie", tree[1:-1]) if tree.startswith("(") else tree
        entries = list(dict.fromkeys(entries))
        by_first: dict[str, list[tuple[str, str]]] = {}
        ends: list[str] = []  # the tails of entries whose text ends here
        for text, tail in entries:
            if text:
                by_first.setdefault(text[0], []).append((text, tail))
            else:
                ends.append(tail)
        alternatives = [self._branch(group, depth) for group in by_first.values()] + ends
        if len(alternatives) == 1:
            return alternatives[0]
        return f"({' | '.join(alternatives)})"  # an empty one (a text that ends where others go on) is allowed

    def _branch(self, group: list[tuple[str, str]], depth: int) -> str:
        """The entries beginning with one character: their common prefix once, then the rest of each."""
        prefix = common_prefix([text for text, _ in group])
        rest = self.choice([(text[len(prefix):], tail) for text, tail in group], depth + 1)
        return " ".join(part for part in (self.literal(prefix), rest) if part)
