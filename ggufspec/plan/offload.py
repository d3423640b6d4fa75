"""Choosing -ngl / -ngld (and, when the user did not set it, -c) for a target and its draft.

Every option is priced by the speed model (`estimate`: T(n) for every batch size n, on the device
that holds each layer) or, where this machine has measured that offload (costs.json), by those
measurements; with a draft, by replaying an acceptance trace through the simulator (`simulate`:
the same replay as `bench`'s predicted column), or an assumed acceptance where no trace of the
pair is known. The fastest that fits wins, and the target alone is one of the options.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from ..backends import build_backends
from ..simulate import MEASURED_SIZES, CostCurve, Policy, Trace, curve_from_times, predict, synthetic_trace
from .devices import DeviceMemory
from .estimate import GPU_OVERHEAD, MARGIN, Placement, batch_seconds, max_layers, placement, token_seconds
from .shape import ModelShape
from .units import GiB, MiB

DEFAULT_ACCEPTANCE = 0.7      # for predicting a speculative plan's speed before it has run


@dataclass
class Plan:
    n_ctx: int
    target: Placement
    draft: Placement | None
    n_draft: int
    predicted_tps: float
    predicted_target_alone_tps: float
    reason: str
    gpu: DeviceMemory | None
    ram: DeviceMemory
    budget: int = 0
    alternatives: list[dict] = field(default_factory=list)
    draft_speedup: float = 0.0      # the best draft option's predicted speed against the target alone there
    costs_source: str = "estimated"
    acceptance_source: str = ""
    # Where the draft goes when a K is asked for (--draft K): `draft` where the plan drafts; where it
    # says the draft would not pay, the best draft option that leaves the target all its planned GPU
    # layers. On an H100 that is the draft whole on the GPU, not on the CPU (148 against 30 tok/s).
    draft_if_used: Placement | None = None

    def summary(self) -> str:
        draft = "no draft" if self.draft is None else f"-ngld {self.draft.n_gpu_layers}"
        if self.draft is None and self.draft_if_used is not None:
            draft += f" (-ngld {self.draft_if_used.n_gpu_layers} with --draft K)"
        how = "from measured costs" if self.costs_source.startswith("measured") else "estimated"
        return (f"plan: -ngl {self.target.n_gpu_layers} {draft} -c {self.n_ctx} "
                f"({how} {self.predicted_tps:.1f} tok/s vs {self.predicted_target_alone_tps:.1f} alone): {self.reason}")

    def to_dict(self) -> dict:
        return asdict(self)


class _Option(NamedTuple):
    name: str                  # "target alone", "draft on the GPU", "draft on the CPU"
    n_ctx: int
    target: Placement
    draft: Placement | None
    tps: float                 # predicted tokens per second
    t_alone: float             # the target alone's seconds a token, at the same context
    curve: CostCurve | None = None  # a draft option's costs (measured or estimated)
    speedup: float = 1.0            # a draft option's speed against the target alone with its placement


def estimated_curve(target: ModelShape, t: Placement, draft: ModelShape, d: Placement, gpu, ram) -> CostCurve:
    """T(n) and a draft token from the speed model (estimate.batch_seconds)."""
    times = {n: batch_seconds(target, t, gpu, ram, n) for n in MEASURED_SIZES}
    return curve_from_times(times, token_seconds(draft, d, gpu, ram),
                            source="estimated from the GGUF headers and this machine's memory bandwidth")


def gpu_budget(gpu: DeviceMemory | None) -> int:
    """Bytes the plan may put on the GPU: its free memory less the margin and the runtime's overhead."""
    return 0 if gpu is None else int(gpu.free * (1 - MARGIN)) - GPU_OVERHEAD


def _options_at(n_ctx: int, target: ModelShape, draft: ModelShape | None, gpu, ram, budget: int,
                n_draft: int, trace: Trace, measured) -> list[_Option]:
    """At one context: the target alone with as many layers as fit, then (with a draft) the draft
    whole on the GPU or all on the CPU, each with as many target layers as the rest of the budget holds."""
    alone = placement(target, max_layers(target, n_ctx, budget), n_ctx)
    t_alone = token_seconds(target, alone, gpu, ram)
    options = [_Option("target alone", n_ctx, alone, None, 1 / t_alone, t_alone)]
    if draft is None:
        return options
    for draft_ngl in {draft.n_layer + 1, 0} if budget > 0 else {0}:
        d = placement(draft, draft_ngl, n_ctx)
        if d.gpu_bytes > max(budget, 0):  # a GPU too small for anything still leaves the draft on the CPU
            continue
        t = placement(target, max_layers(target, n_ctx, budget - d.gpu_bytes), n_ctx)
        curve = (measured(t.n_gpu_layers, d.n_gpu_layers) if measured else None) \
            or estimated_curve(target, t, draft, d, gpu, ram)
        if curve.source.startswith("measured") and t.n_gpu_layers == alone.n_gpu_layers:
            t_alone = curve.alone_seconds  # measured: the target alone at this offload too
            options[0] = _Option("target alone", n_ctx, alone, None, 1 / t_alone, t_alone)
        speedup = predict(trace, curve, Policy(n_draft)).speedup
        where = "draft on the GPU" if draft_ngl else "draft on the CPU"
        options.append(_Option(where, n_ctx, t, d, speedup / curve.alone_seconds, t_alone, curve, speedup))
    return options


def make_plan(target: ModelShape, draft: ModelShape | None, *, gpu: DeviceMemory | None, ram: DeviceMemory,
              n_ctx: int = 4096, ctx_given: bool = False, n_draft: int = 3,
              acceptance: float = DEFAULT_ACCEPTANCE, trace: Trace | None = None, measured=None) -> Plan:
    """Draft fully on the GPU first, then as many target layers as fit; compare the options (the
    target alone among them) by predicted speed and keep the fastest. Shrinks the context only when
    the user did not set -c, and only to fit the draft. `trace`: the pair's acceptance trace (else
    `acceptance`, assumed); `measured(ngl, ngld)`: this machine's measured CostCurve for an offload,
    or None."""
    budget = gpu_budget(gpu)
    replayed = trace if trace is not None else synthetic_trace(acceptance)
    # a context given, or no draft to fit: the context asked (a few more target layers are not worth
    # half the context; fitting the whole draft on the GPU may be)
    contexts = ([n_ctx] if ctx_given or draft is None
                else [c for c in (n_ctx, n_ctx // 2, n_ctx // 4) if c >= 1024] or [n_ctx])
    options: list[_Option] = []
    for ctx in contexts:
        at_ctx = _options_at(ctx, target, draft, gpu, ram, budget, n_draft, replayed, measured)
        options += at_ctx
        if draft is not None and any(o.draft is not None and o.draft.n_gpu_layers == draft.n_layer + 1
                                     for o in at_ctx):
            break  # the draft fits whole at this context: no need to shrink it further
    # the first option (the target alone at the asked context) stands even when the host is short
    fits = [o for o in options if _host_bytes(o) <= ram.free or o is options[0]]
    best = max(fits, key=lambda o: (o.tps, o.n_ctx))
    with_draft = [o for o in fits if o.draft is not None]
    best_draft = max(with_draft, key=lambda o: (o.tps, o.n_ctx), default=None)
    reason = _reason(best, target, draft, gpu, budget, n_ctx)
    if best.draft is None and best_draft is not None:
        reason += f"; the draft would not pay here (predicted {best_draft.speedup:.2f}x at K={n_draft})"
    plan = Plan(best.n_ctx, best.target, best.draft, n_draft, best.tps, 1 / best.t_alone, reason, gpu, ram, budget,
                [{"option": o.name, "n_ctx": o.n_ctx, "ngl": o.target.n_gpu_layers,
                  "ngld": None if o.draft is None else o.draft.n_gpu_layers, "predicted_tps": o.tps,
                  "speedup": o.speedup, "costs": o.curve.source if o.curve else None} for o in options],
                best_draft.speedup if best_draft else 0.0,
                best_draft.curve.source if best_draft else "estimated",
                replayed.source if trace is not None else f"assumed {acceptance:.2f} per token (no trace of this pair)")
    plan.draft_if_used = best.draft or _draft_sparing_the_target(best, with_draft)
    plan.draft_curve = best_draft.curve if best_draft else None  # for the report (not a field: not in to_dict)
    if draft is not None and gpu is not None:
        plan.reason += _draft_too_big(draft, best.n_ctx, budget)
    if _host_bytes(best) > ram.free:
        plan.reason += (f"; {'the pair' if best.draft else 'the target'} needs {_host_bytes(best) / MiB:.0f} MiB "
                        f"of host memory but only "
                        f"{max(ram.free, 0) / MiB:.0f} MiB is available: it will swap or fail to load "
                        f"(a smaller quantization, a smaller -c, or more layers on a GPU)")
    return plan


def around_given(target: ModelShape, draft: ModelShape, n_ctx: int, gpu: DeviceMemory | None,
                 ngl: int | None, ngld: int | None, with_draft: bool) -> tuple[int, int]:
    """-ngl or -ngld as the user gave it, the other fitted to the GPU memory it leaves (the plan's own
    choice for the other assumed its own value for the given one, and could overfill the GPU).
    The draft goes whole on the GPU or stays on the CPU, as in the plan; `with_draft`: the plan uses it."""
    budget = gpu_budget(gpu)
    every = lambda value, shape: shape.n_layer + 1 if value < 0 else value  # -1: all of them, as llama.cpp
    if ngl is not None:
        left = budget - placement(target, every(ngl, target), n_ctx).gpu_bytes
        whole = placement(draft, draft.n_layer + 1, n_ctx)
        return ngl, draft.n_layer + 1 if with_draft and whole.gpu_bytes <= left else 0
    left = budget - placement(draft, every(ngld, draft), n_ctx).gpu_bytes
    return max_layers(target, n_ctx, left) if left > 0 else 0, ngld


def _host_bytes(option: _Option) -> int:
    return option.target.cpu_bytes + (option.draft.cpu_bytes if option.draft is not None else 0)


def _draft_sparing_the_target(best: _Option, with_draft: list[_Option]) -> Placement | None:
    """The fastest draft placement at the plan's context that takes no GPU layer from its target."""
    spare = [o for o in with_draft if o.n_ctx == best.n_ctx and o.target.n_gpu_layers >= best.target.n_gpu_layers]
    return max(spare, key=lambda o: o.tps).draft if spare else None


def _reason(best: _Option, target: ModelShape, draft: ModelShape | None, gpu, budget: int, asked_ctx: int) -> str:
    if gpu is None or budget <= 0:
        return f"no usable GPU: everything on the CPU ({best.name})"
    t, d = best.target, best.draft
    parts = [best.name, f"{min(t.n_gpu_layers, target.n_layer)}/{target.n_layer} target layers on {gpu.name}"
             + (" with the output layer" if t.n_gpu_layers > target.n_layer else "")]
    if d is not None and draft is not None:
        where = "whole on the GPU" if d.n_gpu_layers > draft.n_layer else f"{d.n_gpu_layers} layers on the GPU"
        parts.append(f"draft {where}")
    if best.n_ctx != asked_ctx:
        parts.append(f"context shrunk from {asked_ctx} to {best.n_ctx} to fit")
    return ", ".join(parts)


def _draft_too_big(draft: ModelShape, n_ctx: int, budget: int) -> str:
    """What to do when the whole draft does not fit on the GPU ("" when it does)."""
    needed = placement(draft, draft.n_layer + 1, n_ctx).gpu_bytes
    if needed <= budget:
        return ""
    return (f"; the draft needs {needed / GiB:.1f} GiB on the GPU but only {max(budget, 0) / GiB:.1f} GiB is "
            f"usable: use a smaller -c, keep the draft on the CPU (-ngld 0), or run without a draft (--no-draft)")


def plan_table(plan: Plan, target: ModelShape, draft: ModelShape | None) -> str:
    """Each model's bytes by place, then the devices' budgets and the build's backends."""
    rows = [("model", "-ngl", "weights GPU", "KV GPU", "compute GPU", "GPU total", "host total")]
    for shape, p in ((target, plan.target), (draft, plan.draft)):
        if shape is None or p is None:
            continue
        rows.append((shape.name, str(p.n_gpu_layers), *(f"{v / MiB:.0f} MiB" for v in
                     (p.weights_gpu, p.kv_gpu, p.compute_gpu, p.gpu_bytes, p.cpu_bytes))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    gpu = plan.gpu
    if gpu is not None:
        used = plan.target.gpu_bytes + (plan.draft.gpu_bytes if plan.draft else 0)
        lines.append(f"\n{gpu.name}: {gpu.free / MiB:.0f} MiB free, budget {plan.budget / MiB:.0f} MiB "
                     f"(margin {MARGIN:.0%} + {GPU_OVERHEAD / MiB:.0f} MiB overhead), planned {used / MiB:.0f} MiB")
    lines.append(f"{plan.ram.name}: {plan.ram.free / MiB:.0f} MiB available")
    lines.append(f"llama-cpp-python build: {', '.join(build_backends()) or 'unknown'}")
    return "\n".join(lines)
