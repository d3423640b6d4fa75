"""OpenAI-compatible servers on the demo pair, each started as a real process on a free loopback port:

 (1) time to first token of a ~1,400-token conversation (benchmarks/conversation.json), first turn,
     then the second turn (the conversation + the server's own answer + a short new message): the
     second turn shows whether the server reuses its prompt cache;
 (2) time to first token and decode tokens/s on a few short chat prompts (ggufspec/data/seed-prompts.jsonl),
     decode speed from the stream (tokens after the first / time after the first), plus the server's
     own `timings` where it sends them (predicted_per_second, draft_n, draft_n_accepted).

    .venv/bin/python benchmarks/server_bench.py [--servers ggufspec,ggufspec-nodraft,llama-server,
        llama-server-draft,llama-cpp-python] [--threads 2] [--repeat 2] [--json OUT]

Every request is streamed chat (/v1/chat/completions), temperature 0. Each server gets one tiny
warm-up request (a different conversation) before anything is timed. With --repeat R the server
list runs R times, every other pass in reverse order, so that a machine that gets busier or quieter
does not favour one server. Load averages are recorded before and after each server.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "third_party/llama.cpp/build/bin/llama-server"
SERVERS = ("ggufspec", "ggufspec-nodraft", "llama-server", "llama-server-draft", "llama-cpp-python")
LOG_DIR = Path(tempfile.gettempdir()) / "server_bench_logs"


# ---------------------------------------------------------------- the servers' command lines

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_server_help() -> str:
    try:
        return subprocess.run([str(LLAMA_SERVER), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def llama_server_version() -> str:
    try:
        done = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return " ".join((done.stdout + done.stderr).split())


def llama_server_draft_flags(draft: Path, threads: int) -> list[str]:
    """The draft model for llama-server, with the flags this build has: `--spec-type draft-simple`
    where it exists; threads for the draft where the build lets them be set."""
    help_text = llama_server_help()
    flags = ["-md", str(draft)]
    if "--spec-type" in help_text and "draft-simple" in help_text:
        flags += ["--spec-type", "draft-simple"]
    if re.search(r"(^|[\s,])-td[\s,]", help_text):
        flags += ["-td", str(threads)]
    if re.search(r"(^|[\s,])-tbd[\s,]", help_text):
        flags += ["-tbd", str(threads)]
    return flags


def server_command(name: str, target: Path, draft: Path, threads: int, n_ctx: int, port: int) -> list[str]:
    python = sys.executable
    ggufspec = [python, "-m", "ggufspec.cli"] if not (Path(python).parent / "ggufspec").exists() \
        else [str(Path(python).parent / "ggufspec")]
    common_gs = ["serve", "-m", str(target), "-t", str(threads), "-c", str(n_ctx),
                 "--host", "127.0.0.1", "--port", str(port)]
    # one slot (-np 1): the whole context for the one conversation, as the other servers have
    common_ls = [str(LLAMA_SERVER), "-m", str(target), "-t", str(threads), "-tb", str(threads),
                 "-c", str(n_ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    if name == "ggufspec":
        return ggufspec + common_gs + ["-md", str(draft)]  # --draft auto: serve's default
    if name == "ggufspec-nodraft":
        return ggufspec + common_gs + ["--no-draft"]
    if name == "llama-server":
        return common_ls
    if name == "llama-server-draft":
        return common_ls + llama_server_draft_flags(draft, threads)
    if name == "llama-cpp-python":
        # flash attention on: what llama.cpp's "auto" (ggufspec's and llama-server's default) gives on CPU
        return [python, "-m", "llama_cpp.server", "--model", str(target), "--n_ctx", str(n_ctx),
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--flash_attn", "true",
                "--host", "127.0.0.1", "--port", str(port)]
    raise SystemExit(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")


def demo_pair() -> tuple[Path, Path]:
    """The demo pair's target and draft GGUFs (ggufspec's default pair)."""
    from ggufspec import store
    target, draft = store.demo_pair_paths(progress=False)
    return Path(target), Path(draft)


class Server:
    """A server process on a free loopback port, ready when /health (or /v1/models) answers 200."""

    def __init__(self, name: str, command: list[str], port: int, log_path: Path, env: dict | None = None,
                 ready_timeout: float = 300):
        self.name, self.command, self.port, self.log_path = name, command, port, log_path
        self.env, self.ready_timeout = env, ready_timeout  # env None: this process's environment
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self):
        self.log = open(self.log_path, "w")
        started = time.perf_counter()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                        stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        try:
            self.wait_ready(timeout=self.ready_timeout)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_seconds = time.perf_counter() - started
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        paths = ["/health", "/v1/models"]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before it was ready: "
                                   f"{self.log_tail()}")
            for path in list(paths):
                try:
                    status = httpx.get(self.url + path, timeout=5).status_code
                except httpx.HTTPError:
                    break  # not listening yet
                if status == 200:
                    return
                if status == 404:  # this server has no such endpoint: ask the other one
                    paths.remove(path)
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 8) -> str:
        self.log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# ---------------------------------------------------------------- one streamed request

def stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: time to the first non-empty content delta, when the last one
    came, how many tokens, and the server's usage and timings where it sends them."""
    # repeat_penalty 1: llama_cpp.server's default is 1.1, the others' 1 (no penalty); the same
    # greedy text everywhere. cache_prompt: llama-server's default, said anyway. Others ignore both.
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "repeat_penalty": 1.0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": True}
    text, arrivals, usage, timings, error = [], [], None, None, None
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                break
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    # ggufspec says how many tokens a chunk holds (a verification step's worth);
                    # llama-server and llama_cpp.server send one token a chunk
                    n = len((chunk.get("ggufspec") or {}).get("pieces") or [None])
                    arrivals.append((time.perf_counter() - sent, n))
                    text.append(content)
    if error:
        raise RuntimeError(f"error in stream: {error}")
    if not arrivals:
        raise RuntimeError("no content in the stream")
    return summarise(arrivals, "".join(text), usage, timings)


def summarise(arrivals: list[tuple[float, int]], text: str, usage: dict | None, timings: dict | None) -> dict:
    ttft, first_n = arrivals[0]
    n_streamed = sum(n for _, n in arrivals)
    n_tokens = n_streamed
    if usage and usage.get("completion_tokens"):
        n_tokens = usage["completion_tokens"]
    after_first = arrivals[-1][0] - ttft
    decode_tps = (n_tokens - first_n) / after_first if after_first > 0 and n_tokens > first_n else None
    result = {"ttft_s": ttft, "total_s": arrivals[-1][0], "n_tokens": n_tokens, "n_streamed": n_streamed,
              "n_chunks": len(arrivals), "decode_tps": decode_tps, "text": text,
              "arrivals": [[round(t, 4), n] for t, n in arrivals]}  # (seconds since the request, tokens)
    if usage:
        result["prompt_tokens"] = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            result["cached_tokens"] = cached
    if timings:
        result["timings"] = timings
        if "cached_tokens" not in result and "cache_n" in timings:
            result["cached_tokens"] = timings["cache_n"]
    return result


# ---------------------------------------------------------------- one server's run

def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def wait_for_quiet(max_load: float | None, max_wait: float) -> float:
    """On a shared machine: wait (at most max_wait seconds) until the 1-minute load average is at
    most max_load. Returns the seconds waited."""
    started = time.monotonic()
    while max_load is not None and loadavg()[0] > max_load and time.monotonic() - started < max_wait:
        time.sleep(5)
    return time.monotonic() - started


def bench_server(name: str, args, target: Path, draft: Path, conversation: dict, prompts: list[dict],
                 pass_index: int) -> dict:
    record_wait = wait_for_quiet(args.max_load, args.max_wait)
    port = free_port()
    command = server_command(name, target, draft, args.threads, args.ctx, port)
    log_path = LOG_DIR / f"{name}.{pass_index}.log"
    record = {"server": name, "pass": pass_index, "command": command, "log": str(log_path),
              "waited_for_quiet_s": record_wait, "loadavg_before": loadavg()}
    print(f"[{name} pass {pass_index}] starting: {' '.join(command)}", file=sys.stderr)
    try:
        with Server(name, command, port, log_path) as server:
            record["startup_s"] = server.startup_seconds
            warm = stream_chat(server.url, [{"role": "user", "content": "Say hi."}], 2)
            record["warmup_ttft_s"] = warm["ttft_s"]
            record["turns"] = conversation_turns(server.url, conversation, args.turn_tokens, name)
            record["prompts"] = []
            for prompt in prompts:
                result = stream_chat(server.url, [{"role": "user", "content": prompt["prompt"]}], args.max_tokens)
                result["id"] = prompt["id"]
                record["prompts"].append(result)
                log_result(name, prompt["id"], result)
    except Exception as exc:  # one server failing must not lose the others' numbers
        record["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] FAILED: {record['error']}", file=sys.stderr)
    record["loadavg_after"] = loadavg()
    return record


def conversation_turns(url: str, conversation: dict, max_tokens: int, name: str) -> list[dict]:
    messages = list(conversation["messages"])
    first = stream_chat(url, messages, max_tokens)
    log_result(name, "turn 1", first)
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": conversation["follow_up"]}]
    second = stream_chat(url, messages, max_tokens)
    log_result(name, "turn 2", second)
    return [first, second]


def log_result(name: str, what: str, result: dict) -> None:
    tps = result["decode_tps"]
    print(f"[{name}] {what}: ttft {result['ttft_s']:.2f} s, {result['n_tokens']} tokens"
          + (f", {tps:.1f} tok/s" if tps else "")
          + (f", cached {result['cached_tokens']}" if result.get("cached_tokens") is not None else ""),
          file=sys.stderr)


# ---------------------------------------------------------------- tables

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits=2, suffix=""):
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def per_pass(values, digits=2):
    """`median (a / b)` when there are several passes."""
    values = [v for v in values if v is not None]
    if len(values) <= 1:
        return fmt(values[0] if values else None, digits)
    return f"{fmt(median(values), digits)} ({' / '.join(fmt(v, digits) for v in values)})"


def acceptance(results: list[dict]) -> float | None:
    drafted = sum((r.get("timings") or {}).get("draft_n") or 0 for r in results)
    accepted = sum((r.get("timings") or {}).get("draft_n_accepted") or 0 for r in results)
    return 100 * accepted / drafted if drafted else None


def markdown(records: list[dict], names: list[str]) -> str:
    lines = ["| server | turn 1 TTFT s | turn 2 TTFT s | turn 2 cached | short prompts: TTFT s | "
             "decode tok/s (stream) | decode tok/s (server) | drafted | accepted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        runs = [r for r in records if r["server"] == name and "error" not in r]
        if not runs:
            errors = [r.get("error") for r in records if r["server"] == name]
            lines.append(f"| {name} | failed: {errors[0] if errors else 'not run'} | | | | | | | |")
            continue
        prompts = [[p for p in r["prompts"]] for r in runs]
        drafted = sum((p.get("timings") or {}).get("draft_n") or 0 for ps in prompts for p in ps)
        has_timings = any(p.get("timings") for ps in prompts for p in ps)
        lines.append("| " + " | ".join([
            name,
            per_pass([r["turns"][0]["ttft_s"] for r in runs]),
            per_pass([r["turns"][1]["ttft_s"] for r in runs]),
            str(int(median([r["turns"][1].get("cached_tokens") for r in runs])) if any(
                r["turns"][1].get("cached_tokens") is not None for r in runs) else "–"),
            per_pass([median([p["ttft_s"] for p in ps]) for ps in prompts]),
            per_pass([median([p["decode_tps"] for p in ps]) for ps in prompts], 1),
            per_pass([median([(p.get("timings") or {}).get("predicted_per_second") for p in ps]) for ps in prompts], 1),
            str(drafted) if has_timings else "–",
            fmt(acceptance([p for ps in prompts for p in ps]), 0, "%"),
        ]) + " |")
    return "\n".join(lines)


def prompt_table(records: list[dict], names: list[str], prompt_ids: list[str]) -> str:
    lines = ["| server | prompt | TTFT s | tokens | decode tok/s (stream) | decode tok/s (server) | accepted |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        runs = [r for r in records if r["server"] == name and "error" not in r]
        for pid in prompt_ids:
            results = [p for r in runs for p in r["prompts"] if p["id"] == pid]
            if not results:
                continue
            lines.append("| " + " | ".join([
                name, pid, per_pass([p["ttft_s"] for p in results]),
                "/".join(str(p["n_tokens"]) for p in results),
                per_pass([p["decode_tps"] for p in results], 1),
                per_pass([(p.get("timings") or {}).get("predicted_per_second") for p in results], 1),
                fmt(acceptance(results), 0, "%"),
            ]) + " |")
    return "\n".join(lines)


def text_agreement(records: list[dict], prompt_ids: list[str]) -> str:
    """Greedy decoding everywhere: do the servers write the same text for each prompt?"""
    lines = []
    for pid in prompt_ids:
        texts = {}
        for r in records:
            for p in r.get("prompts", []):
                if p["id"] == pid:
                    texts.setdefault(p["text"], []).append(f"{r['server']}#{r['pass']}")
        if len(texts) <= 1:
            lines.append(f"{pid}: the same text from every run")
        else:
            groups = sorted(texts.values(), key=len, reverse=True)
            lines.append(f"{pid}: {len(texts)} different texts: " + "; ".join(", ".join(g) for g in groups))
    return "\n".join(lines)


def runs_table(records: list[dict]) -> str:
    lines = ["| server | pass | load avg before | load avg after | startup s | turn 1 prompt tokens | turn 2 cached |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        turns = r.get("turns") or [{}, {}]
        lines.append(f"| {r['server']} | {r['pass']} | {' '.join(map(str, r['loadavg_before']))} | "
                     f"{' '.join(map(str, r['loadavg_after']))} | {fmt(r.get('startup_s'), 1)} | "
                     f"{turns[0].get('prompt_tokens', '–')} | {turns[1].get('cached_tokens', '–')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS), help="Comma-separated, from: " + ", ".join(SERVERS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1, help="Passes over the servers, alternating order.")
    parser.add_argument("--prompts", type=int, default=3, help="How many chat prompts of the seed set.")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens for the short prompts.")
    parser.add_argument("--turn-tokens", type=int, default=32, help="max_tokens for the conversation's turns.")
    parser.add_argument("--conversation", default=str(ROOT / "benchmarks/conversation.json"))
    parser.add_argument("-m", "--model", help="Target GGUF [default: the demo pair's].")
    parser.add_argument("-md", "--model-draft", help="Draft GGUF [default: the demo pair's].")
    parser.add_argument("--max-load", type=float, default=None,
                        help="Before each server, wait until the 1-minute load average is at most this.")
    parser.add_argument("--max-wait", type=float, default=300, help="Longest wait for --max-load, seconds.")
    parser.add_argument("--json", dest="json_out", help="Write the raw results here.")
    args = parser.parse_args()

    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    for name in names:
        if name not in SERVERS:
            parser.error(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")
    if any(n.startswith("llama-server") for n in names) and not LLAMA_SERVER.exists():
        parser.error(f"{LLAMA_SERVER} does not exist: build it with scripts/build-llamacpp.sh")
    if args.model and args.model_draft:
        target, draft = Path(args.model), Path(args.model_draft)
    else:
        from ggufspec import store
        target, draft = store.demo_pair_paths()
    conversation = json.loads(Path(args.conversation).read_text())
    seed = [json.loads(line) for line in (ROOT / "ggufspec/data/seed-prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [p for p in seed if p["kind"] == "chat"][:args.prompts]
    LOG_DIR.mkdir(parents=True, exist_ok=True)

    started = time.time()
    meta = {"cpu": cpu_name(), "avx512": "avx512f" in Path("/proc/cpuinfo").read_text(),
            "n_cpus": os.cpu_count(), "threads": args.threads, "ctx": args.ctx, "repeat": args.repeat,
            "max_tokens": args.max_tokens, "turn_tokens": args.turn_tokens, "target": str(target),
            "draft": str(draft), "prompts": [p["id"] for p in prompts], "command": sys.argv,
            "loadavg_before": loadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "llama_server_version": llama_server_version() if LLAMA_SERVER.exists() else None}
    records = []
    for pass_index in range(args.repeat):
        order = names if pass_index % 2 == 0 else list(reversed(names))
        for name in order:
            records.append(bench_server(name, args, target, draft, conversation, prompts, pass_index))
            if args.json_out:  # partial results survive an interrupted run
                write_json(args.json_out, meta, records)
    meta["loadavg_after"] = loadavg()
    meta["wall_s"] = time.time() - started
    if args.json_out:
        write_json(args.json_out, meta, records)

    print(f"CPU: {meta['cpu']} ({'AVX512' if meta['avx512'] else 'no AVX512'}), {args.threads} threads, "
          f"ctx {args.ctx}, {args.repeat} pass(es); load average before {meta['loadavg_before']}, "
          f"after {meta['loadavg_after']}; {meta['wall_s'] / 60:.1f} min\n")
    turn_prompt = next((r["turns"][0].get("prompt_tokens") for r in records if r.get("turns")), None)
    print(f"Conversation: {turn_prompt or '~1,400'} prompt tokens, turns of {args.turn_tokens} tokens; "
          f"short prompts: {', '.join(meta['prompts'])}, {args.max_tokens} tokens, temperature 0. "
          f"Values: median (each pass).\n")
    print(markdown(records, names))
    print()
    print(prompt_table(records, names, meta["prompts"]))
    print()
    print(runs_table(records))
    print()
    print(text_agreement(records, meta["prompts"]))
    for r in records:
        if "error" in r:
            print(f"\n{r['server']} (pass {r['pass']}) failed: {r['error']}")


def write_json(path: str, meta: dict, records: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "results": records}, indent=1))


if __name__ == "__main__":
    main()
