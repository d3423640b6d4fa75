"""What a generation gives back: a `Step` per token from the loop, a `Piece` per token with its text (UTF-8
safe, cut at a stop string), and the whole `Generation`."""
from __future__ import annotations

import codecs
import dataclasses
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from .errors import GgufspecError
from .stats import Stats
from .stops import StopFilter


class Step(NamedTuple):
    """One generated token: the target's choice, whether the draft proposed it, and (when asked) its
    log-probability and the most likely alternatives, from the target's processed distribution."""

    token: int
    from_draft: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


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


def stop_strings(stop) -> list[str]:
    """`stop` (a string or a list of them; None: none, as llama-cpp-python's) as a list; empty strings stop
    nothing (as in the server)."""
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise GgufspecError(f"stop must be a string or a list of strings, got {stop!r}"[:200])
    return [s for s in stops if s]


def until_stop(pieces: Iterator[Piece], stops: list[str], stats: Stats) -> Iterator[Piece]:
    """`pieces` until the first of `stops` appears in their text, which ends just before it: the piece it
    begins in goes out trimmed (or not at all, where nothing of it comes first), the generation stops there.
    A piece that might be the beginning of a stop string is held back until the next one tells."""
    held = StopFilter(stops)
    try:
        for piece in pieces:
            yield from _released(held.push({"text": piece.text, "piece": piece}))
            if held.stopped:
                pieces.close()  # the loop ends here (its statistics say "interrupted" ...
                stats.stop_reason = "stop"  # ... which this corrects)
                return
        yield from _released(held.flush())  # no stop string came: what was held back
    finally:
        pieces.close()


def _released(items: list[dict]) -> Iterator[Piece]:
    for item in items:
        yield dataclasses.replace(item["piece"], text=item["text"])


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
