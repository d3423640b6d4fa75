#!/usr/bin/env python
"""N-gram drafting, side by side in one run: the target alone, ggufspec's default (`-m` alone: the
draft it chooses, `--draft auto`), `--lookup`, fixed n-gram K, and llama-server's own n-gram drafters
(`--spec-type ngram-mod`, `ngram-map-k`) and its target alone, on prompts whose answers copy text from
the prompt and on prompts whose answers copy nothing.

    .venv/bin/python benchmarks/ngram_bench.py --prompts benchmarks/ngram-prompts.jsonl -n 192 --repeat 2 \\
        -t 2 --llama-server third_party/llama.cpp/build/bin/llama-server --json benchmarks/results/ngram.json

Greedy. Runs are interleaved (each repeat visits every prompt, and for each prompt every
configuration, in an order that rotates). Each ggufspec run starts from an empty n-gram pool, so no
configuration drafts from another one's answer to the same prompt; what auto learned of this
machine's costs and of how often n-gram proposals are kept does carry over, as it does for a user.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ggufspec.ngram import NgramPool  # noqa: E402
from ggufspec.session import ModelOptions, open_session  # noqa: E402

LLAMA_SERVER_CONFIGS = {"llama-server target": [], "llama-server ngram-mod": ["--spec-type", "ngram-mod"],
                        "llama-server ngram-map-k": ["--spec-type", "ngram-map-k"]}


def ggufspec_configs(choice: dict, fixed: list[int]) -> dict:
    """What `run -m TARGET` does (auto, with the chosen draft), --lookup, fixed n-gram K, and the target alone."""
    default = "lookup" if choice["kind"] == "ngram" else "model"
    configs = {"target": {"n_draft": 0}, "auto": {"n_draft": "auto", "drafter": default},
               "lookup": {"n_draft": "auto", "drafter": "lookup"}}
    configs.update({f"lookup K={k}": {"n_draft": k, "drafter": "lookup"} for k in fixed})
    return configs


def prompt_text(decoder, item: dict) -> str:
    if "messages" in item:
        return decoder.render_chat(item["messages"])
    if item.get("kind") == "chat":
        messages = ([{"role": "system", "content": item["system"]}] if item.get("system") else [])
        return decoder.render_chat(messages + [{"role": "user", "content": item["prompt"]}])
    return item["prompt"]


def run_ggufspec(decoder, text: str, options: dict, n_predict: int) -> dict:
    decoder.ngram_pool = NgramPool()  # no answer of another run to copy from
    out = decoder.generate(text, n_predict=n_predict, temperature=0.0, **options)
    s = out.stats
    return {"tps": s.decode_tps, "n": s.n_predict, "drafted": s.n_drafted, "accepted": s.n_accept,
            "steps": s.n_steps, "text": out.text}


# ---------------------------------------------------------------- llama-server

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_llama_server(binary: str, model: str, threads: int, extra: list[str], log: Path):
    port = free_port()
    command = [binary, "-m", model, "-t", str(threads), "-c", "4096", "-np", "1", "--port", str(port), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server {' '.join(extra)} exited: see {log}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server {' '.join(extra)} did not start: see {log}")


def run_llama_server(url: str, text: str, n_predict: int) -> dict:
    body = json.dumps({"prompt": text, "n_predict": n_predict, "temperature": 0.0, "seed": 1,
                       "cache_prompt": True}).encode()
    request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        data = json.loads(response.read())
    t = data["timings"]
    drafted = t.get("draft_n", 0)
    return {"tps": t["predicted_per_second"], "n": t["predicted_n"], "drafted": drafted,
            "accepted": t.get("draft_n_accepted", 0), "steps": None, "text": data["content"]}


# ---------------------------------------------------------------- the run and its tables

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None, help="target GGUF [default: the demo pair's target]")
    parser.add_argument("--prompts", default=str(Path(__file__).with_name("ngram-prompts.jsonl")))
    parser.add_argument("-n", "--n-predict", type=int, default=192)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--fixed", default="8,16", help="fixed n-gram K values to run")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (scripts/build-llamacpp.sh)")
    parser.add_argument("--json", default=None, help="write every run here")
    args = parser.parse_args()
    if args.model is None:
        from ggufspec.store import demo_pair_paths
        args.model = str(demo_pair_paths()[0])
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    session = open_session(ModelOptions(model=args.model, n_threads=args.threads, n_ctx=4096))
    decoder = session.decoder
    configs = ggufspec_configs(session.draft_choice, [int(k) for k in args.fixed.split(",") if k])
    servers = {}
    if args.llama_server:
        for name, extra in LLAMA_SERVER_CONFIGS.items():
            servers[name] = start_llama_server(args.llama_server, session.target_path, args.threads, extra,
                                               Path(f"/tmp/{name.replace(' ', '-')}.log"))
    names = list(configs) + list(servers)
    runs = []
    try:
        for rep in range(args.repeat):
            for number, item in enumerate(prompts):
                text = prompt_text(decoder, item)
                shift = (rep * len(prompts) + number) % len(names)
                for name in names[shift:] + names[:shift]:
                    result = (run_ggufspec(decoder, text, configs[name], args.n_predict) if name in configs
                              else run_llama_server(servers[name][1], text, args.n_predict))
                    result.update(prompt=item["id"], copies=item.get("copies", False), config=name, repeat=rep,
                                  load=os.getloadavg()[0])
                    runs.append(result)
                    print(f"{item['id']:>16} {name:>26} {result['tps']:7.2f} tok/s  drafted {result['drafted']:4d} "
                          f"accepted {result['accepted']:4d}  load {result['load']:.1f}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        decoder.close()
    report = {"draft_choice": session.draft_choice, "n_predict": args.n_predict, "repeat": args.repeat,
              "threads": args.threads, "cpu": cpu_name(), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(markdown(runs, names))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def markdown(runs: list[dict], names: list[str]) -> str:
    """Per prompt: median tok/s of each configuration and its speedup over the same engine's target
    alone; then the median speedup over the copying prompts and over the others."""
    def baseline(name):
        return "llama-server target" if name.startswith("llama-server") else "target"
    prompts = list(dict.fromkeys(r["prompt"] for r in runs))
    tps = {(p, n): statistics.median(r["tps"] for r in runs if r["prompt"] == p and r["config"] == n)
           for p in prompts for n in names}
    same = {(p, n): all(r["text"] == s["text"] for r in runs if r["prompt"] == p and r["config"] == n
                        for s in runs if s["prompt"] == p and s["config"] == "target")
            for p in prompts for n in names}
    lines = ["| prompt | copies | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for p in prompts:
        copies = next(r["copies"] for r in runs if r["prompt"] == p)
        cells = [f"{tps[p, n]:.2f} ({tps[p, n] / tps[p, baseline(n)]:.2f}x){'' if same[p, n] else ' *'}" for n in names]
        lines.append(f"| {p} | {'yes' if copies else 'no'} | " + " | ".join(cells) + " |")
    for label, wanted in (("median, copying", True), ("median, not copying", False)):
        chosen = [p for p in prompts if next(r["copies"] for r in runs if r["prompt"] == p) == wanted]
        if chosen:
            cells = [f"{statistics.median(tps[p, n] / tps[p, baseline(n)] for p in chosen):.2f}x" for n in names]
            lines.append(f"| **{label}** | | " + " | ".join(cells) + " |")
    lines.append("\n(tok/s, median over repeats; speedup against the same engine's target alone; "
                 "* : some run's text differs from ggufspec's target alone)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
