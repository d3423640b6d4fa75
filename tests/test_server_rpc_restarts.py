"""A worker that answers but cannot take the model: it runs out of memory while the model loads (a real
worker whose address space is then capped, RLIMIT_AS, so that ggml's allocation of the weights fails as
on a machine without the memory; its --mem only changes what it reports). `run --rpc` and a first
`serve --rpc` end with one line naming it (llama.cpp's log names the buffer it could not allocate, its
exception only "Failed to load model from file": load.load_failure); a `serve --rpc` that had served starts its model process
again with growing waits (supervisor.Backoff), /health saying when, and serves again once the worker can."""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ggufspec.server.supervisor import HEALTHY_S, RESTART_BACKOFF_S, Backoff
from ggufspec.tinymodels import Shape, make_pair
from rpcworkers import MiB, Worker
from serverproc import GGUFSPEC, start_server, stop_server

HEADROOM = 16 * MiB  # what the capped worker may still map: far less than the target's weights (~50 MiB)
OUT_OF_MEMORY = "ran out of memory"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="caps a worker's memory with prlimit, reads /proc")


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    """The tiny chat pair's vocabulary with wide feed-forward layers: a target of about 50 MiB."""
    target, draft = make_pair(tmp_path_factory.mktemp("rpc-big-pair"), seed=0,
                              shape=Shape(n_embd=256, n_ff=8192, eos_bias=4.0))
    assert target.stat().st_size > 3 * HEADROOM
    return target, draft


@pytest.fixture
def worker(needs_rpc, tmp_path):
    started = Worker(tmp_path)
    yield started
    started.stop()


def mapped(worker: Worker) -> int:
    status = Path(f"/proc/{worker.process.pid}/status").read_text()
    return int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024


def cap_memory(worker: Worker, before_the_model: int) -> None:
    """From now on the worker cannot map more than HEADROOM beyond what it had before any model came
    (the buffers it may hold meanwhile stay; freed, they no longer fit). The hard limit stays: `uncap_memory`."""
    hard = resource.prlimit(worker.process.pid, resource.RLIMIT_AS)[1]
    resource.prlimit(worker.process.pid, resource.RLIMIT_AS, (before_the_model + HEADROOM, hard))


def uncap_memory(worker: Worker) -> None:
    hard = resource.prlimit(worker.process.pid, resource.RLIMIT_AS)[1]
    resource.prlimit(worker.process.pid, resource.RLIMIT_AS, (hard, hard))


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ggufspec: error:")]


def assert_names_the_worker(line: str, worker: Worker) -> None:
    assert f"the RPC worker {worker.endpoint} {OUT_OF_MEMORY}" in line and "-ngl N" in line, line


def health(server) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=30)


def wait_for(server, condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert server.proc.poll() is None, server.log.read_text()
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.05)


class ModelProcesses:
    """The server's model processes as polled from outside (`seen`): when each was first and last seen."""

    def __init__(self, server):
        self.front = psutil.Process(server.proc.pid)
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.seen()

    def seen(self) -> bool:
        now, alive = time.monotonic(), {child.pid for child in self.front.children()}
        self.started.update((pid, now) for pid in alive - self.started.keys())
        self.ended.update((pid, now) for pid in self.started.keys() - alive - self.ended.keys())
        return True

    def idle_gaps(self) -> list[float]:
        """For each process that ended, the time until the next one started (give or take a poll)."""
        order = sorted(self.started, key=self.started.get)
        return [self.started[b] - self.ended[a] for a, b in zip(order, order[1:])]


def test_a_worker_out_of_memory_is_named_by_run(big_pair, worker, tmp_path):
    cap_memory(worker, mapped(worker))
    target, draft = big_pair
    done = subprocess.run([GGUFSPEC, "run", "-m", str(target), "-md", str(draft), "--rpc", str(worker.endpoint),
                           "-n", "4", "-p", "the cat", "-t", "1"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GGUFSPEC_HOME": str(tmp_path)})
    assert done.returncode == 2 and len(errors(done.stderr)) == 1, done.stderr  # a load error (ModelFileError)
    assert_names_the_worker(errors(done.stderr)[0], worker)
    assert "failed to allocate" in worker.log.read_text()  # the worker's own account: it was its memory


def test_a_worker_out_of_memory_at_the_first_load_stops_serve_in_one_line(big_pair, worker, tmp_path):
    cap_memory(worker, mapped(worker))
    target, draft = big_pair
    done = subprocess.run([GGUFSPEC, "serve", "--port", "0", "-t", "1", "-m", str(target), "-md", str(draft),
                           "--rpc", str(worker.endpoint)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GGUFSPEC_HOME": str(tmp_path)})
    assert done.returncode == 2 and len(errors(done.stderr)) == 1, done.stderr
    assert_names_the_worker(errors(done.stderr)[0], worker)
    assert "starting it again" not in done.stderr and "Traceback" not in done.stderr


def test_quick_failures_wait_longer_each_time_then_the_model_is_back(big_pair, worker, tmp_path):
    """Served once; then the worker answers but cannot take the model: each start fails within seconds.
    The model process is started again at once, then after 1, 2 and 4 s (said on stderr, and seen between
    one process's end and the next one's start); /health names the worker and when the next start is;
    once the worker has the memory again, the model is back."""
    target, draft = big_pair
    before_the_model = mapped(worker)
    server = start_server(tmp_path, "-m", str(target), "-md", str(draft), "--rpc", str(worker.endpoint))
    try:
        wait_for(server, lambda: health(server).status_code == 200, 60)
        processes = ModelProcesses(server)
        cap_memory(worker, before_the_model)
        psutil.Process(server.proc.pid).children()[0].send_signal(signal.SIGKILL)  # restarted into the capped worker
        wait_for(server, lambda: processes.seen() and "failed 4 times in a row" in server.log.read_text(), 40)
        down = health(server)
        assert down.status_code == 503 and down.json()["status"] == "unavailable", down.text
        message = down.json()["error"]["message"]
        assert_names_the_worker(message, worker)
        pending = r"failed 4 times in a row: a restart is pending, in 4 s at \d\d:\d\d:\d\d\)$"
        assert re.search(pending, message), message
        uncap_memory(worker)
        wait_for(server, lambda: processes.seen() and health(server).status_code == 200, 30)
        log = server.log.read_text()
        waits = [RESTART_BACKOFF_S[0] * 2 ** i for i in range(3)]
        assert [float(s) for s in re.findall(r"in a row; starting it again in ([\d.]+) s", log)] == waits, log
        idle = processes.idle_gaps()
        assert len(idle) == 4, idle  # 0.2 s: the polls' granularity
        assert all(w - 0.2 <= gap < w + 1 for gap, w in zip(idle, [0.0, *waits])), idle
        assert sum(OUT_OF_MEMORY in line for line in errors(log)) == 3 and "the model is back" in log
    finally:
        stop_server(server)


def test_the_backoff_doubles_to_its_cap_and_starts_over_after_a_healthy_serve():
    backoff, quick = Backoff(), HEALTHY_S / 2
    first_waits = [backoff.after(quick) for _ in range(4)]
    assert first_waits == [0.0, RESTART_BACKOFF_S[0], 2 * RESTART_BACKOFF_S[0], 4 * RESTART_BACKOFF_S[0]]
    assert max(backoff.after(quick) for _ in range(20)) == RESTART_BACKOFF_S[1]
    assert backoff.after(HEALTHY_S) == 0.0 and backoff.after(quick) == RESTART_BACKOFF_S[0]
