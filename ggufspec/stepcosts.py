"""What a step costs on this machine, timed on the contexts themselves before `--draft auto` decides.

`measure_step_costs` gives `drafting.Costs` the target's T(n) for a few batch sizes and a draft
token's time, so auto starts from measured costs instead of probing (`serve` runs it before serving,
a decoder before its first auto step; `costmemory` remembers them per machine).
"""
from __future__ import annotations

import time

from .drafting import Costs
from .native import Context


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
