"""A worker lost mid-run: one clear line and exit code 1 instead of ggml's abort; TCP keepalive so a cut network fails within a bound time."""
from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
import threading
import time
from typing import Callable, Sequence

from .endpoints import Endpoint, _as_endpoint, _ipv4_address
from .native import ABORT_EXIT_CODE, _native


# -- faults -------------------------------------------------------------------------------------------

_ABORT_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_installed_abort_callback = None  # kept alive: ggml holds only the raw pointer
_consequence = "the run cannot go on"  # what the abort line says happens next
_line_start = ""  # written before the error line: "\n" while a progress bar holds stderr's current line
DEFAULT_STALL_S = 300.0  # run, chat and bench --rpc: no progress for this long is a hung worker (--rpc-timeout)


def set_abort_consequence(text: str) -> None:
    """What the abort line says happens next (`serve --rpc`'s model process: the server goes on)."""
    global _consequence
    _consequence = text


def error_lines_on_a_new_line(on: bool = True) -> None:
    """A progress bar (bench's) ends stderr's current line with no newline: start the error lines on their own."""
    global _line_start
    _line_start = "\n" if on else ""


def _dead_workers(endpoints: Sequence[Endpoint], timeout: float = 0.5) -> list[Endpoint]:
    """The workers whose port refuses connections. A killed worker's kernel may close the connection
    we were using a moment before its listening port, so look again briefly before saying none."""
    for delay in (0.0, 0.2, 0.5):
        time.sleep(delay)
        dead = []
        for endpoint in endpoints:
            try:
                socket.create_connection((endpoint.host, endpoint.port), timeout=timeout).close()
            except ConnectionRefusedError:
                dead.append(endpoint)
            except OSError:  # a busy worker's full accept queue times out: alive, as far as we know
                pass
        if dead:
            return dead
    return []


def abort_message(ggml_message: str, endpoints: Sequence[Endpoint]) -> str | None:
    """The line to print for a GGML_ABORT, or None when it is not about RPC."""
    if "ggml-rpc" not in ggml_message and "RPC" not in ggml_message:
        return None
    dead = _dead_workers(endpoints)
    if dead:
        who = ", ".join(map(str, dead))
        return (f"ggufspec: error: lost the RPC worker{'s' if len(dead) > 1 else ''} {who} mid-run "
                f"(it stopped or its port closed); {_consequence}")
    who = ", ".join(map(str, endpoints)) or "(unknown)"
    return (f"ggufspec: error: lost the connection to the RPC worker(s) {who} mid-run (the worker crashed, "
            f"restarted or the network failed); {_consequence}")


def install_abort_message(endpoints: Sequence[Endpoint | str] = (),
                          on_abort: Callable[[str], None] | None = None) -> None:
    """Make a GGML_ABORT from ggml-rpc end the process with one clear line and exit code 1.

    ggml_abort calls this callback, then abort(): the process cannot continue (the failed call
    never returns), but the callback can explain and leave first. It names the worker(s) that no
    longer accept connections, calls `on_abort(ggml_message)` (e.g. to print partial stats; it
    runs on ggml's thread while the main thread is blocked inside llama.cpp), and exits with
    os._exit(1). Aborts unrelated to RPC get their message printed and abort as before.
    """
    global _installed_abort_callback
    known = [_as_endpoint(e) for e in endpoints]
    # llama-cpp-python points fd 2 at /dev/null while it loads a model: write to a copy made now
    stderr_fd = os.dup(2)

    def callback(raw: bytes | None) -> None:
        text = (raw or b"").decode("utf-8", errors="replace").strip()
        line = abort_message(text, known)
        os.write(stderr_fd, (_line_start + (line or f"ggufspec: error: llama.cpp aborted: {text}") + "\n").encode())
        if line is None:
            return  # ggml_abort goes on to abort()
        if on_abort is not None:
            try:
                on_abort(text)
            except BaseException:  # the process is ending: nothing may stop that
                pass
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(ABORT_EXIT_CODE)

    _installed_abort_callback = _ABORT_CALLBACK_TYPE(callback)
    _native().set_abort_callback(ctypes.cast(_installed_abort_callback, ctypes.c_void_p))


def lost_workers(addresses: dict[tuple[str, int], Endpoint]) -> list[Endpoint]:
    """The workers (by (IPv4, port)) that closed their connection from this process: stopped or restarted.
    ggml-rpc would only find out at its next call; the connection says it at once (CLOSE_WAIT)."""
    import psutil
    process = psutil.Process()
    connections = process.net_connections("tcp") if hasattr(process, "net_connections") else process.connections("tcp")
    closed = {(c.raddr.ip, c.raddr.port) for c in connections
              if c.raddr and c.status == psutil.CONN_CLOSE_WAIT}
    return [endpoint for address, endpoint in addresses.items() if address in closed]


def exit_when_a_worker_leaves(endpoints: Sequence[Endpoint | str], every_s: float = 1.0) -> None:
    """A thread that ends this process with one line and exit code 1 as soon as a worker closes its
    connection, idle or not (`serve --rpc`'s model process: its supervisor reloads the model when the
    worker is back, before a request would find it gone)."""
    known = [_as_endpoint(e) for e in endpoints]
    addresses = {(_ipv4_address(e), e.port): e for e in known}
    stderr_fd = os.dup(2)  # llama-cpp-python points fd 2 at /dev/null while a model loads

    def watch():
        while True:
            time.sleep(every_s)
            lost = lost_workers(addresses)
            if lost:
                who = ", ".join(map(str, lost))
                os.write(stderr_fd, (f"ggufspec: error: lost the RPC worker{'s' if len(lost) > 1 else ''} {who} "
                                     f"(it stopped or its port closed); {_consequence}\n").encode())
                os._exit(ABORT_EXIT_CODE)
    threading.Thread(target=watch, daemon=True, name="ggufspec-worker-watch").start()


class StallWatch:
    """Ends this process with one line and exit code 1 when the work it watches makes no progress for
    `timeout_s` seconds (`run`, `chat` and `bench --rpc`'s --rpc-timeout; `serve --rpc` has its supervisor).

    A worker stopped without closing its connection (SIGSTOP, a frozen machine) leaves ggml-rpc waiting
    for ever, and TCP keepalive cannot see it while the worker's kernel still answers. The work is watched
    only inside `armed()` (while the engine computes, not while a reader or a user is awaited), and
    progress is whatever `progress()` returns changing (tokens evaluated).
    """

    def __init__(self, endpoints: Sequence[Endpoint | str], timeout_s: float, progress: Callable[[], object],
                 on_stall: Callable[[], None] | None = None, every_s: float | None = None):
        self.endpoints = [_as_endpoint(e) for e in endpoints]
        self.timeout_s, self.progress, self.on_stall = timeout_s, progress, on_stall
        self._every_s = every_s or min(1.0, timeout_s / 4)
        self._lock = threading.Lock()
        self._armed, self._since, self._seen = 0, time.monotonic(), None
        self._stderr_fd = os.dup(2)  # llama-cpp-python points fd 2 at /dev/null while a model loads
        threading.Thread(target=self._watch, daemon=True, name="ggufspec-stall-watch").start()

    @contextlib.contextmanager
    def armed(self):
        with self._lock:
            if not self._armed:
                self._since, self._seen = time.monotonic(), self._read()
            self._armed += 1
        try:
            yield
        finally:
            with self._lock:
                self._armed -= 1

    def _read(self) -> object:
        try:
            return self.progress()
        except Exception:  # never taken for a hang: as progress
            return object()

    def _watch(self) -> None:
        while True:
            time.sleep(self._every_s)
            with self._lock:
                if not self._armed:
                    continue
                seen, now = self._read(), time.monotonic()
                if seen != self._seen:
                    self._seen, self._since = seen, now
                    continue
                if now - self._since < self.timeout_s:
                    continue
            self._stalled()

    def _stalled(self) -> None:
        who = ", ".join(map(str, self.endpoints))
        subject = f"one of the RPC workers {who}" if len(self.endpoints) > 1 else f"the RPC worker {who}"
        os.write(self._stderr_fd, (f"{_line_start}ggufspec: error: {subject} stopped answering: no progress for "
                                   f"{self.timeout_s:g} s (--rpc-timeout); {_consequence}\n").encode())
        if self.on_stall is not None:
            try:
                self.on_stall()
            except BaseException:  # the process is ending: nothing may stop that
                pass
        os._exit(ABORT_EXIT_CODE)


def keepalive(endpoints: Sequence[Endpoint | str], timeout_s: float = 30.0) -> int:
    """Make this process's open connections to the workers fail within ~timeout_s when the network is cut.

    ggml-rpc sets no timeouts: a worker whose machine vanishes without closing the connection
    would leave a call waiting forever. TCP keepalive (while waiting for an answer) and
    TCP_USER_TIMEOUT (for unacknowledged data) make the kernel drop such a connection, and
    ggml-rpc then aborts (see install_abort_message). A slow but live worker is not affected: its
    kernel keeps acknowledging. Call it after the target has loaded (the connection then exists).
    Returns the number of connections set; Linux-only options are skipped elsewhere.
    """
    import psutil
    wanted = {(_ipv4_address(e), e.port) for e in map(_as_endpoint, endpoints)}
    process = psutil.Process()
    connections = process.net_connections("tcp") if hasattr(process, "net_connections") else process.connections("tcp")
    count = 0
    for conn in connections:
        if conn.raddr and (conn.raddr.ip, conn.raddr.port) in wanted and conn.fd >= 0:
            with socket.socket(fileno=os.dup(conn.fd)) as sock:  # options live on the socket, not the fd
                _set_keepalive(sock, timeout_s)
            count += 1
    return count


def _set_keepalive(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval = max(1, int(timeout_s / 3)), max(1, int(timeout_s / 9))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
