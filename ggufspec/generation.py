"""What a generation gives back: a `Piece` per token, its text UTF-8 safe, and the whole `Generation`."""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Iterator

from .stats import Stats


@dataclass(frozen=True)
class Piece:
    """One generated token: its text (may be empty mid-UTF-8 character), id, origin, and (when asked)
    its logprob and the top alternatives as (token id, logprob)."""

    text: str
    token: int
    from_draft: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Generation:
    text: str
    tokens: list[int]
    stats: Stats


def pieces(target, steps: Iterator) -> Iterator[Piece]:
    """Token ids to text, UTF-8 safe: a character split across tokens comes out whole, once."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for step in steps:
        yield Piece(decoder.decode(target.piece(step.token)), *step)

