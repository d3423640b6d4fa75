"""QA of the RPC flags from the command line: an empty --rpc or --mem, --rpc-mem matched to --rpc's workers,
a worker that stops without closing its connection (SIGSTOP), bench's lost-worker line. Real worker processes
on loopback (tests/rpcworkers.py), the tiny models written at test time."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import pytest

from ggufspec import rpc
from rpcworkers import REPO, Worker, free_port
from serverproc import GGUFSPEC

EMPTY_RPC = "ggufspec: error: --rpc '': give HOST:PORT[,HOST:PORT...] with no empty entries"


def last_error(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().split("\n")[-1]


# -- empty values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["plan"], ["run", "-p", "hi", "-n", "2"], ["chat"], ["bench"], ["serve", "--port", "0"],
                                     ["plan", "--rpc-mem", "127.0.0.1:50052=1GiB"]])
def test_an_empty_rpc_is_a_one_line_error(tiny_pair, command):
    """`plan --rpc ""` planned a local run (`if rpc:`)."""
    done = subprocess.run([GGUFSPEC, command[0], "-m", str(tiny_pair[0]), "--rpc", "", *command[1:]],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and last_error(done) == EMPTY_RPC, done.stderr


def test_open_decoder_with_an_empty_rpc_is_refused(tiny_pair):
    from ggufspec.session import open_decoder
    with pytest.raises(rpc.RpcError, match="no empty entries"):
        open_decoder(str(tiny_pair[0]), str(tiny_pair[1]), rpc="", n_ctx=256, n_threads=1)


@pytest.mark.parametrize("mem", ["--mem=", "--mem= "])
def test_an_empty_worker_mem_is_refused(needs_rpc, tmp_path, mem):
    """`ggufspec worker --mem=` served all its RAM, as if --mem were not given."""
    done = subprocess.run([GGUFSPEC, "worker", "--port", str(free_port()), mem], capture_output=True, text=True,
                          timeout=10, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert last_error(done) == ("ggufspec: error: --mem is empty: give the memory to offer, e.g. 24GiB "
                                "(or leave --mem out: all its RAM)")


# -- --rpc-mem: the workers of --rpc, however spelled ------------------------------------------------

def test_rpc_mem_matches_hosts_as_rpc_does(tiny_pair):
    """LOCALHOST:050052 is --rpc's localhost:50052: declared, so the (absent) worker is not asked."""
    from ggufspec.plan import read_shape
    from ggufspec.session import rpc_split
    port = free_port()  # nothing listens there: asking it would fail
    shares, _ = rpc_split(read_shape(str(tiny_pair[0])), f"localhost:{port}", [f"LOCALHOST:0{port}=1GiB"], 256)
    assert [(s.host, s.free) for s in shares[1:]] == [(f"localhost:{port}", 1 << 30)]


@pytest.mark.parametrize("declared, fragment", [
    (["10.0.0.9:{port}=1GiB"], "--rpc-mem names 10.0.0.9:{port}, which is none of --rpc's workers (localhost:{port})"),
    (["localhost:{other}=1GiB"], "--rpc-mem names localhost:{other}, which is none of --rpc's workers"),
    (["localhost:{port}=1GiB", "127.0.0.1:{port}=2GiB"], "--rpc-mem names the worker localhost:{port} twice"),
    (["localhost=1GiB"], "--rpc-mem: RPC worker 'localhost': write it as HOST:PORT"),
])
def test_rpc_mem_naming_no_rpc_worker_is_refused(tiny_pair, declared, fragment):
    """An --rpc-mem entry that --rpc does not list was ignored (and the worker asked instead)."""
    from ggufspec.plan import read_shape
    from ggufspec.session import rpc_split
    port, other = free_port(), free_port()
    with pytest.raises(rpc.RpcError) as info:
        rpc_split(read_shape(str(tiny_pair[0])), f"localhost:{port}",
                  [item.format(port=port, other=other) for item in declared], 256)
    assert str(info.value).startswith(fragment.format(port=port, other=other)) and "\n" not in str(info.value)


def test_rpc_mem_naming_no_rpc_worker_is_one_line_from_plan(tiny_pair):
    port = free_port()
    done = subprocess.run([GGUFSPEC, "plan", "-m", str(tiny_pair[0]), "--rpc", f"localhost:{port}", "--rpc-mem",
                           f"10.0.0.9:{port}=1GiB"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and last_error(done) == (f"ggufspec: error: --rpc-mem names 10.0.0.9:{port}, which is "
                                                         f"none of --rpc's workers (localhost:{port})"), done.stderr


# -- a worker that stops without closing its connection -----------------------------------------------

@pytest.fixture
def worker(needs_rpc, tmp_path):
    started = Worker(tmp_path)
    yield started
    started.process.send_signal(signal.SIGCONT)
    started.stop()


def test_a_stopped_worker_fails_the_probe_in_one_line(worker, tiny_pair):
    worker.process.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    done = subprocess.run([GGUFSPEC, "run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-p", "hi", "-n", "2",
                           "-t", "1", "--rpc", str(worker.endpoint)], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 20
    assert done.returncode == rpc.ABORT_EXIT_CODE, done.stderr
    line = last_error(done)
    assert line.startswith(f"ggufspec: error: RPC worker {worker.endpoint} ") and "stopped or frozen" in line, line


def wait_for(path, text: str, process, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while text not in path.read_text(errors="replace"):
        assert process.poll() is None and time.monotonic() < deadline, path.read_text(errors="replace")
        time.sleep(0.05)


@contextlib.contextmanager
def host_process(err, *args: str, out=None):
    """`ggufspec ARGS` in the background through the block (stderr to the file `err`, stdout to `out` or
    nowhere), killed if the block leaves it running."""
    with err.open("w") as stderr, (out.open("w") if out else contextlib.nullcontext(subprocess.DEVNULL)) as stdout:
        host = subprocess.Popen([GGUFSPEC, *args], stdout=stdout, stderr=stderr)
    try:
        yield host
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_a_worker_stopped_mid_generation_ends_run_after_rpc_timeout(worker, slow_target, tmp_path):
    """`run --rpc` waited for ever on a SIGSTOPped worker: its kernel keeps the connection open."""
    out, err = tmp_path / "out", tmp_path / "err"
    with host_process(err, "run", "-m", str(slow_target), "--no-draft", "-p", "the cat", "-n", "-1", "-t", "1",
                      "--rpc", str(worker.endpoint), "--rpc-timeout", "2", out=out) as host:
        deadline = time.monotonic() + 60
        while not out.read_text(errors="replace"):  # generating
            assert host.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.02)
        worker.process.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        host.wait(timeout=20)
        elapsed = time.monotonic() - start
    text = err.read_text()
    assert host.returncode == rpc.ABORT_EXIT_CODE, text
    errors = [line for line in text.split("\n") if "ggufspec: error:" in line]
    assert errors == [f"ggufspec: error: the RPC worker {worker.endpoint} stopped answering: no progress for 2 s "
                      f"(--rpc-timeout); the run cannot go on"], text
    assert "n_predict" in text  # the partial statistics
    assert 1.5 < elapsed < 10


STALL_SCRIPT = """
import time
from ggufspec.rpc import StallWatch
count = [0]
watch = StallWatch(["127.0.0.1:1", "127.0.0.1:2"], 0.5, lambda: count[0])
time.sleep(1.5)  # idle (a reader, a user awaited): not watched
with watch.armed():
    for _ in range(15):  # progress
        count[0] += 1
        time.sleep(0.1)
print("idle and progress: ok", flush=True)
with watch.armed():
    time.sleep(5)
print("not reached", flush=True)
"""


def test_the_stall_watch_fires_only_when_armed_and_stuck():
    done = subprocess.run([sys.executable, "-c", STALL_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == rpc.ABORT_EXIT_CODE and done.stdout == "idle and progress: ok\n", done
    assert done.stderr == ("ggufspec: error: one of the RPC workers 127.0.0.1:1, 127.0.0.1:2 stopped answering: no "
                           "progress for 0.5 s (--rpc-timeout); the run cannot go on\n")


def test_rpc_timeout_needs_rpc(tiny_pair):
    done = subprocess.run([GGUFSPEC, "run", "-m", str(tiny_pair[0]), "-p", "hi", "--rpc-timeout", "5"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and last_error(done) == "ggufspec: error: --rpc-timeout watches --rpc's workers: give --rpc too"


# -- bench: the lost worker's line ---------------------------------------------------------------------

def test_bench_starts_the_lost_worker_line_on_its_own_line(worker, slow_target, tmp_path):
    """The line was glued onto the progress bar's (which ends with no newline)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "kind": "raw", "prompt": "the cat"}\n')
    err = tmp_path / "err"
    with host_process(err, "bench", "-m", str(slow_target), "--prompts", str(prompts), "--draft", "auto", "-n", "3000",
                      "-t", "1", "--rpc", str(worker.endpoint)) as host:
        wait_for(err, "bench:", host)
        time.sleep(0.5)  # generating
        worker.process.send_signal(signal.SIGKILL)
        host.wait(timeout=20)
    text = err.read_text()
    assert host.returncode == rpc.ABORT_EXIT_CODE, text
    assert (f"ggufspec: error: lost the RPC worker {worker.endpoint} mid-run (it stopped or its port closed); "
            f"the run cannot go on") in text.split("\n"), text
