"""The target alone's decode speed inside each server: the same greedy answer (256 tokens by default)
through ggufspec serve and llama-server (`-fa off` and `-fa on`), whole and streamed, rounds interleaved
(round 8 saw llama.cpp decode slower inside ggufspec's server process on an AMD EPYC; round 34 did not).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/server_decode.py [--tokens 256] [--rounds 2] [--threads 2]

One line per answer: the server's own `timings.predicted_per_second`, tokens and wall time; a JSON summary last.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import LLAMA_SERVER, Server, cpu_name, demo_pair, free_port  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a Python module with a class Inventory that stores items with names, "
             "quantities and prices, with methods to add, remove, list and total them, and docstrings."}]


def ask(url: str, stream: bool, n_tokens: int) -> tuple[float, int, float]:
    body = {"messages": MESSAGES, "max_tokens": n_tokens, "temperature": 0, "stream": stream, "cache_prompt": False}
    sent = time.perf_counter()
    if not stream:
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
        return answer["timings"]["predicted_per_second"], answer["usage"]["completion_tokens"], time.perf_counter() - sent
    timings = usage = None
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                timings, usage = chunk.get("timings") or timings, chunk.get("usage") or usage
    return timings["predicted_per_second"], usage["completion_tokens"], time.perf_counter() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    target, _ = demo_pair()
    threads = ["-t", str(args.threads)]
    ggufspec = [str(Path(sys.executable).parent / "ggufspec"), "serve", "-m", str(target), *threads, "-c", "4096",
                "--host", "127.0.0.1", "--no-draft", "--draft", "0"]
    llama = [str(LLAMA_SERVER), "-m", str(target), *threads, "-tb", str(args.threads), "-c", "4096", "-np", "1", "--jinja",
             "--host", "127.0.0.1"]
    servers = {"ggufspec": ggufspec, "llama-server -fa off": llama + ["-fa", "off"], "llama-server -fa on": llama + ["-fa", "on"]}
    env = {**os.environ, "GGUFSPEC_HOME": tempfile.mkdtemp()}
    print(f"CPU: {cpu_name()}, {args.threads} threads", flush=True)
    results: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        for name in list(servers) if round_index % 2 == 0 else list(servers)[::-1]:
            port = free_port()
            log = Path(tempfile.gettempdir()) / f"server_decode-{name.replace(' ', '_')}.log"
            with Server(name, servers[name] + ["--port", str(port)], port, log, env=env) as server:
                ask(server.url, False, 8)  # a first answer: whatever a new process does once
                for stream in (False, True):
                    tps, n, wall = ask(server.url, stream, args.tokens)
                    results.setdefault(f"{name}, {'streamed' if stream else 'whole'}", []).append(round(tps, 2))
                    print(f"round {round_index} {name} {'streamed' if stream else 'whole'}: {tps:.2f} tok/s decode, "
                          f"{n} tokens, {wall:.1f} s", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
