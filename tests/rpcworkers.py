"""RPC workers as separate processes on loopback ports, for the tests that need them."""
import socket
import subprocess
import sys
import time
from pathlib import Path

from ggufspec import rpc

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """`start_worker` in its own process (the `ggufspec worker` command's body)."""

    def __init__(self, log_dir: Path, mem: int | None = None, cache: Path | None = None, port: int | None = None):
        self.port = port or free_port()  # a port given: a worker started again where one was
        self.endpoint = rpc.Endpoint("127.0.0.1", self.port)
        self.log = log_dir / f"worker-{self.port}.log"
        cache_dir = cache and str(cache)
        code = ("from ggufspec.rpc import start_worker; "
                f"start_worker('127.0.0.1', {self.port}, threads=1, mem={mem!r}, cache_dir={cache_dir!r})")
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=log, stderr=log)
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited {self.process.returncode}: {self.log.read_text()}")
            try:
                rpc.probe(self.endpoint, timeout=1.0)
                return
            except rpc.WorkerUnreachableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
