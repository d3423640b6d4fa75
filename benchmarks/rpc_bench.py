"""The target on two RPC workers (loopback), the draft local: target alone vs speculative (K=3 and
auto) at added one-way network delays, next to llama.cpp's own `llama-speculative-simple --rpc`.

    .venv/bin/python benchmarks/rpc_bench.py [--delays 0,1,5] [--prompts trudeau,quicksort-py]
                                             [--n-predict 64] [--rounds 2] [--llamacpp-rounds 1]

Setup: two `start_worker` processes on 127.0.0.1 (1 thread each), one delay proxy process in front
of them (benchmarks/delay_proxy.py: every chunk held D ms, each direction), the host at 1 thread
(the draft, and the target's few host-side ops). A forward pass runs its splits one after another
(worker 1, then worker 2, then the host reads the logits), so at any moment one of the three
computes: 2 cores hold them. The demo pair's target goes wholly to the workers (all blocks and the
output layer, split by their reported memory).

ggufspec part: one SpeculativeDecoder for the whole run; the proxy's delay is changed between
generations, in interleaved order (delays rotated per round, modes rotated per prompt), and auto
keeps one set of step costs per delay (as a fresh run at that delay would learn). llama.cpp part,
after it (a worker serves one host at a time): per delay and prompt, `llama-speculative-simple`
(-md draft, K=3, draft kept local with -devd none) and, as its target alone, `llama-completion`.
Both engines use the same workers through the same proxy, greedy, the same prompt text.

Writes benchmarks/results/rpc-<time>.json (every run, the summary) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp  # noqa: F401  (before numpy, see ggufspec/__init__.py)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from delay_proxy import DelayProxy  # noqa: E402

from ggufspec import SpeculativeDecoder, rpc, store  # noqa: E402
from ggufspec.session import open_decoder  # noqa: E402

LLAMACPP_BIN = REPO / "third_party/llama.cpp/build/bin"
PROMPTS_FILE = REPO / "ggufspec/data/seed-prompts.jsonl"
MODES = {"target alone": 0, "K=3": 3, "auto": "auto"}
N_CTX = 512


# -- workers ------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker_process(log_dir: Path, cache_dir: Path, threads: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    code = ("from ggufspec.rpc import start_worker; "
            f"start_worker('127.0.0.1', {port}, threads={threads}, cache_dir={str(cache_dir)!r})")
    with (log_dir / f"worker-{port}.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=log, stderr=log)
    wait_until_free(port, process)
    return process, port


def wait_until_free(port: int, process: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    """Until the worker answers a HELLO: it is up and serves no other host."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"worker on port {port} exited with {process.returncode}")
        try:
            rpc.probe(f"127.0.0.1:{port}", timeout=1.0)
            return
        except rpc.WorkerUnreachableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def measured_rtt_ms(ports: list[int], repeat: int = 20) -> float:
    """The smallest request/response time over one open connection, in ms (the worst port): HELLO,
    then ggml-rpc's DEVICE_COUNT (cmd 15, no payload; answer: size 4, u32) `repeat` times. A fresh
    connection per probe would also time the proxy's connect to the worker."""
    worst = 0.0
    for port in ports:
        wait_until_free(port)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(struct.pack("<BQ", 14, 24) + bytes(24))  # HELLO, plain TCP caps
            size = struct.unpack("<Q", recv_exactly(sock, 8))[0]
            recv_exactly(sock, size)
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                sock.sendall(struct.pack("<BQ", 15, 0))
                recv_exactly(sock, 8 + 4)
                best = min(best, time.perf_counter() - t0)
        worst = max(worst, best)
    return worst * 1e3


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise SystemExit("a worker closed the connection during the round-trip measurement")
        data += chunk
    return data


# -- prompts ------------------------------------------------------------------------------------------

def load_prompts(ids: list[str]) -> list[dict]:
    by_id = {p["id"]: p for p in map(json.loads, PROMPTS_FILE.read_text().splitlines()) if p}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise SystemExit(f"unknown prompt ids {missing}; see {PROMPTS_FILE}")
    return [by_id[i] for i in ids]


def prompt_text(decoder: SpeculativeDecoder, prompt: dict) -> str:
    if prompt["kind"] == "chat":
        return decoder.render_chat([{"role": "user", "content": prompt["prompt"]}])
    return prompt["prompt"]


# -- ggufspec -----------------------------------------------------------------------------------------

def rotated(items: list, by: int) -> list:
    by %= len(items)
    return items[by:] + items[:by]


def run_ggufspec(target, draft, proxy: DelayProxy, args, prompts: list[dict]) -> tuple[list[dict], dict]:
    endpoints = ",".join(f"127.0.0.1:{port}" for port in proxy.ports)
    proxy.set_delay(0)
    t0 = time.perf_counter()
    decoder = open_decoder(target, draft, n_ctx=N_CTX, n_threads=args.host_threads, rpc=endpoints)
    info = {"load_seconds": time.perf_counter() - t0, "placement": dict(decoder.placement or {})}
    texts = {p["id"]: prompt_text(decoder, p) for p in prompts}
    costs_per_delay = {delay: {} for delay in args.delays}  # auto learns each network on its own
    runs = []
    try:
        decoder.costs = {}  # warm-up: graphs built, caches hot; its costs are dropped
        for n_draft in MODES.values():
            decoder.generate(texts[prompts[0]["id"]], n_predict=8, n_draft=n_draft, temperature=0)
        for round_index in range(args.rounds):
            for delay in rotated(args.delays, round_index):
                proxy.set_delay(delay)
                decoder.costs = costs_per_delay[delay]
                for prompt_index, prompt in enumerate(prompts):
                    for mode in rotated(list(MODES), round_index + prompt_index):
                        trips_before, t1 = proxy.round_trips(), time.perf_counter()
                        out = decoder.generate(texts[prompt["id"]], n_predict=args.n_predict,
                                               n_draft=MODES[mode], temperature=0)
                        wall = time.perf_counter() - t1
                        trips = proxy.round_trips() - trips_before  # both workers, prefill included
                        stats = out.stats.to_dict()
                        stats.pop("placement", None)
                        runs.append({"engine": "ggufspec", "mode": mode, "delay_ms": delay, "round": round_index,
                                     "prompt": prompt["id"], "wall_seconds": wall, "round_trips": trips, "tokens": out.tokens,
                                     "text": out.text, **stats})
                        print(f"  ggufspec  {delay:g} ms  {prompt['id']:<14} {mode:<12} "
                              f"{stats['decode_tps']:6.2f} t/s  accept {stats['accept']:.2f}", flush=True)
    finally:
        decoder.costs = {}  # the proxy's ports are throwaway: keep them out of the costs file
        decoder.close()
    return runs, {**info, "texts": texts}


# -- llama.cpp ----------------------------------------------------------------------------------------

def llamacpp_tools() -> dict[str, Path]:
    """Tools present with --rpc (one that lacks it cannot do this comparison)."""
    tools = {}
    for role, name in (("spec", "llama-speculative-simple"), ("alone", "llama-completion")):
        path = LLAMACPP_BIN / name
        if path.is_file():
            done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
            helptext = done.stdout + done.stderr
            if "--rpc" in helptext:
                tools[role] = path
    return tools


def llamacpp_command(tool: Path, role: str, target, draft, endpoints: str, text: str, args) -> list[str]:
    threads = str(args.host_threads)
    common = [str(tool), "-m", str(target), "--rpc", endpoints, "-ngl", "99", "-c", str(N_CTX),
              "-n", str(args.n_predict), "-t", threads, "-tb", threads, "--temp", "0", "--top-k", "1",
              "--seed", "1", "-p", text]
    if role == "alone":
        return common + ["-no-cnv", "--no-display-prompt"]
    return common + ["-md", str(draft), "--spec-type", "draft-simple", "-devd", "none", "-td", threads, "-tbd", threads,
                     "--spec-draft-n-max", "3", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]


def parse_llamacpp(role: str, output: str) -> dict:
    if role == "spec":
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", output)
        drafted = re.search(r"n_drafted\s*=\s*(\d+)", output)
        accepted = re.search(r"n_accept\s*=\s*(\d+)", output)
        if not (decoded and drafted and accepted):
            return {}
        n_drafted, n_accept = int(drafted[1]), int(accepted[1])
        n, seconds = int(decoded[1]), float(decoded[2])
        return {"n_predict": n, "decode_seconds": seconds, "decode_tps": n / seconds if seconds else 0.0,
                "n_drafted": n_drafted, "n_accept": n_accept, "accept": n_accept / n_drafted if n_drafted else 0.0}
    evals = re.search(r"print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs", output)  # not "prompt eval"
    if not evals:
        return {}
    seconds, n = float(evals[1]) / 1e3, int(evals[2])
    return {"n_predict": n, "decode_seconds": seconds, "decode_tps": n / seconds if seconds else 0.0,
            "n_drafted": 0, "n_accept": 0, "accept": 0.0}


def run_llamacpp(tools, target, draft, proxy: DelayProxy, args, prompts, texts, ports) -> list[dict]:
    endpoints = ",".join(f"127.0.0.1:{port}" for port in proxy.ports)
    roles = [r for r in ("alone", "spec") if r in tools]
    runs = []
    for round_index in range(args.llamacpp_rounds):
        for delay in rotated(args.delays, round_index):
            proxy.set_delay(delay)
            for prompt_index, prompt in enumerate(prompts):
                for role in rotated(roles, round_index + prompt_index):
                    for port in ports:  # the last process's connections are gone
                        wait_until_free(port)
                    command = llamacpp_command(tools[role], role, target, draft, endpoints, texts[prompt["id"]], args)
                    t0 = time.perf_counter()
                    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                                          stdin=subprocess.DEVNULL)
                    parsed = parse_llamacpp(role, done.stdout + done.stderr)
                    mode = "target alone" if role == "alone" else "K=3"
                    runs.append({"engine": "llama.cpp", "tool": tools[role].name, "mode": mode, "delay_ms": delay,
                                 "round": round_index, "prompt": prompt["id"], "returncode": done.returncode,
                                 "wall_seconds": time.perf_counter() - t0, "stdout": done.stdout,
                                 "stderr_tail": done.stderr[-3000:], **parsed})
                    print(f"  llama.cpp {delay:g} ms  {prompt['id']:<14} {mode:<12} "
                          f"{parsed.get('decode_tps', 0):6.2f} t/s  accept {parsed.get('accept', 0):.2f}"
                          + ("" if done.returncode == 0 and parsed else f"  FAILED rc={done.returncode}"), flush=True)
    return runs


# -- summary ------------------------------------------------------------------------------------------

def summarize(runs: list[dict], delays: list[float]) -> list[dict]:
    rows = []
    for engine in ("ggufspec", "llama.cpp"):
        for delay in delays:
            cells = {}
            for mode in MODES:
                chosen = [r for r in runs if r["engine"] == engine and r["delay_ms"] == delay and r["mode"] == mode
                          and r.get("decode_seconds")]
                if chosen:
                    tokens = sum(r["n_predict"] for r in chosen)
                    seconds = sum(r["decode_seconds"] for r in chosen)
                    drafted = sum(r["n_drafted"] for r in chosen)
                    steps = sum(r.get("n_steps", 0) for r in chosen)
                    cells[mode] = {"runs": len(chosen), "tokens": tokens, "seconds": seconds,
                                   "tps": tokens / seconds,
                                   "accept": sum(r["n_accept"] for r in chosen) / drafted if drafted else None,
                                   "mean_k": drafted / steps if steps else None,
                                   "target_seconds_per_call": (sum(r.get("target_seconds", 0) for r in chosen) / steps
                                                               if steps else None),
                                   "round_trips_per_call": (sum(r.get("round_trips", 0) for r in chosen) / steps
                                                            if steps else None)}
            base = cells.get("target alone")
            for mode, cell in cells.items():
                cell["speedup"] = cell["tps"] / base["tps"] if base else None
                rows.append({"engine": engine, "delay_ms": delay, "mode": mode, **cell})
    return rows


def identity_checks(runs: list[dict]) -> dict:
    """Greedy tokens per (prompt, mode) across delays and rounds; speculative vs target alone."""
    mine = [r for r in runs if r["engine"] == "ggufspec"]
    across_delays = all(len({tuple(r["tokens"]) for r in mine if r["prompt"] == p and r["mode"] == m}) == 1
                        for p in {r["prompt"] for r in mine} for m in {r["mode"] for r in mine})
    spec_equals_alone = all(len({tuple(r["tokens"]) for r in mine if r["prompt"] == p}) == 1
                            for p in {r["prompt"] for r in mine})
    theirs = [r for r in runs if r["engine"] == "llama.cpp" and r["returncode"] == 0]
    llamacpp_across_delays = all(len({r["stdout"] for r in theirs if r["prompt"] == p and r["mode"] == m}) <= 1
                                 for p in {r["prompt"] for r in theirs} for m in {r["mode"] for r in theirs})
    alone_text = {r["prompt"]: r["text"] for r in mine if r["mode"] == "target alone"}
    contains = {mode: all(alone_text.get(r["prompt"], "\0").strip() in r["stdout"] for r in theirs if r["mode"] == mode)
                for mode in {r["mode"] for r in theirs}}  # llama.cpp overshoots n_predict: "contains"
    return {"ggufspec_tokens_same_across_delays": across_delays,
            "ggufspec_speculative_equals_target_alone": spec_equals_alone,
            "llamacpp_output_same_across_delays": llamacpp_across_delays if theirs else None,
            "llamacpp_output_contains_ggufspec_text": contains or None}


def markdown(rows: list[dict], rtts: dict) -> str:
    lines = ["| engine | added one-way delay | measured RTT | mode | tokens/s | speedup | acceptance | mean K | target s/call | round trips/call |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        fmt = lambda v, f: "" if v is None else format(v, f)
        lines.append(f"| {row['engine']} | {row['delay_ms']:g} ms | {rtts[row['delay_ms']]:.2f} ms | {row['mode']} "
                     f"| {row['tps']:.2f} | {fmt(row['speedup'], '.2f')}x | {fmt(row['accept'], '.2f')} "
                     f"| {fmt(row['mean_k'], '.2f')} | {fmt(row['target_seconds_per_call'], '.3f')} "
                     f"| {fmt(row.get('round_trips_per_call'), '.1f')} |")
    return "\n".join(lines)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    return {"cpu": model[1] if model else platform.processor(), "avx512": "avx512f" in cpuinfo,
            "cores": os.cpu_count(), "loadavg_before": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="0,1,5", help="added one-way delays, ms")
    parser.add_argument("--prompts", default="trudeau,quicksort-py", help="ids in ggufspec/data/seed-prompts.jsonl")
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="ggufspec rounds over delays x prompts x modes")
    parser.add_argument("--llamacpp-rounds", type=int, default=1, help="0: skip llama.cpp")
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--host-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.delays = [float(d) for d in args.delays.split(",")]
    rpc.require_rpc()
    info = {"machine": machine(), "argv": sys.argv, "args": {k: v for k, v in vars(args).items() if k != "out"}}
    target, draft = store.demo_pair_paths()
    prompts = load_prompts(args.prompts.split(","))
    work = Path(tempfile.mkdtemp(prefix="rpc-bench-"))
    workers = []
    try:
        workers = [start_worker_process(work, work / "cache", args.worker_threads) for _ in range(2)]
        worker_ports = [port for _, port in workers]
        with DelayProxy([("127.0.0.1", port) for port in worker_ports]) as proxy:
            rtts = {}
            for delay in args.delays:
                proxy.set_delay(delay)
                rtts[delay] = measured_rtt_ms(proxy.ports)
            info["rtt_direct_ms"] = measured_rtt_ms(worker_ports)
            info["rtt_through_proxy_ms"] = rtts
            print(f"HELLO round trips through the proxy (ms): {rtts}; direct {info['rtt_direct_ms']:.3f}", flush=True)
            runs, ggufspec_info = run_ggufspec(target, draft, proxy, args, prompts)
            info.update(ggufspec_info)
            tools = llamacpp_tools() if args.llamacpp_rounds > 0 else {}
            info["llamacpp_tools"] = {role: str(path) for role, path in tools.items()}
            if args.llamacpp_rounds > 0 and "spec" not in tools:
                print(f"llama.cpp rows skipped: no llama-speculative-simple with --rpc in {LLAMACPP_BIN}", flush=True)
            elif tools:
                runs += run_llamacpp(tools, target, draft, proxy, args, prompts, info["texts"], worker_ports)
    finally:
        for process, _ in workers:
            process.kill()
            process.wait()
    info["machine"]["loadavg_after"] = os.getloadavg()
    rows = summarize(runs, args.delays)
    info["identity"] = identity_checks(runs)
    table = markdown(rows, rtts)
    out = args.out or REPO / "benchmarks/results" / time.strftime("rpc-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**info, "summary": rows, "runs": runs}, indent=1))
    print()
    print(table)
    print()
    print("identity:", info["identity"])
    print("placement:", info["placement"], " load avg before/after:", info["machine"]["loadavg_before"],
          info["machine"]["loadavg_after"])
    print("wrote", out.relative_to(REPO) if out.is_relative_to(REPO) else out)


if __name__ == "__main__":
    main()
