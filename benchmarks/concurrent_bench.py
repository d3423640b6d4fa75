"""Concurrent clients on one server: N streamed chat requests sent together to `ggufspec serve` and to
llama-server on the demo pair, in the same run.

For each variant a fresh server starts (once), answers one warm-up request (not counted), then takes
each client count in turn (--clients 1,2,4,8): N threads wait at a barrier, the common start is taken
when the last one arrives, and each sends one streamed /v1/chat/completions request with its own short
coding prompt (temperature 0, seed 1, max_tokens --max-tokens). Each count takes the next prompts of
the list (16 of them: with the default counts no prompt is in a server's cache from an earlier count,
and every variant gets the same prompt for the same client and count).

Per client: the first-token time (from the common start to its first content delta), the completion
time (from the common start to the end of its stream) and its tokens (the final `usage` where the
server sends it, else `timings.predicted_n`, else the streamed deltas). Per variant and count: the
aggregate tokens/s (every client's tokens / the time until the last client finished), the first-token
and completion times, and for ggufspec variants the ratio of the aggregate to the same server's
1-client aggregate (in the same round).

Variants (--variants, comma-separated):
  gs-serial     ggufspec serve -md DRAFT --parallel 1         one request decoded at a time
  gs-parallel   ggufspec serve -md DRAFT --parallel SLOTS     SLOTS (--slots, default 4) decoded in one batch a step
  ls            llama-server -m TARGET                        its default slots (no -np), the target alone

Both servers get the same -c context and -t threads; ggufspec drafts with its default (--draft auto with
the demo pair's draft model); --gs-args / --ls-args add flags (e.g. --ls-args "-md DRAFT.gguf").
ggufspec servers get a new, empty GGUFSPEC_HOME each (the step costs are timed at startup, which is not
counted). With --rounds R every variant runs R times, the order reversed every other round. The
1-client count is one prompt, so its ratio is against that prompt's speed (drafting keeps more on some
prompts than on others). --system FILE gives every request the same system message (agents sharing
one system prompt; repeat a count, --clients 1,4,4, to see a second wave find it cached).
A variant may end in `+fa-on` or `+fa-off`: that server with `-fa on/off` (ggufspec's default on a CPU is off,
llama-server's on). --no-parallel-flag leaves `--parallel` off the gs-serial command (for a ggufspec without the flag).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/concurrent_bench.py --clients 1,2,4,8 --rounds 1 --json /tmp/concurrent.json

A Markdown table goes to stdout, progress to stderr, every record to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import LLAMA_SERVER, ROOT, Server, cpu_name, demo_pair, free_port, llama_server_version, loadavg  # noqa: E402

VARIANTS = ("gs-serial", "gs-parallel", "ls")
LOG_DIR = Path(tempfile.gettempdir()) / "concurrent_bench_logs"
PROMPTS = [  # 16: the default counts (1+2+4+8) never send a server the same prompt twice
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that counts how often each word occurs in a text.",
    "Write a Python function that flattens an arbitrarily nested list.",
    "Write a Python function that parses a date in YYYY-MM-DD format and returns the weekday name.",
    "Write a Python function that finds all prime numbers below n with the sieve of Eratosthenes.",
    "Write a Python function that groups a list of words into anagrams.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that returns the longest common prefix of a list of strings.",
    "Write a Python function that checks whether the brackets in a string are balanced.",
    "Write a Python function that rotates a square matrix by 90 degrees clockwise.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that does a binary search in a sorted list and returns the index or -1.",
    "Write a Python function that converts a CamelCase name to snake_case.",
    "Write a Python function that reads a CSV file and returns the sum of one numeric column.",
]


# ---------------------------------------------------------------- one client

def request_body(prompt: str, max_tokens: int, system: str | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "seed": 1, "stream": True, "stream_options": {"include_usage": True}}


def stream_client(url: str, prompt: str, max_tokens: int, start: float, system: str | None = None) -> dict:
    """One streamed chat completion; times are seconds since the common `start`."""
    first, n_deltas, text, usage, timings = None, 0, [], None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=request_body(prompt, max_tokens, system),
                      timeout=900) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            chunk = sse_data(line)
            if chunk is None:
                continue
            if chunk == "[DONE]":
                break
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
            if content:
                first = first if first is not None else time.perf_counter() - start
                # ggufspec says how many tokens a chunk holds; llama-server sends one a chunk
                n_deltas += len((chunk.get("ggufspec") or {}).get("pieces") or [None])
                text.append(content)
    done = time.perf_counter() - start
    n_tokens, source = token_count(usage, timings, n_deltas)
    return {"first_token_s": first, "completion_s": done, "n_tokens": n_tokens, "tokens_from": source,
            "text": "".join(text), "timings": timings}


def sse_data(line: str):
    """The JSON of an SSE `data:` line, "[DONE]", or None for any other line."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return data if data == "[DONE]" else json.loads(data)


def token_count(usage: dict | None, timings: dict | None, n_deltas: int) -> tuple[int, str]:
    if usage and usage.get("completion_tokens") is not None:
        return usage["completion_tokens"], "usage"
    if timings and timings.get("predicted_n") is not None:
        return timings["predicted_n"], "timings"
    return n_deltas, "deltas"


# ---------------------------------------------------------------- N clients together

def run_clients(url: str, n_clients: int, max_tokens: int, first_prompt: int, system: str | None = None) -> list[dict]:
    """N threads released together, client i with PROMPTS[first_prompt + i]; results in client order."""
    results: list[dict] = [{} for _ in range(n_clients)]
    prompt_ids = [(first_prompt + i) % len(PROMPTS) for i in range(n_clients)]
    start = [0.0]
    barrier = threading.Barrier(n_clients, action=lambda: start.__setitem__(0, time.perf_counter()))

    def client(index: int) -> None:
        barrier.wait()
        try:
            results[index] = stream_client(url, PROMPTS[prompt_ids[index]], max_tokens, start[0], system)
        except Exception as exc:  # noqa: BLE001 - recorded, reported with the count
            results[index] = {"error": f"{type(exc).__name__}: {exc}"}
        results[index].update(client=index, prompt=prompt_ids[index])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def summarise_count(n_clients: int, clients: list[dict]) -> dict:
    record = {"clients": n_clients, "per_client": clients}
    errors = [c["error"] for c in clients if "error" in c]
    if errors:
        record["error"] = errors[0]
        return record
    wall = max(c["completion_s"] for c in clients)
    tokens = sum(c["n_tokens"] for c in clients)
    record.update({"wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall if wall > 0 else None,
                   "first_token_s": [c["first_token_s"] for c in clients],
                   "completion_s": [c["completion_s"] for c in clients]})
    return record


# ---------------------------------------------------------------- the servers

def ggufspec_command() -> list[str]:
    exe = Path(sys.executable).parent / "ggufspec"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggufspec.cli"]


def parallel_flags(variant: str, args) -> list[str]:
    if variant == "gs-parallel":
        return ["--parallel", str(args.slots)]
    return [] if args.no_parallel_flag else ["--parallel", "1"]


def variant_command(variant: str, args, target: Path, draft: Path, port: int) -> list[str]:
    variant, _, attention = variant.partition("+fa-")  # gs-parallel+fa-on: that server with -fa on
    return server_command(variant, args, target, draft, port) + (["-fa", attention] if attention else [])


def server_command(variant: str, args, target: Path, draft: Path, port: int) -> list[str]:
    where = ["-t", str(args.threads), "-c", str(args.ctx), "--host", "127.0.0.1", "--port", str(port)]
    if variant.startswith("gs-"):
        return (ggufspec_command() + ["serve", "-m", str(target), "-md", str(draft)] + where
                + parallel_flags(variant, args) + shlex.split(args.gs_args))
    # llama-server: its default slots (no -np); -tb as well, so that prompt batches use the same threads
    return [str(LLAMA_SERVER), "-m", str(target), "-tb", str(args.threads), "--jinja"] + where + shlex.split(args.ls_args)


def server_slots(url: str) -> int | None:
    try:
        return httpx.get(url + "/props", timeout=10).json().get("total_slots")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def run_variant(variant: str, args, target: Path, draft: Path, counts: list[int], round_index: int) -> dict:
    port = free_port()
    cmd = variant_command(variant, args, target, draft, port)
    env = {**os.environ, "GGUFSPEC_HOME": tempfile.mkdtemp(prefix="concurrent-bench-home-"), "PYTHONPATH": str(ROOT)}
    record = {"variant": variant, "round": round_index, "command": cmd, "loadavg_before": loadavg(), "counts": []}
    log_path = LOG_DIR / f"{variant}.{round_index}.log"
    print(f"[round {round_index}] {variant}: {shlex.join(cmd)}  (log {log_path})", file=sys.stderr)
    try:
        with Server(variant, cmd, port, log_path, env, ready_timeout=600) as server:
            record["startup_s"] = server.startup_seconds
            record["total_slots"] = server_slots(server.url)
            stream_client(server.url, "Say hi.", 4, time.perf_counter())  # warm-up, not counted
            for k, n in enumerate(counts):  # each count its own prompts: none is in the server's cache yet
                clients = run_clients(server.url, n, args.max_tokens, sum(counts[:k]), args.system_text)
                record["counts"].append(summarise_count(n, clients))
                log_count(variant, record["counts"][-1])
    except Exception as exc:  # one variant failing must not lose the others' numbers
        record["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{variant}] FAILED: {record['error']}", file=sys.stderr)
    record["loadavg_after"] = loadavg()
    return record


def log_count(variant: str, count: dict) -> None:
    if "error" in count:
        print(f"  {variant} x{count['clients']}: FAILED: {count['error']}", file=sys.stderr)
        return
    print(f"  {variant} x{count['clients']}: {count['tokens']} tokens in {count['wall_s']:.2f} s = "
          f"{count['aggregate_tps']:.2f} tok/s; first token {seconds_list(count['first_token_s'])}; "
          f"done {seconds_list(count['completion_s'])}", file=sys.stderr)


# ---------------------------------------------------------------- the tables

def seconds_list(values: list[float | None]) -> str:
    return ", ".join("–" if v is None else f"{v:.2f}" for v in values)


def spread(values: list[float | None]) -> str:
    """min / median / max."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def ratio_to_one_client(record: dict, count: dict) -> str:
    if not record["variant"].startswith("gs-"):
        return "–"
    one = next((c for c in record["counts"] if c["clients"] == 1 and c.get("aggregate_tps")), None)
    return f"{count['aggregate_tps'] / one['aggregate_tps']:.2f}x" if one else "–"


def markdown(records: list[dict]) -> str:
    lines = ["| variant | round | slots | clients | aggregate tok/s | vs own 1 client | tokens | "
             "first token s (min/med/max) | completion s (min/med/max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        head = f"| {record['variant']} | {record['round']} | {record.get('total_slots') or '–'}"
        if "error" in record and not record["counts"]:
            lines.append(f"{head} | – | failed: {record['error'][:120]} | | | | |")
        for count in record["counts"]:
            if "error" in count:
                lines.append(f"{head} | {count['clients']} | failed: {count['error'][:120]} | | | | |")
                continue
            lines.append(f"{head} | {count['clients']} | {count['aggregate_tps']:.2f} | "
                         f"{ratio_to_one_client(record, count)} | {count['tokens']} | "
                         f"{spread(count['first_token_s'])} | {spread(count['completion_s'])} |")
    return "\n".join(lines)


def client_table(records: list[dict]) -> str:
    lines = ["| variant | round | clients | first token s, each client | completion s, each client | tokens, each client |",
             "|---|---|---|---|---|---|"]
    for record in records:
        for count in record["counts"]:
            if "error" not in count:
                lines.append(f"| {record['variant']} | {record['round']} | {count['clients']} | "
                             f"{seconds_list(count['first_token_s'])} | {seconds_list(count['completion_s'])} | "
                             f"{', '.join(str(c['n_tokens']) for c in count['per_client'])} |")
    return "\n".join(lines)


def text_agreement(records: list[dict]) -> str:
    """Greedy everywhere: how many different texts each prompt got across variants and rounds."""
    texts: dict[int, set[str]] = {}
    for record in records:
        for count in record["counts"]:
            for client in count["per_client"]:
                if "text" in client:
                    texts.setdefault(client["prompt"], set()).add(client["text"])
    return "different texts per prompt (1: all the same): " + ", ".join(
        f"p{i} {len(t)}" for i, t in sorted(texts.items()))


# ---------------------------------------------------------------- main

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="Comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--clients", default="1,2,4,8", help="Comma-separated client counts, each run in turn.")
    parser.add_argument("--slots", type=int, default=4, help="gs-parallel's --parallel.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="Passes over the variants, alternating order.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--gs-args", default="", help="More flags for ggufspec serve (one string).")
    parser.add_argument("--ls-args", default="", help="More flags for llama-server (one string), e.g. '-md DRAFT'.")
    parser.add_argument("--no-parallel-flag", action="store_true",
                        help="gs-serial without --parallel 1 (a ggufspec that lacks the flag).")
    parser.add_argument("--system", default=None, help="A file whose text is every client's system message "
                        "(agents sharing one system prompt).")
    parser.add_argument("--json", default=None, help="Write every record here.")
    args = parser.parse_args()
    if args.system and not Path(args.system).is_file():
        parser.error(f"--system {args.system}: no such file (the system message's text)")
    args.system_text = Path(args.system).read_text() if args.system else None
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.counts = [int(n) for n in args.clients.split(",") if n.strip()]
    unknown = {v for v in args.variant_list
               if v.partition("+")[0] not in VARIANTS or v.partition("+")[2] not in ("", "fa-on", "fa-off")}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if any(v.partition("+")[0] == "ls" for v in args.variant_list) and not LLAMA_SERVER.exists():
        parser.error(f"{LLAMA_SERVER} is missing: build it with scripts/build-llamacpp.sh")
    return args


def main() -> None:
    args = parse_args()
    target, draft = demo_pair()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "n_cpus": os.cpu_count(), "threads": args.threads, "ctx": args.ctx,
            "max_tokens": args.max_tokens, "clients": args.counts, "system": args.system, "slots": args.slots, "target": str(target),
            "draft": str(draft), "command": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg_before": loadavg(),
            "llama_server_version": llama_server_version() if LLAMA_SERVER.exists() else None}
    records = []
    for round_index in range(args.rounds):
        order = args.variant_list if round_index % 2 == 0 else args.variant_list[::-1]
        for variant in order:
            records.append(run_variant(variant, args, target, draft, args.counts, round_index))
            if args.json:  # partial results survive an interrupted run
                write_json(args.json, meta, records)
    meta["loadavg_after"] = loadavg()
    if args.json:
        write_json(args.json, meta, records)
    print(f"\nCPU: {meta['cpu']}, {args.threads} threads, ctx {args.ctx}; target {target.name}, draft {draft.name}; "
          f"max_tokens {args.max_tokens}, temperature 0; load average before {meta['loadavg_before']}, "
          f"after {meta['loadavg_after']}\n")
    print(markdown(records))
    print("\n" + client_table(records))
    print("\n" + text_agreement(records))


def write_json(path: str, meta: dict, records: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
