"""Step costs measured on the device, the target's time for a batch of n tokens and the draft's:

- for `--draft auto`, before it decides (`measure_step_costs`: `serve` runs it before serving, a
  decoder before its first auto step; `costmemory` remembers them per machine);
- for `bench`'s predicted column (and what `plan` reads back), with the draft's catch-up batches and
  reading a row of logits, timed between a bench's runs (`CostSampler`), not once after them, so that
  they come from the same moments as the speeds they are compared with.
"""
from __future__ import annotations

import statistics
import time

from .costs import Costs
from .native import Context
from .sampling import greedy_token

DRAFT_SIZES = (1, 2, 3, 4)  # the draft's batches: one token, and what it catches up on after a step
LONG_SIZES = (13, 17)       # longer target batches: `auto` verifies n-gram copies of up to 16 tokens


class CostSampler:
    """measure_costs' rounds spread over a bench: one after each prompt's configurations, so that
    the costs a prediction replays come from the same moments as the runs they are compared with.
    On a machine shared with other jobs the load drifts: one measurement after the runs found T(1)
    at 162 ms where the target-alone runs had just taken 125 ms a token. Each size's first run
    builds its graph and is not kept, and each time is a size's second run in a row; the medians are
    over every round."""

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
                # a batch right after one of another size pays for the switch (on an H200, 1.5-3.5 ms
                # more than llama-bench's same-size runs: its graph is built and uploaded again); a
                # loop at a fixed K repeats one size, so the size's second run in a row is the one timed
                _time_batch(getattr(self.decoder, name), n, self.warm_up)
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
    ctx.synchronize()
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


def measure_step_costs(target: Context, draft: Context | None, costs: Costs, sizes=(1, 2, 4, 8), token: int = 0,
                       repeats: int = 3, budget_seconds: float = 3.0) -> None:
    """Time target batches of several sizes and single draft tokens on the device itself, so
    `--draft auto` starts from this machine's costs instead of guessing or probing. Several sizes,
    because T(n) is not a line: kernels change with the batch size (on one CPU here T(4) was 5.8x
    T(1) and T(8) 6.6x).

    The tokens are appended after whatever the caches hold and cut off again, so a cached
    conversation survives. Each size's first run pays for building its graph and is not kept.
    Where the memory cannot drop a suffix (recurrent), a target batch of n > 1 is timed with what a
    rejection costs on top: saving the state before it, restoring it, re-evaluating one token.
    """
    jobs = [(target, n) for n in sizes] + ([(draft, 1)] if draft is not None else [])
    started = time.perf_counter()
    for number, (ctx, n) in enumerate(jobs, 1):
        if ctx.n_past + n > ctx.n_ctx:
            continue
        for run in range(repeats + 1):
            start = ctx.n_past
            if n == 1:  # a single token is never cut back in a step: its save is not timed
                ctx.checkpoint(upcoming=1, force=True)
            t0 = time.perf_counter()
            if n > 1:  # forced: the second cut below needs it even where n_rs_seq cuts the first
                ctx.checkpoint(upcoming=n, force=True)
            ctx.decode([token] * n, n_logits=n if ctx is target else 1)
            ctx.synchronize()
            if n > 1:
                ctx.keep(start + 1)
            seconds = time.perf_counter() - t0
            ctx.keep(start)
            if run == 0:
                continue
            if ctx is target:
                costs.add_batch(n, seconds)
            else:
                costs.draft_times.append(seconds)
            if time.perf_counter() - started > budget_seconds * number / len(jobs):
                break  # a big model on a CPU: one warm run per size is enough to start from
