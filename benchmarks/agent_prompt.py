"""The agent session's first prompt alone: how long each server takes to evaluate it (issue 29: does
ggufspec lose the first answer in its prompt?).

Each variant (agent_bench's names) is a fresh server on a loopback port; it gets the first request of
the session (system prompt, tool, request, the tool call and the file it read) through
/v1/chat/completions with max_tokens 1 and `cache_prompt: false`, twice: both servers evaluate the
whole prompt each time (a ggufspec from before that field reuses its cache the second time).
Rounds alternate the order. ggufspec servers share one GGUFSPEC_HOME, so only the first times its
step costs.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_prompt.py [--rounds 2] [--threads 2] \
        [--variants gs-auto,ls-ngram-mod,gs-target]

One line per request on stdout: round, variant, repeat, wall time and the server's prompt `timings`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_bench import LOG_DIR, SESSIONS, command, opening  # noqa: E402
from server_bench import ROOT, Server, cpu_name, demo_pair, free_port  # noqa: E402


def first_prompt(url: str, script: dict, session: dict) -> tuple[float, dict]:
    body = {"messages": opening(script, session), "tools": script["tools"], "max_tokens": 1, "temperature": 0,
            "cache_prompt": False}
    sent = time.perf_counter()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    response.raise_for_status()
    return time.perf_counter() - sent, response.json().get("timings") or {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="gs-auto,ls-ngram-mod,gs-target")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args()
    target, draft = demo_pair()
    script = json.loads(SESSIONS.read_text())
    session = script["sessions"][0]
    home = tempfile.mkdtemp(prefix="agent-prompt-home-")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_name()}, {args.threads} threads; session {session['id']}")
    variants = args.variants.split(",")
    for round_index in range(args.rounds):
        for variant in variants if round_index % 2 == 0 else variants[::-1]:
            port = free_port()
            env = {**os.environ, "GGUFSPEC_HOME": home, "PYTHONPATH": str(ROOT)}
            cmd = command(variant, target, draft, args.threads, args.ctx, port)
            log_path = LOG_DIR / f"prompt-{variant}.{round_index}.log"
            with Server(variant, cmd, port, log_path, env, ready_timeout=600) as server:
                for repeat in range(2):
                    wall, timings = first_prompt(server.url, script, session)
                    print(f"{round_index} {variant} {repeat}: wall {wall:.2f} s, prompt_n {timings.get('prompt_n')}, "
                          f"cache_n {timings.get('cache_n')}, prompt_ms {timings.get('prompt_ms', 0):.0f}", flush=True)


if __name__ == "__main__":
    main()
