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


def one_thread_at_a_time(lock, steps: Iterator) -> Iterator:
    """`steps` advanced, and closed, holding the decoder's lock. llama.cpp is not thread-safe: two threads
    stepping generations of one decoder crashed the process; now they take turns, the later generation takes
    the decoder over as it would in one thread (the earlier one stops with an error), and a close() from
    another thread waits for the step running."""
    try:
        while True:
            with lock:
                step = next(steps, None)  # a step is never None
            if step is None:
                return
            yield step
    finally:  # no lock: nothing steps it now, and its close frees only its own samplers (and may come from a
        steps.close()  # garbage collection in a thread that holds a lock a step waits on)
