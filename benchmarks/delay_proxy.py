"""A TCP forwarder that adds a fixed one-way delay to every chunk, in each direction, keeping order:
a stand-in for the network between a host and its RPC workers.

    python benchmarks/delay_proxy.py --delay-ms 5 0=127.0.0.1:50052 0=127.0.0.1:50053

Each ROUTE is LISTEN_PORT=HOST:PORT (port 0: any free port). Once listening it prints
`ready PORT...` (the ports actually bound, in route order). A line `delay MS` on stdin changes the
delay for what arrives from then on and is answered `ok MS`; `stats` is answered
`turns N`, the request/reply round trips seen so far. `DelayProxy` runs it as a subprocess.

Why threads and not asyncio: a chunk is held until `arrival + delay` with time.sleep, which keeps to
tens of microseconds; asyncio's timers go through epoll's millisecond timeouts, rounded up, which
would add up to 1 ms to a 1 ms delay. Only the latency is modelled: bandwidth is loopback's.
"""
from __future__ import annotations

import argparse
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

CHUNK = 1 << 16


class Delay:
    """The one-way delay in seconds, shared by every connection and changed from stdin."""
    seconds = 0.0


class Turns:
    """Round trips seen: a chunk from a worker after one from its host, on the same connection (a
    host that waits for each answer pays one network round trip per turn). `stats` on stdin reads it."""
    count = 0


def receive(source: socket.socket, pending: queue.Queue, direction: str, last: list) -> None:
    """Stamp each chunk with the time it may leave; b"" marks the end of the stream."""
    try:
        while chunk := source.recv(CHUNK):
            if last[0] != direction:
                last[0] = direction
                Turns.count += direction == "reply"
            pending.put((time.perf_counter() + Delay.seconds, chunk))
    except OSError:
        pass
    pending.put((time.perf_counter() + Delay.seconds, b""))


def send(pending: queue.Queue, dest: socket.socket, peer: socket.socket) -> None:
    """Forward chunks in arrival order, each no earlier than its stamp."""
    try:
        while True:
            due, chunk = pending.get()
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if not chunk:
                dest.shutdown(socket.SHUT_WR)  # pass the half-close on
                return
            dest.sendall(chunk)
    except OSError:  # the other side is gone: end both directions
        for sock in (dest, peer):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def forward(client: socket.socket, upstream_address: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(upstream_address)
    except OSError:
        client.close()
        return
    threads, last = [], [None]  # the direction of this connection's latest chunk
    for source, dest, direction in ((client, upstream, "request"), (upstream, client, "reply")):
        source.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # ggml-rpc sets it too
        pending: queue.Queue = queue.Queue()
        threads += [threading.Thread(target=receive, args=(source, pending, direction, last), daemon=True),
                    threading.Thread(target=send, args=(pending, dest, source), daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    upstream.close()


def listen(port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    return server


def accept_loop(server: socket.socket, upstream_address: tuple[str, int]) -> None:
    while True:
        client, _ = server.accept()
        threading.Thread(target=forward, args=(client, upstream_address), daemon=True).start()


def parse_route(text: str) -> tuple[int, tuple[str, int]]:
    listen_port, _, upstream = text.partition("=")
    host, _, port = upstream.rpartition(":")
    if not listen_port.isdigit() or not host or not port.isdigit():
        raise SystemExit(f"route {text!r}: write it as LISTEN_PORT=HOST:PORT")
    return int(listen_port), (host, int(port))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per chunk (ms)")
    parser.add_argument("routes", nargs="+", metavar="LISTEN_PORT=HOST:PORT")
    args = parser.parse_args()
    Delay.seconds = args.delay_ms / 1000
    servers = [(listen(port), upstream) for port, upstream in map(parse_route, args.routes)]
    for server, upstream in servers:
        threading.Thread(target=accept_loop, args=(server, upstream), daemon=True).start()
    print("ready", *(server.getsockname()[1] for server, _ in servers), flush=True)
    for line in sys.stdin:  # the controlling process ends us by closing stdin
        word, _, value = line.strip().partition(" ")
        if word == "delay":
            Delay.seconds = float(value) / 1000
            print(f"ok {value}", flush=True)
        elif word == "stats":
            print(f"turns {Turns.count}", flush=True)


class DelayProxy:
    """The proxy as a subprocess: `ports` (one per upstream, in order), `set_delay(ms)`, `close()`."""

    def __init__(self, upstreams: list[tuple[str, int]], delay_ms: float = 0.0):
        routes = [f"0={host}:{port}" for host, port in upstreams]
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--delay-ms", str(delay_ms),
                                         *routes], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        word, *ports = self.process.stdout.readline().split()
        if word != "ready":
            self.close()
            raise RuntimeError("the delay proxy did not start")
        self.ports = [int(port) for port in ports]
        self.delay_ms = delay_ms

    def set_delay(self, delay_ms: float) -> None:
        self.process.stdin.write(f"delay {delay_ms}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        if answer != f"ok {delay_ms}":
            raise RuntimeError(f"the delay proxy answered {answer!r}")
        self.delay_ms = delay_ms

    def round_trips(self) -> int:
        """Round trips (host request, then worker reply) through the proxy so far, all connections."""
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        word, count = self.process.stdout.readline().split()
        return int(count)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    main()
