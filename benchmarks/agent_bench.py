"""An agent at work: scripted multi-turn coding sessions (benchmarks/agent/sessions.json) replayed against
`ggufspec serve` and llama-server, each variant a fresh server process on a free loopback port.

A session is what a coding agent sends: a system prompt, a `read_file` tool, the user's request, the
agent's tool call and the file it read (the tool's result), then the model's answer, which writes the
whole file back with a small edit; later turns ask for more edits ("reply with the whole file") and a
question or two. Every answer the server gives is appended to the conversation as the agent would,
so the next request repeats it (the server's prompt cache keeps it). Greedy (temperature 0).

Variants (--variants, comma-separated):
  gs-target   ggufspec serve --no-draft --draft 0      the target alone
  gs-auto     ggufspec serve -md DRAFT                 --draft auto (serve's default): n-gram copies and the draft
  gs-lookup   ggufspec serve --lookup --no-draft       --draft auto over n-gram lookup alone
  ls-target   llama-server                             the target alone
  ls-ngram-simple / ls-ngram-mod   llama-server --spec-type ngram-simple / ngram-mod

A variant may end in `+fa-on` or `+fa-off` (e.g. `ls-ngram-mod+fa-off`): that server with `-fa on/off`.
ggufspec's own default on a CPU is off (`load.resolved_flash_attn`), llama-server's on.

Each round starts every variant afresh (order reversed every other round: a machine shared with other
jobs drifts) and runs every session; ratios are taken within a round, against the same server's
target alone, then the median over rounds. ggufspec servers get a new, empty GGUFSPEC_HOME each (the
first user on a new machine: nothing remembered, the step costs timed at startup, which is reported
as the startup time and not counted in the sessions).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_bench.py [--rounds 3] [--threads 2] [--protocol messages] [--json OUT]

The client is one function per protocol (--protocol): `chat`, /v1/chat/completions (the default), or
`messages`, Anthropic's /v1/messages (what Claude Code speaks), the same conversation translated to its
shape. llama-server's /v1/messages answers carry no `timings`: its decode tok/s is then output_tokens
over the wall time (prompt included) and its drafts are not counted; the table marks such numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import LLAMA_SERVER, ROOT, Server, cpu_name, demo_pair, free_port, loadavg  # noqa: E402

SESSIONS = Path(__file__).resolve().parent / "agent" / "sessions.json"
VARIANTS = ("gs-target", "gs-auto", "gs-lookup", "ls-target", "ls-ngram-simple", "ls-ngram-mod")
BASELINE = {"gs": "gs-target", "ls": "ls-target"}  # each server against its own target alone
LOG_DIR = Path(tempfile.gettempdir()) / "agent_bench_logs"


# ---------------------------------------------------------------- the client

def post_timed(url: str, body: dict) -> tuple[dict, float]:
    """POST `body` to `url`: the answer's JSON and the wall time it took (an HTTP error raises)."""
    sent = time.perf_counter()
    response = httpx.post(url, json=body, timeout=900)
    wall = time.perf_counter() - sent
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.json(), wall


def chat(url: str, messages: list[dict], tools: list[dict], max_tokens: int) -> dict:
    """One chat completion through /v1/chat/completions: the answer's text, its wall time, tokens and the
    server's `timings` (both servers send llama.cpp's: predicted_n/_ms, draft_n, draft_n_accepted)."""
    body = {"messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0, "stream": False,
            "cache_prompt": True}
    data, wall = post_timed(url + "/v1/chat/completions", body)
    message = data["choices"][0]["message"]
    timings = data.get("timings") or {}
    return {"text": message.get("content") or "", "wall_s": wall,
            "n_tokens": (data.get("usage") or {}).get("completion_tokens") or timings.get("predicted_n", 0),
            "decode_s": timings.get("predicted_ms", 0.0) / 1000, "prompt_s": timings.get("prompt_ms", 0.0) / 1000,
            "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}


def anthropic_messages(url: str, messages: list[dict], tools: list[dict], max_tokens: int) -> dict:
    """The same request through Anthropic's /v1/messages: the system message as `system`, tool calls as
    `tool_use` blocks, tool messages as a user message of `tool_result` blocks. ggufspec's answer carries
    `timings`; llama-server's does not: then the wall time and usage.output_tokens (`timed` False)."""
    turns: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if turns and turns[-1]["role"] == "user" and isinstance(turns[-1]["content"], list):
                turns[-1]["content"].append(result)
            else:
                turns.append({"role": "user", "content": [result]})
        elif m.get("tool_calls"):
            uses = [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]
            text = [{"type": "text", "text": m["content"]}] if m["content"] else []
            turns.append({"role": "assistant", "content": text + uses})
        else:
            turns.append({"role": m["role"], "content": m["content"]})
    body = {"system": messages[0]["content"], "messages": turns, "max_tokens": max_tokens, "temperature": 0,
            "stream": False, "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                                        "input_schema": t["function"]["parameters"]} for t in tools]}
    data, wall = post_timed(url + "/v1/messages", body)
    timings = data.get("timings") or {}
    n_tokens = (data.get("usage") or {}).get("output_tokens") or timings.get("predicted_n", 0)
    return {"text": "".join(b["text"] for b in data["content"] if b["type"] == "text"), "wall_s": wall,
            "n_tokens": n_tokens, "decode_s": timings.get("predicted_ms", wall * 1000) / 1000,
            "prompt_s": timings.get("prompt_ms", 0.0) / 1000, "drafted": timings.get("draft_n", 0),
            "accepted": timings.get("draft_n_accepted", 0), "timed": bool(timings)}


CLIENTS = {"chat": chat, "messages": anthropic_messages}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


# ---------------------------------------------------------------- a session

def opening(script: dict, session: dict) -> list[dict]:
    """The system prompt, the first request, the agent's read_file call and the file it read."""
    first = session["turns"][0]
    content = (Path(SESSIONS).parent / session["file"]).read_text()
    call = {"id": "call_0", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": session["file"]})}}
    return [{"role": "system", "content": script["system"]}, {"role": "user", "content": first["user"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": content}]


def run_session(url: str, script: dict, session: dict, client=chat) -> dict:
    messages = opening(script, session)
    answers = []
    for number, turn in enumerate(session["turns"]):
        if number > 0:
            messages.append({"role": "user", "content": turn["user"]})
        answer = client(url, messages, script["tools"], turn["max_tokens"])
        messages.append({"role": "assistant", "content": answer["text"]})
        answers.append(answer)
    total = {key: sum(a[key] for a in answers) for key in ("wall_s", "n_tokens", "decode_s", "drafted", "accepted")}
    return {"session": session["id"], **total, "decode_tps": total["n_tokens"] / total["decode_s"] if total["decode_s"] else None,
            "timed": all(a.get("timed", True) for a in answers), "turns": answers}


# ---------------------------------------------------------------- the servers

def command(variant: str, target: Path, draft: Path, threads: int, n_ctx: int, port: int) -> list[str]:
    variant, _, attention = variant.partition("+fa-")
    return server_command(variant, target, draft, threads, n_ctx, port) + (["-fa", attention] if attention else [])


def server_command(variant: str, target: Path, draft: Path, threads: int, n_ctx: int, port: int) -> list[str]:
    if variant.startswith("gs-"):
        ggufspec = Path(sys.executable).parent / "ggufspec"
        base = [str(ggufspec) if ggufspec.exists() else sys.executable, *([] if ggufspec.exists() else ["-m", "ggufspec.cli"]),
                "serve", "-m", str(target), "-t", str(threads), "-c", str(n_ctx), "--host", "127.0.0.1", "--port", str(port)]
        extra = {"gs-target": ["--no-draft", "--draft", "0"], "gs-auto": ["-md", str(draft)],
                 "gs-lookup": ["--lookup", "--no-draft"]}[variant]
        return base + extra
    base = [str(LLAMA_SERVER), "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1",
            "--jinja", "--host", "127.0.0.1", "--port", str(port)]
    extra = {"ls-target": [], "ls-ngram-simple": ["--spec-type", "ngram-simple"],
             "ls-ngram-mod": ["--spec-type", "ngram-mod"]}[variant]
    return base + extra


def run_variant(variant: str, args, target: Path, draft: Path, script: dict, round_index: int) -> dict:
    port = free_port()
    cmd = command(variant, target, draft, args.threads, args.ctx, port)
    record = {"variant": variant, "round": round_index, "protocol": args.protocol, "loadavg_before": loadavg()}
    home = tempfile.mkdtemp(prefix="agent-bench-home-")
    env = {**os.environ, "GGUFSPEC_HOME": home, "PYTHONPATH": str(ROOT)}
    print(f"[round {round_index}] {variant}: {' '.join(cmd)}", file=sys.stderr)
    try:
        with Server(variant, cmd, port, LOG_DIR / f"{variant}.{round_index}.log", env, ready_timeout=600) as server:
            record["startup_s"] = server.startup_seconds
            record["sessions"] = [run_session(server.url, script, s, CLIENTS[args.protocol]) for s in script["sessions"]]
    except Exception as exc:  # one variant failing must not lose the others' numbers
        record["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{variant}] FAILED: {record['error']}", file=sys.stderr)
    for s in record.get("sessions", []):
        print(f"  {s['session']}: {s['wall_s']:.1f} s, {s['n_tokens']} tokens, "
              f"{s['decode_tps'] or 0:.1f} tok/s, drafts {s['accepted']}/{s['drafted']}; turns "
              + ", ".join(f"{t['wall_s']:.1f}s/{t['n_tokens']}" for t in s["turns"]), file=sys.stderr)
    record["loadavg_after"] = loadavg()
    return record


# ---------------------------------------------------------------- the table

def ratios(records: list[dict], session: str) -> dict:
    """variant -> per-round speedups of `session`'s wall time against the same server's target alone."""
    wall = {(r["variant"], r["round"]): next((s["wall_s"] for s in r.get("sessions", []) if s["session"] == session), None)
            for r in records}
    out: dict[str, list[float]] = {}
    for (variant, round_index), seconds in wall.items():
        base = wall.get((BASELINE[variant[:2]], round_index))
        if seconds and base:
            out.setdefault(variant, []).append(base / seconds)
    return out


def markdown(records: list[dict], variants: list[str], sessions: list[str]) -> str:
    lines = ["| session | variant | wall s (median) | speedup vs own target (rounds) | decode tok/s | drafts kept | tokens |",
             "|---|---|---|---|---|---|---|"]
    for session in sessions:
        speedups = ratios(records, session)
        for variant in variants:
            runs = [s for r in records if r["variant"] == variant for s in r.get("sessions", []) if s["session"] == session]
            if not runs:
                continue
            walls = [s["wall_s"] for s in runs]
            tps = statistics.median(s["decode_tps"] for s in runs if s["decode_tps"])
            drafted, accepted = sum(s["drafted"] for s in runs), sum(s["accepted"] for s in runs)
            ups = speedups.get(variant, [])
            shown = (f"{statistics.median(ups):.2f}x ({', '.join(f'{u:.2f}' for u in ups)})" if ups else "–")
            timed = all(s.get("timed", True) for s in runs)
            kept = f"{accepted}/{drafted}" if drafted else "–" if timed else "n/a*"
            lines.append(f"| {session} | {variant} | {statistics.median(walls):.1f} | {shown} | "
                         f"{tps:.1f}{'' if timed else '*'} | {kept} | "
                         f"{'/'.join(str(s['n_tokens']) for s in runs)} |")
    if any(not s.get("timed", True) for r in records for s in r.get("sessions", [])):
        lines.append("\n\\* the answers carried no `timings`: tok/s is usage.output_tokens over the wall time "
                     "(prompt included), drafts not reported")
    return "\n".join(lines)


def versus_best_llama(records: list[dict], sessions: list[str]) -> str:
    """gs-auto's whole-run wall time against llama-server's best n-gram drafter, round by round."""
    lines = []
    names = list(dict.fromkeys(r["variant"] for r in records))
    for variant in [v for v in names if v.startswith(("gs-auto", "gs-lookup"))]:
        per_round = []
        for round_index in sorted({r["round"] for r in records}):
            def total(name):
                rec = next((r for r in records if r["variant"] == name and r["round"] == round_index), None)
                return sum(s["wall_s"] for s in rec["sessions"]) if rec and rec.get("sessions") else None
            mine = total(variant)
            theirs = [t for t in map(total, [v for v in names if v.startswith("ls-ngram")]) if t]
            target = total("gs-target")
            if mine and theirs:
                per_round.append((min(theirs) / mine, target / mine if target else None))
        if per_round:
            lines.append(f"{variant}: all sessions {statistics.median(p[0] for p in per_round):.2f}x faster than "
                         f"llama-server's best n-gram drafter (rounds: {', '.join(f'{p[0]:.2f}' for p in per_round)})"
                         + (f"; {statistics.median(p[1] for p in per_round if p[1]):.2f}x the target alone"
                            if any(p[1] for p in per_round) else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--sessions", default=None, help="Comma-separated session ids (default: all).")
    parser.add_argument("--protocol", choices=sorted(CLIENTS), default="chat",
                        help="chat: /v1/chat/completions (default); messages: Anthropic's /v1/messages.")
    parser.add_argument("--json", default=None, help="Write every record here.")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = {v for v in variants if v.partition("+")[0] not in VARIANTS or v.partition("+")[2] not in ("", "fa-on", "fa-off")}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if any(v.startswith("ls-") for v in variants) and not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: build it with scripts/build-llamacpp.sh")
    script = json.loads(SESSIONS.read_text())
    if args.sessions:
        script["sessions"] = [s for s in script["sessions"] if s["id"] in args.sessions.split(",")]
    target, draft = demo_pair()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    records = []
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        records += [run_variant(v, args, target, draft, script, round_index) for v in order]
    session_ids = [s["id"] for s in script["sessions"]]
    print(f"\nCPU: {cpu_name()}, {args.threads} threads; target {target.name}, draft {draft.name}; "
          f"protocol {args.protocol} ({PATHS[args.protocol]})\n")
    print(markdown(records, variants, session_ids))
    print("\n" + versus_best_llama(records, session_ids))
    print("\nstartup s: " + ", ".join(f"{r['variant']} {r['startup_s']:.1f}" for r in records if "startup_s" in r))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "protocol": args.protocol,
                                               "records": records}, indent=1))


if __name__ == "__main__":
    main()
