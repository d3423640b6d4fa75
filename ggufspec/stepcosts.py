"""Step costs measured on the device for `bench`'s predicted column (and what `plan` reads back):
the target's time for a batch of n tokens, the draft's for its catch-up batches, reading a row of
logits. Timed between a bench's runs (`CostSampler`), not once after them, so that they come from
the same moments as the speeds they are compared with.
"""
from __future__ import annotations

import statistics
import time

from .sampling import greedy_token

DRAFT_SIZES = (1, 2, 3, 4)  # the draft's batches: one token, and what it catches up on after a step
LONG_SIZES = (13, 17)       # longer target batches: `auto` verifies n-gram copies of up to 16 tokens


class CostSampler:
    """measure_costs' rounds spread over a bench: one after each prompt's configurations, so that
    the costs a prediction replays come from the same moments as the runs they are compared with.
    On a machine shared with other jobs the load drifts: one measurement after the runs found T(1)
    at 162 ms where the target-alone runs had just taken 125 ms a token. Each size's first run
    builds its graph and is not kept; the medians are over every round."""

    def __init__(self, decoder, k_max: int = 8):
        self.decoder = decoder
        self.jobs = [("target", n) for n in (*range(1, k_max + 2), *LONG_SIZES)]
        self.jobs += [("draft", n) for n in DRAFT_SIZES] if decoder.draft is not None else []
        self.warm_up = decoder.tokenize(WARM_UP)
        self.samples: dict[str, list[float]] = {}
        self.rounds = 0

    def sample(self, rounds: int = 1) -> None:
        """Time every size `rounds` times (after a first, untimed round the first time)."""
        for number in range(rounds + (self.rounds == 0)):
            timed = self.rounds > 0 or number > 0
            for name, n in self.jobs:
                seconds = _time_batch(getattr(self.decoder, name), n, self.warm_up)
                if timed:
                    self.samples.setdefault(f"{name}_{n}", []).append(seconds)
        self.rounds += rounds

    def costs(self, min_rounds: int = 5) -> dict:
        """Median seconds per size (rounds topped up to min_rounds), and reading one row of logits."""
        if self.rounds < min_rounds:
            self.sample(min_rounds - self.rounds)
        costs = {key: statistics.median(times) for key, times in self.samples.items()}
        costs["row"] = _row_seconds(self.decoder.target)
        return costs


WARM_UP = "def fibonacci(n):\n    "  # what a batch is appended to when a context is empty


def _time_batch(ctx, n: int, warm_up: list[int]) -> float:
    """A batch of n tokens appended to what the context holds (about the length the runs were at),
    timed, and cut off again, so that the cached prompt survives for the next run."""
    if ctx.n_past == 0 or ctx.n_past + n > ctx.n_ctx:
        ctx.keep(0)
        ctx.decode(warm_up, n_logits=1)
    base = ctx.n_past
    token = ctx.tokens[-1]
    t0 = time.perf_counter()
    ctx.decode([token] * n, n_logits=n)
    seconds = time.perf_counter() - t0
    ctx.keep(base)
    return seconds


def _row_seconds(ctx) -> float:
    ctx.decode(ctx.tokens[-1:], n_logits=1)
    row = ctx.logits(0)
    t0 = time.perf_counter()
    for _ in range(20):
        greedy_token(row)
    seconds = (time.perf_counter() - t0) / 20
    ctx.keep(ctx.n_past - 1)
    return seconds


def measure_costs(decoder, k_max: int = 8, repeats: int = 5) -> dict:
    """Median seconds of a target batch of n = 1..k_max+1 tokens (and LONG_SIZES), of a draft batch
    of DRAFT_SIZES (draft_1: a token), and of reading one row of logits (an argmax over the
    vocabulary), `repeats` rounds in a row (CostSampler spreads them over a bench instead). The
    sizes take turns, round after round, so that a machine whose load drifts weighs on each alike."""
    return CostSampler(decoder, k_max).costs(repeats)
