"""What an answer tells of the speculation (the `ggufspec` fields the chat page shows): where each
token came from and in which step, how much of the prompt the cache held, the time saved."""
from __future__ import annotations

import statistics

from ..stats import Stats


class StepTracker:
    """Which verification step each piece came from, and how many tokens that step drafted."""

    def __init__(self, stats: Stats):
        self.stats, self.step, self.drafted, self._drafted_before = stats, 0, 0, 0

    def annotate(self, piece) -> dict:
        """A decoder's `Piece` as the dict that streams: text, token, from_draft, step, drafted."""
        if self.stats.n_steps != self.step:  # the first piece of a new step
            self.step = self.stats.n_steps
            self.drafted = self.stats.n_drafted - self._drafted_before
            self._drafted_before = self.stats.n_drafted
        return {"text": piece.text, "token": piece.token, "from_draft": piece.from_draft,
                "step": self.step, "drafted": self.drafted}


def prompt_info(stats: Stats) -> dict:
    """The prompt as evaluated: how much of it the KV cache already held."""
    return {"n_prompt": stats.n_prompt, "cache_n": stats.n_prompt_cached,
            "prompt_ms": stats.prompt_seconds * 1000}


def time_estimate(decoder, drafter: str, stats: Stats) -> dict | None:
    """The time this answer saved (negative: lost) against the target alone, as the cost model sees
    it: the target alone takes T(1) per token, T(1) being the median of the target's recent
    single-token steps that the decoder measured (the cost model keeps the last 8; the median, not
    the least, so that a machine busy with other work now is compared with itself). None before any
    T(1) is known (a fixed K never runs the target alone; `draft: "auto"` measures it on its first
    request)."""
    if stats.n_predict == 0 or stats.decode_seconds <= 0:
        return None
    costs_by_drafter = getattr(decoder, "costs", None) or {}
    # T(1) is the target's own cost, measured under each drafter: this request's first
    ordered = [costs_by_drafter[drafter]] if drafter in costs_by_drafter else []
    ordered += [c for name, c in costs_by_drafter.items() if name != drafter]
    costs = next((c for c in ordered if c.batch_times.get(1)), None)
    if costs is None:
        return None
    t1 = statistics.median(costs.batch_times[1])
    alone = stats.n_predict * t1
    return {"t1_ms": t1 * 1000, "target_alone_ms": alone * 1000, "decode_ms": stats.decode_seconds * 1000,
            "saved_ms": (alone - stats.decode_seconds) * 1000, "speedup": alone / stats.decode_seconds,
            "target_alone": stats.n_drafted == 0}  # nothing drafted: the target alone, whatever the figures say
