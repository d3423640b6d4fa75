"""Measured step costs: T(n), the target's time for a batch of n tokens, and a draft token's time.

What `drafting`'s controllers price K with, `stepcosts` times before serving, `costmemory` keeps per
machine, and `slots` prices a shared batch with. Measured, not modelled: the least of recent times.
"""
from __future__ import annotations

import functools
import math
from collections import deque

from .costmodel import tokens_per_second
from .errors import GgufspecError
from .ngram import NgramTallies


class Costs:
    """Measured step costs of one drafter on one pair: T(n), the target's time for a batch of n, and
    the draft's time per proposed token. They depend on the machine and the models, not on the
    prompt, so a decoder keeps them from one generation to the next.

    Interference on a shared machine only ever adds time, and a batch size's first run also pays
    for llama.cpp building its graph: the least of the recent measurements is the estimate.
    """

    def __init__(self):
        self.draft_times: deque = deque(maxlen=8)
        self.batch_times: dict[int, deque] = {}
        self._model = None  # T(n), rebuilt only when a least measurement changes
        self._best_rates: dict[int, float] = {}  # best_batch_rate's answers for this T(n)
        self.probe_interval = 2  # steps between probes of the draft model where the last generation left it
        self.ngram = NgramTallies()  # how often n-gram proposals were kept: a prior for the next generation

    def to_dict(self) -> dict:
        return {"draft": list(self.draft_times), "batch": {str(n): list(t) for n, t in self.batch_times.items()},
                "ngram": self.ngram.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "Costs":
        """The costs to_dict wrote; ValueError for a damaged record (a time that is not a positive,
        finite number of seconds: it would make T(n) zero, negative or NaN)."""
        costs = cls()
        costs.draft_times.extend(seconds(t) for t in data.get("draft", []))
        for n, times in data.get("batch", {}).items():
            if int(n) < 1:
                raise ValueError(f"a batch of {n} tokens")
            costs.batch_times[int(n)] = deque((seconds(t) for t in times), maxlen=8)
        costs.ngram = NgramTallies(data.get("ngram") if isinstance(data.get("ngram"), dict) else None)
        return costs

    def observe(self, k: int, draft_seconds: float | None, verify_seconds: float | None) -> None:
        """None: not timed (a step in a batch with other slots' tokens, whose time is not this k's)."""
        self.add_batch(k + 1, verify_seconds)
        if k > 0 and draft_seconds is not None:
            self.draft_times.append(draft_seconds / k)

    def add_batch(self, n: int, seconds: float | None) -> None:
        if seconds is None:
            return
        times = self.batch_times.get(n)
        if times is None:
            times = self.batch_times[n] = deque(maxlen=8)
        least = min(times) if times else None
        times.append(seconds)
        if len(times) == 1 or seconds < least or (len(times) == 8 and least != min(times)):
            self._model = None

    def summary(self) -> dict:
        """The least measured times in milliseconds: target batches by size, and a draft token."""
        return {"target_ms": {n: round(1e3 * min(t), 3) for n, t in sorted(self.batch_times.items())},
                "draft_ms": round(1e3 * self.t_draft, 3)}

    @property
    def t_draft(self) -> float:
        return min(self.draft_times) if self.draft_times else 0.0

    def batch_model(self):
        """T(n) for every n: the measured least where there is one, else a line through them."""
        if not self.batch_times:
            raise GgufspecError("no target batch has been timed yet: T(n) is unknown (time one first: add_batch)")
        if self._model is None:
            self._model = _batch_model({n: min(times) for n, times in self.batch_times.items()})
            self._best_rates = {}
        return self._model

    def best_batch_rate(self, k_max: int) -> float:
        """max over k <= k_max of (k + 1) / T(k + 1): the tokens/s of a step whose k free drafts are all
        kept (what a right n-gram guess at best gives), kept while T(n) stays the same."""
        batch = self.batch_model()
        if k_max not in self._best_rates:
            self._best_rates[k_max] = max(((k + 1) / batch(k + 1) for k in range(1, k_max + 1)), default=0.0)
        return self._best_rates[k_max]

    @property
    def warm(self) -> bool:
        """Enough measurements (beyond each size's cold first run) to judge."""
        return (len(self.batch_times.get(1, ())) >= 2
                and sum(len(t) for n, t in self.batch_times.items() if n > 1) >= 3)

    def most_worth_drafting(self, k_max: int, others: int, others_yield: int) -> int:
        """The most tokens worth drafting in a batch that already holds `others` tokens of other slots,
        which yield `others_yield`: the largest k whose step, every draft kept, beats drafting none in
        the whole batch's tokens per second, (k + 1 + Y) / T(B + k + 1) > 1.05 (1 + Y) / T(B + 1).
        Where a batch of n costs about n single tokens (the AMD CPUs here), a full batch leaves none."""
        if others <= 0 or not self.warm:
            return k_max
        batch = self.batch_model()
        alone = 1.05 * (1 + others_yield) / batch(others + 1)
        return max((k for k in range(1, k_max + 1) if (k + 1 + others_yield) / batch(others + k + 1) > alone),
                   default=0)

    def could_pay(self, max_k: int) -> bool:
        """Whether some K beats the target alone by 5% even with every draft token accepted. On a
        CPU where a batch of n costs about n single tokens, none does, and probing (which also
        makes the draft catch up on everything it skipped) would only cost time."""
        if max_k < 1:
            return False
        if not self.warm:
            return True  # too few measurements to rule drafting out
        batch = self.batch_model()  # acceptance 1: every draft token kept
        best_possible = max(tokens_per_second(k, 1.0, self.t_draft, batch(k + 1)) for k in range(1, max_k + 1))
        return best_possible > 1.05 / batch(1)


def seconds(value) -> float:
    """A remembered time, checked: a positive, finite number of seconds (else ValueError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{value!r} is not a time in seconds")
    return float(value)


def _batch_model(measured: dict[int, float]):
    """T(n) from the least times measured for some sizes: those where measured, straight lines
    between neighbouring sizes elsewhere, and beyond the largest the slope of the last two. Not one
    line through all: T(n) is concave on CPUs, where llama.cpp's batched kernels take over (one
    measured T(3) = 2.1 T(1), T(9) = 3.4 T(1), T(17) = 4.5 T(1)), and a line through those would
    price long drafts at twice their cost."""
    sizes = sorted(measured)
    if len(sizes) == 1:  # one size seen: assume a memory-bound target (a batch costs about one token)
        only = measured[sizes[0]]
        return lambda n: measured.get(n, only)
    last, before = sizes[-1], sizes[-2]
    tail_slope = max((measured[last] - measured[before]) / (last - before), 0.0)

    @functools.lru_cache(maxsize=None)  # asked for every K at every step (auto prices each): keep the answers
    def batch(n: int) -> float:
        if n in measured:
            return measured[n]
        if n > last:
            return measured[last] + tail_slope * (n - last)
        if n < sizes[0]:
            return measured[sizes[0]]
        high = next(size for size in sizes if size > n)  # the neighbours: a handful of sizes, no bisect
        low = max(size for size in sizes if size < n)
        return measured[low] + (measured[high] - measured[low]) * (n - low) / (high - low)
    return batch
