"""What `plan` says about the draft: where its costs and acceptance come from, and the predicted
speedup here (at the asked K, the best fixed K, and `--draft auto`), by the simulator.

Costs: measured on this machine where `bench` or `--draft auto` remembered them for the pair and
offload (costs.json, see `measured`), else estimated (`estimate.batch_seconds`). Acceptance: the
pair's recorded traces (shipped with ggufspec, in its home's traces/ folder, or given with
--trace), else an assumed per-token acceptance, said so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..simulate import (CostCurve, Policy, Trace, TraceError, best_fixed_k, known_traces, pair_identity, predict,
                        read_trace, synthetic_trace)

NO_GAIN_BELOW = 1.02  # a predicted speedup under this is "no gain here": within the prediction's error


@dataclass
class DraftOutlook:
    label: str           # the trace's prompts ("code", "chat"), or "assumed"
    acceptance: float    # per token
    at_k: float          # speedup at the asked K
    best_k: int
    best: float
    auto: float

    @property
    def pays(self) -> bool:
        return max(self.best, self.auto) >= NO_GAIN_BELOW


def local_pair_paths(pair, model, model_draft) -> tuple[str | None, str | None]:
    """The pair's files where they are on disk (a plan may be made from headers read over HTTP)."""
    if model is not None:
        return model, model_draft
    from ..registry import load_registry
    from ..store import final_path, is_complete
    registry = load_registry()
    entries = [registry.model(name) for name in (registry.pair(pair).target, registry.pair(pair).draft)]
    if not all(is_complete(e) for e in entries):
        return None, None
    return tuple(str(final_path(e, e.first_file)) for e in entries)


def pair_traces(target_path, draft_path, given: tuple[str, ...] = ()) -> list[Trace]:
    """--trace files (checked against the pair when it is on disk), else the known traces of the pair."""
    identity = pair_identity(target_path, draft_path) if target_path and draft_path else None
    if given:
        traces = [read_trace(path) for path in given]
        if identity is not None:
            for trace in traces:
                trace.check_pair(identity)
        return traces
    return known_traces(identity) if identity is not None else []


def trace_label(trace: Trace) -> str:
    """What a trace's prompts were: its prompt file's name (code.jsonl: "code"), else its own file's."""
    source = trace.meta.get("prompts") or trace.source
    return Path(str(source)).stem.removeprefix("trace-demo-").removeprefix("trace-")


def outlooks(curve: CostCurve, traces: list[Trace], acceptance: float, n_draft: int) -> list[DraftOutlook]:
    """The draft's predicted speedup per trace (or at the assumed acceptance) under `curve`."""
    cases = [(trace_label(t), t) for t in traces] or [("assumed", synthetic_trace(acceptance))]
    found = []
    for label, trace in cases:
        best = best_fixed_k(trace, curve)
        found.append(DraftOutlook(label, trace.acceptance, predict(trace, curve, Policy(n_draft)).speedup,
                                  int(best.policy[2:]), best.speedup, predict(trace, curve, Policy(auto=True)).speedup))
    return found


def outlook_lines(found: list[DraftOutlook], curve: CostCurve, traces: list[Trace], acceptance: float,
                  n_draft: int) -> list[str]:
    t1 = curve.target(1)
    lines = [f"costs: {curve.source}: target T(1) {1e3 * t1:.1f} ms, T(4) {curve.target(4) / t1:.2f} T(1), "
             f"a draft token {curve.t_draft / t1:.2f} T(1)"]
    if traces:
        lines.append("acceptance: from traces of this pair: " + "; ".join(
            f"{trace_label(t)} ({Path(t.source).name}: {len(t.prompts)} prompts, {t.acceptance:.0%} a token)"
            for t in traces))
    else:
        lines.append(f"acceptance: assumed {acceptance:.0%} a token (the planner's default, DEFAULT_ACCEPTANCE); "
                     f"no trace of this pair: record one with ggufspec bench --record-trace FILE, then plan --trace FILE")
    for o in found:
        verdict = "" if o.pays else ": no gain here (run the target alone: --no-draft)"
        lines.append(f"draft here ({o.label}, {o.acceptance:.0%} a token): {o.at_k:.2f}x at K={n_draft}, best fixed "
                     f"K={o.best_k} {o.best:.2f}x, --draft auto {o.auto:.2f}x{verdict}")
    return lines


__all__ = ["DraftOutlook", "NO_GAIN_BELOW", "TraceError", "local_pair_paths", "outlook_lines", "outlooks",
           "pair_traces", "trace_label"]
