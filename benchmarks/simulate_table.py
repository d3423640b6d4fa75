"""Tables from the simulator (ggufspec.simulate) for docs/benchmarks.md.

    # predicted against measured: a bench run's own costs, replayed with one or more traces
    python benchmarks/simulate_table.py check benchmarks/results/traces-held-out.json \
        ggufspec/data/trace-demo-chat.jsonl /tmp/held-out-trace.jsonl

    # predicted speedup against the draft's cost and the acceptance of the shipped traces, on a
    # memory-bound device (T(n) = T(1) up to n = 8) and on the CPU a bench run measured
    python benchmarks/simulate_table.py grid benchmarks/results/traces-held-out.json

    # the costs the runs themselves paid (benchmarks/bench_steps.py keeps every step) against the
    # costs sampled between them, and the prediction under each
    python benchmarks/simulate_table.py steps benchmarks/results/traces-held-out.json \
        benchmarks/results/traces-held-out-steps.json ggufspec/data/trace-demo-chat.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ggufspec import bench as B  # noqa: E402
from ggufspec import simulate as S  # noqa: E402

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.67, 0.7)


def bench_result(data: dict) -> B.BenchResult:
    return B.BenchResult([B.Run(**r) for r in data["runs"]], data["configs"], data["summary"], data["overall"])


def bench_curve(path: str) -> tuple[S.CostCurve, dict]:
    """The costs a bench measured (and what auto knew before its runs, where it kept that)."""
    data = json.loads(Path(path).read_text())
    knew = data["cost_model"].get("auto_knew")
    remembered = S.Costs.from_dict(knew) if knew else None
    return B.cost_curve(data["cost_model"]["costs"], bench_result(data), remembered), data


def check(args) -> None:
    curve, data = bench_curve(args.bench)
    configs = [c for c in B.parse_configs(",".join(c[2:] if c.startswith("K=") else c for c in data["configs"][1:]))
               if c.name in data["configs"]]
    traces = [S.read_trace(t) for t in args.traces]
    head = "| config | measured | " + " | ".join(f"predicted ({Path(t.source).name})" for t in traces) + " |"
    print(head + "\n|---|---:|" + "---:|" * len(traces))
    for config in configs:
        policy = B._policy(config)
        if policy is None or not (policy.k or policy.auto):
            continue
        measured = data["overall"][config.name]["median_speedup"]
        cells = []
        for trace in traces:
            own = [p.prompt for p in trace.prompts if p.prompt in {s["prompt"] for s in data["summary"]}]
            repeats = B.repeats_of(bench_result(data)) if own else 1
            predicted = S.predict(trace, curve, policy, own or None, repeats).speedup
            cells.append(f"{predicted:.2f}x ({100 * (predicted / measured - 1):+.0f}%)")
        print(f"| {config.name} | {measured:.2f}x | " + " | ".join(cells) + " |")
    t1 = curve.target(1)
    print(f"\ncosts: T(1) {1e3 * t1:.1f} ms, T(n)/T(1) " + ", ".join(f"{n}: {curve.target(n) / t1:.2f}" for n in
          S.MEASURED_SIZES) + f"; draft {curve.t_draft / t1:.2f} T(1); step {1e3 * curve.step_seconds:.2f} ms")


def grid(args) -> None:
    cpu, _ = bench_curve(args.bench)
    flat = S.curve_from_times({n: 1.0 if n <= 8 else n / 8 for n in S.MEASURED_SIZES}, 0.1)
    traces = [S.read_trace(t) for t in args.traces or sorted(str(p) for p in S.trace_files()
                                                          if p.name.startswith("trace-demo-"))]
    for device, curve in (("memory-bound (T(n) = T(1) up to n = 8)", flat), ("this CPU (measured T(n))", cpu)):
        print(f"\n{device}: best fixed K (speedup) / auto\n")
        print("| draft cost / T(1) | " + " | ".join(f"{Path(t.source).stem.removeprefix('trace-demo-')} "
                                                     f"({t.acceptance:.0%} a token)" for t in traces) + " |")
        print("|---:|" + "---|" * len(traces))
        for ratio in RATIOS:
            scaled = S.scaled_curve(curve, ratio)
            cells = []
            for trace in traces:
                best = S.best_fixed_k(trace, scaled)
                auto = S.predict(trace, scaled, S.Policy(auto=True))
                cells.append(f"{best.policy} {best.speedup:.2f}x / auto {auto.speedup:.2f}x")
            print(f"| {ratio:.2f} | " + " | ".join(cells) + " |")


def run_costs(data: dict, generations: list[dict]) -> tuple[dict, dict, float]:
    """From the fixed-K and target-alone runs' own steps: T(n) (median verify time by batch size),
    the draft's time per step by K, and the median gap between steps (outside draft and verify)."""
    runs = [r for r in data["runs"] if not r["config"].startswith("llama.cpp")]
    assert len(runs) == len(generations), "the steps file is not this bench's"
    verify, draft, gaps = defaultdict(list), defaultdict(list), []
    for run, generation in zip(runs, generations):
        if run["config"] == "auto":
            continue
        for number, (k, _, draft_s, verify_s, gap) in enumerate(generation["steps"]):
            verify[k + 1].append(verify_s)
            if k:
                draft[k].append(draft_s)
            if number:
                gaps.append(gap)
    median = lambda xs: statistics.median(xs)  # noqa: E731
    return ({n: median(v) for n, v in verify.items()}, {k: median(v) for k, v in draft.items()}, median(gaps))


def steps(args) -> None:
    sampled, data = bench_curve(args.bench)
    t_run, draft_run, gap = run_costs(data, json.loads(Path(args.steps).read_text()))
    t1, r1 = sampled.target(1), t_run[1]
    print("| n | T(n)/T(1) in the runs | sampled between them | draft per step in the runs / T(1) |\n|---:|---:|---:|---:|")
    for n in sorted(t_run):
        per_step = f"{draft_run[n - 1] / r1:.2f}" if n - 1 in draft_run else ""
        print(f"| {n} | {t_run[n] / r1:.2f} | {sampled.target(n) / t1:.2f} | {per_step} |")
    print(f"\nT(1): runs {1e3 * r1:.1f} ms, sampled {1e3 * t1:.1f} ms; a draft token sampled {sampled.t_draft / t1:.2f} "
          f"T(1); gap between steps in the runs {1e3 * gap:.2f} ms, step cost charged {1e3 * sampled.step_seconds:.2f} ms")
    larger = {n: sampled.target(n) * r1 / t1 for n in range(1, 18) if n not in t_run}  # beyond what the runs used
    token = statistics.median(draft_run[k] / k for k in draft_run)  # a draft token, as the runs paid it
    own = S.curve_from_times({**larger, **t_run}, token, step_seconds=gap, draft_batches={
        n: sampled.draft_batch(n) * token / sampled.t_draft for n in B.DRAFT_SIZES})
    args.traces and print("\nprediction under the runs' own costs:")
    for trace in [S.read_trace(t) for t in args.traces]:
        names = [p.prompt for p in trace.prompts if p.prompt in {s["prompt"] for s in data["summary"]}]
        for config in data["configs"][1:]:
            policy = S.Policy(auto=True) if config == "auto" else S.Policy(int(config[2:]))
            measured = data["overall"][config]["median_speedup"]
            predicted = S.predict(trace, own, policy, names or None).speedup
            print(f"  {Path(trace.source).name} {config}: {predicted:.2f}x ({100 * (predicted / measured - 1):+.0f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="predicted against measured for a bench --json result")
    c.add_argument("bench")
    c.add_argument("traces", nargs="+")
    g = sub.add_parser("grid", help="predicted speedup against draft cost and acceptance")
    g.add_argument("bench", help="a bench --json result: this CPU's measured T(n)")
    g.add_argument("traces", nargs="*")
    st = sub.add_parser("steps", help="the runs' own step costs against the sampled ones")
    st.add_argument("bench")
    st.add_argument("steps", help="benchmarks/bench_steps.py's file for that bench")
    st.add_argument("traces", nargs="*")
    args = parser.parse_args()
    {"check": check, "grid": grid, "steps": steps}[args.command](args)


if __name__ == "__main__":
    main()
