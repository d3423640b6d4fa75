"""What an answer tells of the speculation (the `ggufspec` fields the chat page shows): where each
token came from and in which step, how much of the prompt the cache held, the time saved."""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from ..stats import Stats


class StepTracker:
    """Which verification step each piece came from (0: the prompt's own batch, which decides the
    first token), and how many tokens that step drafted."""

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
            "prompt_ms": stats.prompt_seconds * 1000, "id_slot": stats.id_slot}


def time_estimate(decoder, drafter: str, stats: Stats) -> dict | None:
    """The time this answer saved (negative: lost) against the target alone, as the cost model sees
    it: the target alone takes T(1) per token, T(1) being the median of the target's recent
    single-token steps that the decoder measured (the cost model keeps the last 8; the median, not
    the least, so that a machine busy with other work now is compared with itself). None before any
    T(1) is known (a fixed K never runs the target alone; `draft: "auto"` measures it on its first
    request)."""
    if stats.n_predict == 0 or stats.decode_seconds <= 0:
        return None
    costs_by_drafter = dict(getattr(decoder, "costs", None) or {})  # a copy: a slot may add a drafter meanwhile
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


# ---------------------------------------------------------------- step costs timed before serving
# `--draft auto` prices every proposal with the target's batch costs T(n). A decoder that has none
# for this pair, threads and offload (costs.json) times them before its first generation: 3.2-3.6 s
# on the demo pair at 2 threads, which a server's first request used to wait for. A server times
# them once, before it says it is serving; every later start reads them from costs.json.

STARTUP_SIZES = (1, 2, 4, 8, 16, 32, 64)  # up to the longest n-gram copy auto proposes (AutoDrafting.NGRAM_K_MAX)
STARTUP_BUDGET_S = 6.0  # nobody waits yet, but a start should stay short on a slow machine


def time_costs_before_serving(decoder, defaults: dict) -> float:
    """Time the step costs the server's default drafting needs, when this machine has none yet.
    Returns the seconds spent (0: remembered, or no `auto` drafting to price)."""
    from ..costs import Costs
    from ..stepcosts import measure_step_costs
    drafter = defaults.get("drafter", "model")
    uses_model = drafter != "lookup"
    if defaults.get("n_draft") != "auto" or (uses_model and decoder.draft is None):
        return 0.0
    costs = decoder.costs.setdefault(drafter, Costs())
    if costs.warm:
        return 0.0
    started = time.perf_counter()
    token = (decoder.tokenize("def") or [0])[0]  # any token: what is timed is the batch size
    # on a thread that ends here: llama.cpp's OpenMP build keeps a team of worker threads for every
    # thread that decodes, and with the main thread's team left over from this timing, the slots'
    # rounds (another thread) were 13% slower (two servers alternating, 4 clients, 4 pairs)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ggufspec-costs") as timing:
        timing.submit(measure_step_costs, decoder.target, decoder.draft if uses_model else None, costs,
                      sizes=STARTUP_SIZES, token=token, budget_seconds=STARTUP_BUDGET_S).result()
    _share_target_costs(decoder.costs, costs)
    return time.perf_counter() - started


def _share_target_costs(by_drafter: dict, measured) -> None:
    """T(n) is the target's, whichever drafter proposes: a request choosing another drafter starts
    from these too (one with a draft model only where the draft's time was measured as well)."""
    from ..costs import Costs
    for name in ("model", "lookup", "hybrid"):
        other = by_drafter.setdefault(name, Costs())
        if other is measured or other.warm or (name != "lookup" and not measured.draft_times):
            continue
        for n, times in measured.batch_times.items():
            for seconds in times:
                other.add_batch(n, seconds)
        other.draft_times.extend(measured.draft_times)
