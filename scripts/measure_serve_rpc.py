"""What `serve --rpc`'s supervisor costs and how fast it reacts, on the tiny test pair and one local worker.

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python scripts/measure_serve_rpc.py [N]

1. Per-request overhead of the proxy: the same request (16 tokens, greedy) through the front and straight to
   the model process's Unix socket, interleaved, N times each; medians and their ratio.
   And a 400-token stream, the same way.
2. A worker killed: time to the next request's 503; started again: time until /health is 200.
3. A worker stopped (SIGSTOP) with --rpc-timeout 3: time to the 503; SIGCONT: time until /health is 200.
"""
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from rpcworkers import Worker
from serverproc import make_chat_pair, start_server, stop_server

STREAM = {"model": "target", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 400,
          "temperature": 0, "stream": True, "logit_bias": {"2": -100}}
BODY = {"model": "target", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 16, "temperature": 0}


def timed(client: httpx.Client, url: str) -> tuple[float, int]:
    start = time.perf_counter()
    status = client.post(url, json=BODY).status_code
    return time.perf_counter() - start, status


def streamed(client: httpx.Client, url: str) -> float:
    """Seconds for a 400-token stream, every chunk read."""
    start = time.perf_counter()
    with client.stream("POST", url, json=STREAM) as response:
        for _ in response.iter_lines():
            pass
    return time.perf_counter() - start


def until_healthy(url: str) -> float:
    start = time.perf_counter()
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        time.sleep(0.05)
    return time.perf_counter() - start


def main(n: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="measure-serve-rpc-"))
    worker = Worker(folder)
    target, draft = make_chat_pair(folder)
    server = start_server(folder, "-m", str(target), "-md", str(draft), "-c", "512", "--rpc", str(worker.endpoint),
                          "--rpc-timeout", "3")
    try:
        child = psutil.Process(server.proc.pid).children()[0]
        path = next(c.laddr for c in child.net_connections("unix") if c.laddr.endswith("model.sock"))
        front, direct = httpx.Client(timeout=60), httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=60)
        for _ in range(3):  # warm both
            timed(front, server.url + "/v1/chat/completions"), timed(direct, "http://model/v1/chat/completions")
        via, straight = [], []
        for _ in range(n):
            via.append(timed(front, server.url + "/v1/chat/completions")[0])
            straight.append(timed(direct, "http://model/v1/chat/completions")[0])
        a, b = statistics.median(via) * 1e3, statistics.median(straight) * 1e3
        print(f"request (16 tokens): through the front {a:.2f} ms, straight to the model process {b:.2f} ms "
              f"(median of {n}); ratio {a / b:.3f}, overhead {a - b:.2f} ms")

        via, straight = [], []
        for _ in range(max(n // 8, 3)):
            via.append(streamed(front, server.url + "/v1/chat/completions"))
            straight.append(streamed(direct, "http://model/v1/chat/completions"))
        a, b = statistics.median(via) * 1e3, statistics.median(straight) * 1e3
        print(f"stream (400 tokens): through the front {a:.1f} ms, straight {b:.1f} ms (median of {len(via)}); "
              f"ratio {a / b:.3f}, {(a - b) / 400 * 1e3:.0f} us a token")

        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
        seconds, status = timed(front, server.url + "/v1/chat/completions")
        print(f"worker killed: next request {status} after {seconds * 1e3:.0f} ms")
        worker.__init__(folder, port=worker.port)  # returns once the worker answers its handshake
        print(f"worker started again: /health 200 {until_healthy(server.url):.2f} s after it answered")

        os.kill(worker.process.pid, signal.SIGSTOP)
        seconds, status = timed(front, server.url + "/v1/chat/completions")
        print(f"worker stopped (--rpc-timeout 3): request {status} after {seconds:.2f} s")
        os.kill(worker.process.pid, signal.SIGCONT)
        print(f"worker continued: /health 200 after {until_healthy(server.url):.2f} s")
    finally:
        stop_server(server)
        worker.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
