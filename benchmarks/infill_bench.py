"""Code completion at an editor's cursor: `/infill` on ggufspec and on llama-server, side by side.

An editor plugin (llama.vim, llama.vscode) sends the lines before the cursor and after it, and asks
for the middle. Here the files are Python modules of the standard library (the same on every
machine); each case puts the cursor at the start of a function's third body line, with the rest of
that function's body (up to 8 lines) removed: the middle to write. As llama.vim does, the request
carries the 32 lines before the cursor and the 8 after the removed lines, `n_predict` 96, greedy, with
`cache_prompt`. The cases of one file come one after another, as edits in one file do.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/infill_bench.py [--cases 12] [--rounds 2] [--json OUT]

Variants, each its own server (one slot), the order reversed every other round:
  gs-target   ggufspec serve --no-draft --draft 0    the target alone
  gs-auto     ggufspec serve -md DRAFT               --draft auto (serve's default)
  ls-target   llama-server                           the target alone
  ls-draft    llama-server -md DRAFT                 its speculative decoding (--draft-max 16, its default)
Reported per variant: the cases' wall time, decode tok/s (timings: predicted_n over predicted_ms),
drafts kept, and how many middles begin with the removed line (the same at greedy, up to batch rounding).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import LLAMA_SERVER, ROOT, Server, cpu_name, demo_pair, free_port, loadavg  # noqa: E402

MODULES = ("textwrap.py", "csv.py", "difflib.py", "shlex.py", "fnmatch.py", "glob.py")
VARIANTS = ("gs-target", "gs-auto", "ls-target", "ls-draft")
PREFIX_LINES, SUFFIX_LINES, MIDDLE_LINES, N_PREDICT = 32, 8, 8, 96
LOG_DIR = Path(tempfile.gettempdir()) / "infill_bench_logs"


def cases(n: int) -> list[dict]:
    """`n` cursors, spread over the modules: in functions with at least 3 lines of code after the
    docstring, the cursor at the code's second line, the rest of the function (up to 8 lines) the middle."""
    found = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in MODULES:
        lines = (stdlib / name).read_text().splitlines(keepends=True)
        for node in ast.walk(ast.parse("".join(lines))):
            if not isinstance(node, ast.FunctionDef):
                continue
            body = node.body[1:] if ast.get_docstring(node) else node.body
            if not body or node.end_lineno - body[0].lineno < 3:
                continue
            cursor = body[0].lineno  # 0-based index of the code's second line
            end = min(node.end_lineno, cursor + MIDDLE_LINES)
            found.append({"file": name, "line": cursor + 1,
                          "input_prefix": "".join(lines[max(0, cursor - PREFIX_LINES):cursor]),
                          "middle": "".join(lines[cursor:end]),
                          "input_suffix": "".join(lines[end:end + SUFFIX_LINES])})
    per_file = max(1, -(-n // len(MODULES)))
    chosen = []
    for name in dict.fromkeys(c["file"] for c in found):
        chosen += [c for c in found if c["file"] == name][:per_file]
    return sorted(chosen[:n], key=lambda c: (MODULES.index(c["file"]), c["line"]))


def command(variant: str, target: Path, draft: Path, threads: int, port: int) -> list[str]:
    if variant.startswith("gs-"):
        ggufspec = Path(sys.executable).parent / "ggufspec"
        base = [str(ggufspec), "serve", "-m", str(target), "-t", str(threads), "-c", "4096", "--parallel", "1",
                "--host", "127.0.0.1", "--port", str(port)]
        return base + {"gs-target": ["--no-draft", "--draft", "0"], "gs-auto": ["-md", str(draft)]}[variant]
    base = [str(LLAMA_SERVER), "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1",
            "--host", "127.0.0.1", "--port", str(port)]
    return base + {"ls-target": [], "ls-draft": ["-md", str(draft), "-td", str(threads)]}[variant]


def run_variant(variant: str, chosen: list[dict], args, target: Path, draft: Path, round_index: int) -> dict:
    port = free_port()
    env = {**os.environ, "GGUFSPEC_HOME": tempfile.mkdtemp(prefix="infill-bench-home-"), "PYTHONPATH": str(ROOT)}
    record = {"variant": variant, "round": round_index, "loadavg_before": loadavg(), "cases": []}
    cmd = command(variant, target, draft, args.threads, port)
    print(f"[round {round_index}] {variant}: {' '.join(cmd)}", file=sys.stderr)
    with Server(variant, cmd, port, LOG_DIR / f"{variant}.{round_index}.log", env, ready_timeout=600) as server:
        record["startup_s"] = server.startup_seconds
        for case in chosen:
            body = {k: case[k] for k in ("input_prefix", "input_suffix")}
            body.update(input_extra=[], n_predict=N_PREDICT, temperature=0, cache_prompt=True)
            started = time.perf_counter()
            answer = httpx.post(server.url + "/infill", json=body, timeout=600).json()
            t = answer["timings"]
            record["cases"].append({
                "file": case["file"], "line": case["line"], "wall_s": time.perf_counter() - started,
                "predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"], "prompt_n": t["prompt_n"],
                "prompt_ms": t["prompt_ms"], "draft_n": t.get("draft_n") or 0,
                "draft_n_accepted": t.get("draft_n_accepted") or 0, "content": answer["content"],
                "first_line_right": answer["content"].split("\n")[0].strip() == case["middle"].split("\n")[0].strip()})
    record["loadavg_after"] = loadavg()
    c = record["cases"]
    print(f"  {sum(x['wall_s'] for x in c):.1f} s, {decode_tps(c):.1f} tok/s, drafts "
          f"{sum(x['draft_n_accepted'] for x in c)}/{sum(x['draft_n'] for x in c)}", file=sys.stderr)
    return record


def strict_check(chosen: list[dict], args, target: Path, draft: Path) -> None:
    """Lossless without batch rounding: one `serve --strict` (a token per batch), each cursor asked with
    `"draft": "auto"` and then `"draft": 0`; the tokens must be the same."""
    port = free_port()
    env = {**os.environ, "GGUFSPEC_HOME": tempfile.mkdtemp(prefix="infill-bench-home-"), "PYTHONPATH": str(ROOT)}
    cmd = command("gs-auto", target, draft, args.threads, port) + ["--strict"]
    same = drafted = 0
    with Server("gs-strict", cmd, port, LOG_DIR / "gs-strict.log", env, ready_timeout=600) as server:
        for case in chosen:
            body = {"input_prefix": case["input_prefix"], "input_suffix": case["input_suffix"], "n_predict": N_PREDICT,
                    "temperature": 0, "return_tokens": True}
            auto = httpx.post(server.url + "/infill", json={**body, "draft": "auto"}, timeout=600).json()
            alone = httpx.post(server.url + "/infill", json={**body, "draft": 0}, timeout=600).json()
            same += auto["tokens"] == alone["tokens"]
            drafted += auto["timings"]["draft_n"]
    print(f"--strict: auto's tokens are the target alone's for {same} of {len(chosen)} cursors "
          f"({drafted} tokens drafted)")


def decode_tps(c: list[dict]) -> float:
    return sum(x["predicted_n"] for x in c) / max(sum(x["predicted_ms"] for x in c) / 1000, 1e-9)


def table(records: list[dict], variants: list[str]) -> str:
    lines = ["| variant | wall s (rounds) | decode tok/s (rounds) | vs its server's target alone (decode) | "
             "drafts kept | first line right |", "|---|---|---|---|---|---|"]
    for variant in variants:
        mine = [r for r in records if r["variant"] == variant]
        base = [r for r in records if r["variant"] == variant[:3] + "target"]
        speed = [decode_tps(r["cases"]) for r in mine]
        ratio = statistics.median(decode_tps(r["cases"]) / decode_tps(b["cases"])
                                  for r in mine for b in base if b["round"] == r["round"]) if base else 0
        kept = sum(x["draft_n_accepted"] for r in mine for x in r["cases"])
        drafted = sum(x["draft_n"] for r in mine for x in r["cases"])
        right = sum(x["first_line_right"] for x in mine[0]["cases"]) if mine else 0
        lines.append(f"| {variant} | " + ", ".join(f"{sum(x['wall_s'] for x in r['cases']):.1f}" for r in mine)
                     + " | " + ", ".join(f"{s:.1f}" for s in speed) + f" | {ratio:.2f}x | {kept}/{drafted} | "
                     f"{right}/{len(mine[0]['cases']) if mine else 0} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--strict-check", action="store_true",
                        help="Only check that auto's tokens are the target alone's under serve --strict.")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    if any(v.startswith("ls-") for v in variants) and not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: build it with scripts/build-llamacpp.sh")
    chosen = cases(args.cases)
    target, draft = demo_pair()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    if args.strict_check:
        return strict_check(chosen, args, target, draft)
    records = []
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        records += [run_variant(v, chosen, args, target, draft, round_index) for v in order]
    print(f"\nCPU: {cpu_name()}, {args.threads} threads; target {target.name}, draft {draft.name}; "
          f"{len(chosen)} cursors in {len({c['file'] for c in chosen})} files\n")
    print(table(records, variants))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "records": records},
                                              indent=1))


if __name__ == "__main__":
    main()
