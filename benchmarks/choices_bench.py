"""Several answers in one request: /v1/completions with a list of prompts, against the same prompts
sent one request after another, on `ggufspec serve --parallel 4` and on llama-server (its default
slots), both with the demo pair's target and the same -t and -c, in the same run.

Each round, on each server (the order reversed every other round): the `list` mode sends one request
whose `prompt` is a list of --prompts texts (greedy, --max-tokens each), the `sequential` mode sends
the same number of other texts one request at a time (a client before lists were served). Each mode
of each round has prompts of its own (no answer comes from the cache), the same ones on both servers.
Reported: the wall time of each mode and its tokens/s (every choice's completion tokens over the
wall time), and list / sequential. ggufspec drafts with its default (--draft auto, the demo draft).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/choices_bench.py --rounds 2 --json /tmp/choices.json

A Markdown table goes to stdout, progress to stderr, every record to --json.
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
from concurrent_bench import PROMPTS, ggufspec_command  # noqa: E402
from server_bench import LLAMA_SERVER, ROOT, Server, cpu_name, demo_pair, free_port, loadavg  # noqa: E402

MODES = ("list", "sequential")


def completion_prompt(task: str) -> str:
    return f"# {task}\ndef "


def timed_request(url: str, prompt, max_tokens: int) -> tuple[float, int, list[str]]:
    """Seconds, completion tokens and texts of one request. The tokens are counted per choice (max_tokens
    where it ended at that length, else its text's tokens): llama-server's `usage` counts one choice."""
    started = time.perf_counter()
    response = httpx.post(url + "/v1/completions", timeout=1800,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    seconds = time.perf_counter() - started
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    n_tokens = sum(max_tokens if c["finish_reason"] == "length" else text_tokens(url, c["text"]) for c in choices)
    return seconds, n_tokens, [c["text"] for c in choices]


def text_tokens(url: str, text: str) -> int:
    return len(httpx.post(url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"])


def run_mode(url: str, mode: str, prompts: list[str], max_tokens: int) -> dict:
    if mode == "list":
        seconds, n_tokens, texts = timed_request(url, prompts, max_tokens)
    else:
        seconds, n_tokens, texts = 0.0, 0, []
        for prompt in prompts:
            one_seconds, one_tokens, one_texts = timed_request(url, prompt, max_tokens)
            seconds, n_tokens, texts = seconds + one_seconds, n_tokens + one_tokens, texts + one_texts
    return {"mode": mode, "wall_s": seconds, "n_tokens": n_tokens, "tok_s": n_tokens / seconds, "texts": texts}


def server_command(name: str, args, target: Path, draft: Path, port: int) -> list[str]:
    where = ["-t", str(args.threads), "-c", str(args.ctx), "--host", "127.0.0.1", "--port", str(port)]
    if name == "ggufspec":
        return ggufspec_command() + ["serve", "-m", str(target), "-md", str(draft), "--parallel", "4"] + where
    return [str(LLAMA_SERVER), "-m", str(target), "-tb", str(args.threads)] + where


def run_server(name: str, args, target: Path, draft: Path, round_index: int) -> list[dict]:
    port = free_port()
    env = {**os.environ, "GGUFSPEC_HOME": tempfile.mkdtemp(prefix="choices-bench-home-"), "PYTHONPATH": str(ROOT)}
    log_path = Path(tempfile.gettempdir()) / f"choices_bench_{name}_{round_index}.log"
    records = []
    cmd = server_command(name, args, target, draft, port)
    with Server(name, cmd, port, log_path, env, ready_timeout=600) as server:
        timed_request(server.url, completion_prompt("Say hello."), 8)  # warm-up, not counted
        for m, mode in enumerate(MODES if round_index % 2 == 0 else MODES[::-1]):
            first = (round_index * len(MODES) + MODES.index(mode)) * args.prompts % len(PROMPTS)
            prompts = [completion_prompt(PROMPTS[(first + i) % len(PROMPTS)]) for i in range(args.prompts)]
            record = {"server": name, "round": round_index, "loadavg": loadavg(),
                      **run_mode(server.url, mode, prompts, args.max_tokens)}
            sys.stderr.write(f"{name} round {round_index} {mode}: {record['wall_s']:.1f} s, "
                             f"{record['tok_s']:.1f} tok/s\n")
            records.append(record)
    return records


def markdown(records: list[dict]) -> str:
    lines = ["| server | list of prompts: wall s (rounds) | one request each: wall s (rounds) | "
             "list tok/s | one each tok/s | one each / list (rounds) |", "|---|---|---|---|---|---|"]
    for server in ("ggufspec", "llama-server"):
        by_mode = {mode: [r for r in records if r["server"] == server and r["mode"] == mode] for mode in MODES}
        if not by_mode["list"]:
            continue
        walls = {mode: [r["wall_s"] for r in rows] for mode, rows in by_mode.items()}
        speed = {mode: statistics.median(r["tok_s"] for r in rows) for mode, rows in by_mode.items()}
        gains = [s / l for l, s in zip(walls["list"], walls["sequential"])]
        lines.append(f"| {server} | {', '.join(f'{w:.1f}' for w in walls['list'])} | "
                     f"{', '.join(f'{w:.1f}' for w in walls['sequential'])} | {speed['list']:.1f} | "
                     f"{speed['sequential']:.1f} | {', '.join(f'{g:.2f}x' for g in gains)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="ggufspec,llama-server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target, draft = demo_pair()
    servers = args.servers.split(",")
    records = []
    for round_index in range(args.rounds):
        for name in servers if round_index % 2 == 0 else servers[::-1]:
            records += run_server(name, args, target, draft, round_index)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "args": vars(args) | {"json": str(args.json)},
                                         "records": records}, indent=1))
    print(f"CPU: {cpu_name()}\n\n{markdown(records)}")


if __name__ == "__main__":
    main()
