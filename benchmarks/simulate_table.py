"""Tables from the simulator (ggufspec.simulate) for docs/benchmarks.md.

    # predicted against measured: a bench run's own costs, replayed with one or more traces
    python benchmarks/simulate_table.py check benchmarks/results/traces-held-out.json \
        ggufspec/data/trace-demo-chat.jsonl /tmp/held-out-trace.jsonl

    # predicted speedup against the draft's cost and the acceptance of the shipped traces, on a
    # memory-bound device (T(n) = T(1) up to n = 8) and on the CPU a bench run measured
    python benchmarks/simulate_table.py grid benchmarks/results/traces-held-out.json
"""
from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="predicted against measured for a bench --json result")
    c.add_argument("bench")
    c.add_argument("traces", nargs="+")
    g = sub.add_parser("grid", help="predicted speedup against draft cost and acceptance")
    g.add_argument("bench", help="a bench --json result: this CPU's measured T(n)")
    g.add_argument("traces", nargs="*")
    args = parser.parse_args()
    check(args) if args.command == "check" else grid(args)


if __name__ == "__main__":
    main()
