"""`ggufspec serve --rpc`: the HTTP front stays in this process, the model lives in a child process.

ggml-rpc aborts the process that loses a worker mid-call (GGML_ABORT: the call never returns), so a
server whose target is on workers cannot survive that in one process. Here the child runs the usual
`serve` (the same command line, serving a Unix socket this process made), and this process:
- forwards every request to it (`proxy`), and answers 503 with what happened while it is gone;
- watches it: the child's /health says how long its generation has made no progress
  (`stalled_s`); past --rpc-timeout the worker is taken as hung and the child is killed;
- when the child is gone, probes the workers (ggml-rpc's handshake) with backoff and starts a new
  child once every one answers; /health is 503 meanwhile, 200 again once the model is back. A child
  that fails soon after it started (in its load, or serving) again and again waits longer and longer
  before the next start (`Backoff`): workers that answer the probe but cannot take the model are not
  hammered, and stderr not filled.
The child's stderr passes through, so the lines users see stay those of a plain `serve`.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time

import uvicorn

from ..errors import GgufspecError
from ..rpc import Endpoint, RpcError, parse_endpoints, probe
from .errors import error_body
from .guard import Exposure, Guard
from .listen import STOP_DEADLINE_S, STOP_GRACE_S, exit_by_deadline, uvicorn_logging
from .proxy import ChildGone, ask, get_scope, proxy_app

# What happens after a worker is lost: the child's abort line says it too (`faults.set_abort_consequence`).
RECOVERY = "the server answers 503 until the worker is back, then reloads the model (retrying)"
FIRST_LOAD = "the server stops, having never served: start it again once the worker is back"
SERVING = "ggufspec: serving "  # the line `listen.serve_forever` prints once the model is up
ERROR = "ggufspec: error: "
WATCH_EVERY_S = 1.0
BACKOFF_S = (0.5, 5.0)  # first and longest wait between probes of the workers
PROBE_TIMEOUT_S = 2.0  # a worker's handshake, while waiting for it to come back
NAMING_TIMEOUT_S = 1.0  # the same, to name the hung one (a 503 waits for it)
HEALTH_TIMEOUT_S = 5.0  # the least wait for the model process's /health: a slow answer is no stalled generation
# A model process that served less than HEALTHY_S failed quickly: the second such failure in a row waits
# RESTART_BACKOFF_S[0] before the next start, each next one twice as long, up to RESTART_BACKOFF_S[1].
# The first restarts at once (a lost worker back on its port reloads without delay); one that served
# HEALTHY_S or more starts the count over.
RESTART_BACKOFF_S = (1.0, 30.0)
HEALTHY_S = 60.0


class Child:
    """One model process, and why it ended (`problem`: the 503's message and code)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.ready, self.gone = asyncio.Event(), asyncio.Event()
        self.connections: set = set()  # open forwardings' writers, cut when the child is gone
        self.last_error: str | None = None  # its last "ggufspec: error: ..." line, without the prefix
        self.hung = False
        self.problem = ("the model process stopped", "model_unavailable")
        self.ready_at: float | None = None  # when it began to serve (time.monotonic())

    def served_s(self) -> float:
        return time.monotonic() - self.ready_at if self.ready_at is not None else 0.0

    async def why(self, wait_s: float = 10.0) -> tuple[str, str]:
        """The problem, once the supervisor has seen the child go (a connection may break first)."""
        try:
            await asyncio.wait_for(self.gone.wait(), wait_s)
        except asyncio.TimeoutError:
            return "the model process broke the connection and did not end", "model_unavailable"
        return self.problem


async def first(awaitable, event: asyncio.Event):
    """`awaitable`'s result, or None when `event` is set first (it is then cancelled)."""
    task, waiting = asyncio.ensure_future(awaitable), asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for pending in (task, waiting):
            pending.cancel()


class Backoff:
    """The wait before the next model process, from how long each one served (see RESTART_BACKOFF_S)."""

    def __init__(self):
        self.failures = 0  # in a row; a process that served HEALTHY_S or more counts its own failure as the first

    def after(self, served_s: float) -> float:
        self.failures = 1 if served_s >= HEALTHY_S else self.failures + 1
        if self.failures == 1:
            return 0.0
        return min(RESTART_BACKOFF_S[0] * 2 ** (self.failures - 2), RESTART_BACKOFF_S[1])


class Supervisor:
    def __init__(self, command: list[str], socket_path: str, socket_fd: int, endpoints: list[Endpoint],
                 rpc_timeout: float, exposure: Exposure | None = None, tls=None, front=None):
        self.command, self.socket_path, self.socket_fd = command, socket_path, socket_fd
        self.front = front  # front.Front: --api-prefix and --timeout, here where the clients are
        self.tls = tls  # listen.Tls: the front speaks HTTPS, the model process plain on its Unix socket
        self.endpoints, self.rpc_timeout, self.exposure = endpoints, rpc_timeout, exposure or Exposure()
        self.child: Child | None = None
        self.state = "loading"  # loading | ready | unavailable
        self.problem = ("the model is loading", "model_loading")
        self.served_once = False
        self.backoff = Backoff()
        self.stopping = False
        self.exit_code = 0

    # -- what the front asks ----------------------------------------------------------------------

    def ready_child(self) -> Child | None:
        child = self.child
        return child if self.state == "ready" and child is not None and not child.gone.is_set() else None

    def unavailable(self, path: str) -> tuple[int, dict]:
        """The 503 while no model process serves: /health in llama-server's spirit, the rest in their
        protocol's shape."""
        message, code = self.problem
        body = error_body(path, 503, message, "server_error", code)
        return 503, ({"status": self.state, **body} if path in ("/health", "/v1/health") else body)

    # -- the loop ---------------------------------------------------------------------------------

    async def main(self, sock: socket.socket) -> None:
        # Host, origin, key and body cap are checked here, in front (the model process trusts this one), so
        # that a client without the key learns nothing, the model up or not, and a large body is never read
        app = Guard(proxy_app(self), self.exposure)
        config = uvicorn.Config(self.front.wrap(app) if self.front else app, **uvicorn_logging(),
                                lifespan="off", timeout_graceful_shutdown=STOP_GRACE_S,
                                **(self.tls.uvicorn_options() if self.tls else {}))
        supervisor = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if not supervisor.stopping:
                    supervisor.stopping = True  # Ctrl-C reaches the child too: its exit is no fault then
                    child = supervisor.child  # SIGTERM may not: the child stops its generations meanwhile
                    if sig != signal.SIGINT and child is not None and child.proc.returncode is None:
                        child.proc.send_signal(signal.SIGTERM)
                    exit_by_deadline(STOP_DEADLINE_S + 2)  # the child's own deadline, and its last lines
                super().handle_exit(sig, frame)
        server = Server(config)
        for sig in (signal.SIGINT, signal.SIGTERM):  # what uvicorn restores, and raises again, after serving
            signal.signal(sig, server.handle_exit)
        keeper = asyncio.ensure_future(self.keep_serving(server))
        keeper.add_done_callback(lambda task: self.keeper_ended(task, server))
        try:
            await server.serve(sockets=[sock])
        finally:
            self.stopping = True
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await self.stop_child()

    async def keep_serving(self, server: uvicorn.Server) -> None:
        """Start the model process, serve while it lives, and again once the workers answer (after a wait
        when it keeps failing soon: `back_off`). A first start that fails ends the server with the child's
        exit code (its one-line error was shown)."""
        while not self.stopping:
            child = await self.start_child()
            if await first(child.ready.wait(), child.gone) and not child.gone.is_set():
                self.served_once, self.state, child.ready_at = True, "ready", time.monotonic()
                await self.watch(child)
            await child.gone.wait()
            if not self.served_once:
                code = child.proc.returncode
                self.exit_code = 0 if self.stopping else code if code and code > 0 else 1
                server.should_exit = True
                return
            self.state, self.problem = "unavailable", child.problem
            await self.back_off(child)
            await self.wait_for_workers()
            self.state = "loading"
            self.problem = (f"the model is reloading (after: {child.problem[0]})", "model_loading")

    def keeper_ended(self, task: asyncio.Task, server: uvicorn.Server) -> None:
        """Without its keeper the front would answer 503 for ever: a failure there ends the server."""
        if task.cancelled() or task.exception() is None:
            return
        sys.stderr.write(f"{ERROR}the model process could not be supervised: {task.exception()!r}\n")
        self.exit_code, server.should_exit = 1, True

    async def start_child(self) -> Child:
        reload = {"GGUFSPEC_SERVED_ONCE": "1"} if self.served_once else {}  # what its abort line may promise
        proc = await asyncio.create_subprocess_exec(*self.command, stdin=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, pass_fds=(self.socket_fd,),
                                                    limit=1 << 20, env={**os.environ, **reload})
        self.child = child = Child(proc)
        asyncio.ensure_future(self.follow(child))
        return child

    async def follow(self, child: Child) -> None:
        """Pass the child's stderr through; when it ends, say why and cut its open forwardings."""
        while True:
            try:
                raw = await child.proc.stderr.readline()
            except ValueError:  # a line past the 1 MiB limit: dropped, the rest goes on
                continue
            if not raw:
                break
            self.pass_line(child, raw.decode("utf-8", errors="replace"))
        code = await child.proc.wait()
        child.problem = await self.problem_of(child, code)
        if child.problem[0] != child.last_error and not self.stopping:  # the child could not say it itself
            sys.stderr.write(f"{ERROR}{child.problem[0]}\n")
        for writer in list(child.connections):
            writer.transport.abort()
        child.gone.set()

    def pass_line(self, child: Child, line: str) -> None:
        if line.startswith(SERVING):
            if self.served_once:
                line = "ggufspec: the RPC workers answer again: the model is back\n"
            child.ready.set()
        elif line.startswith(ERROR):
            child.last_error = line[len(ERROR):].strip()
        sys.stderr.write(line)
        sys.stderr.flush()

    async def problem_of(self, child: Child, code: int) -> tuple[str, str]:
        if self.stopping:
            return "the server is shutting down", "shutting_down"
        if child.hung:
            named = await self.silent_workers(NAMING_TIMEOUT_S) or self.endpoints
            who = f"worker{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}"
            return (f"the RPC {who} stopped answering: no progress for {self.rpc_timeout:g} s (--rpc-timeout); "
                    f"{RECOVERY}", "worker_timeout")
        if child.last_error:
            return child.last_error, "worker_lost"
        return f"the model process ended (exit code {code}); {RECOVERY}", "worker_lost"

    async def watch(self, child: Child) -> None:
        """Until the child is gone: every second, ask it how long its generation has been stalled;
        past --rpc-timeout (or no answer within it), kill it."""
        while not child.gone.is_set():
            if await first(asyncio.sleep(WATCH_EVERY_S, True), child.gone) is None:
                return
            stalled = await first(self.stalled_seconds(), child.gone)
            if child.gone.is_set():
                return
            if stalled is None or stalled > self.rpc_timeout:
                child.hung = True
                child.proc.kill()
                return

    async def stalled_seconds(self) -> float | None:
        """How long the child's generation has made no progress; None when it does not say within --rpc-timeout
        (at least HEALTH_TIMEOUT_S: with a small --rpc-timeout an idle model process was killed as hung)."""
        try:
            status, body = await ask(self.socket_path, get_scope("/health"), b"", max(self.rpc_timeout, HEALTH_TIMEOUT_S))
            return float(json.loads(body).get("stalled_s", 0.0))
        except (asyncio.TimeoutError, ChildGone, OSError, ValueError):
            return None

    async def silent_workers(self, timeout: float = PROBE_TIMEOUT_S) -> list[Endpoint]:
        """The workers that do not complete ggml-rpc's handshake within `timeout` (gone, or hung), asked at once."""
        def answers(endpoint: Endpoint) -> bool:
            try:
                probe(endpoint, timeout)
                return True
            except RpcError:
                return False
        answered = await asyncio.gather(*(asyncio.to_thread(answers, e) for e in self.endpoints))
        return [endpoint for endpoint, ok in zip(self.endpoints, answered) if not ok]

    async def back_off(self, child: Child) -> None:
        """Wait before the next start as long as `backoff` says; said once on stderr, and in /health meanwhile."""
        delay = self.backoff.after(child.served_s())
        if not delay or self.stopping:
            return
        when = time.strftime("%H:%M:%S", time.localtime(time.time() + delay))
        failed = f"the model process failed {self.backoff.failures} times in a row"
        sys.stderr.write(f"ggufspec: {failed}; starting it again in {delay:g} s\n")
        sys.stderr.flush()
        message, code = child.problem
        self.problem = (f"{message} ({failed}: a restart is pending, in {delay:g} s at {when})", code)
        await asyncio.sleep(delay)
        self.problem = child.problem

    async def wait_for_workers(self) -> None:
        delay = BACKOFF_S[0]
        while not self.stopping and await self.silent_workers():
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_S[1])

    async def stop_child(self) -> None:
        child = self.child
        if child is None:
            return
        if child.proc.returncode is None:
            child.proc.terminate()
            try:
                await asyncio.wait_for(child.proc.wait(), STOP_DEADLINE_S + 1)
            except asyncio.TimeoutError:
                child.proc.kill()
        await first(asyncio.sleep(5), child.gone)  # its last lines passed through


def supervise(sock: socket.socket, *, rpc: str, rpc_timeout: float, argv: list[str],
              exposure: Exposure | None = None, tls=None, front=None) -> int:
    """Serve `sock` with the model in a child process (`ggufspec serve ARGV` on a Unix socket); the exit code."""
    endpoints = parse_endpoints(rpc)
    if "serve" not in argv:  # the child is this command line again
        raise GgufspecError("serve --rpc runs its model in a child process: start it as a command (ggufspec serve ...)")
    host, port = sock.getsockname()[:2]  # as the model process will print them
    with tempfile.TemporaryDirectory(prefix="ggufspec-serve-") as folder:
        path = os.path.join(folder, "model.sock")  # a private folder: only this user reaches it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as model_sock:
            model_sock.bind(path)
            model_sock.listen(64)
            model_sock.set_inheritable(True)
            command = [sys.executable, "-m", "ggufspec.cli", *argv, "--host", host, "--port", str(port),
                       "--serve-fd", str(model_sock.fileno())]
            supervisor = Supervisor(command, path, model_sock.fileno(), endpoints, rpc_timeout, exposure, tls, front)
            asyncio.run(supervisor.main(sock))
    return supervisor.exit_code


def supervised_socket(fd: int, rpc: str | None) -> socket.socket:
    """In the model process: the socket the supervisor made; the abort line says the server goes on;
    a worker that closes its connection ends the process at once (not at the next request); and the
    process ends when the supervisor does (its stdin closes)."""
    from ..rpc import faults
    # until it first serves, a lost worker ends the server (`keep_serving`); after that it recovers
    faults.set_abort_consequence(RECOVERY if os.environ.get("GGUFSPEC_SERVED_ONCE") else FIRST_LOAD)
    if rpc:
        faults.exit_when_a_worker_leaves(parse_endpoints(rpc))

    def exit_with_parent():
        while os.read(0, 4096):  # os.read, not sys.stdin: a buffered reader's lock blocks the interpreter's exit
            pass
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=exit_with_parent, daemon=True, name="ggufspec-parent-watch").start()
    return socket.socket(fileno=fd)
