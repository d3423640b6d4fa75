"""llama.cpp's RPC backend: real worker processes on loopback, the target split across them."""
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from ggufspec import rpc
from ggufspec.load import load_on_devices
from rpcworkers import MiB, REPO, Worker, free_port  # noqa: F401

@pytest.fixture(scope="module")
def workers(needs_rpc, tmp_path_factory):
    logs = tmp_path_factory.mktemp("rpc-workers")
    started = []
    try:
        started.append(Worker(logs, mem=512 * MiB))
        started.append(Worker(logs, cache=logs / "cache"))
        yield started
    finally:
        for worker in started:
            worker.stop()


def connections_to(port: int) -> int:
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


# -- addresses (no native library needed) ----------------------------------------------------------

def test_parse_endpoints():
    assert rpc.parse_endpoints("10.0.0.2:50052, gpu-box:50053") == [
        rpc.Endpoint("10.0.0.2", 50052), rpc.Endpoint("gpu-box", 50053)]


@pytest.mark.parametrize("text, fragment", [
    ("", "no empty entries"), ("a:1,,b:2", "no empty entries"), ("host", "HOST:PORT"),
    (":50052", "HOST:PORT"), ("host:http", "port must be a number"), ("host:70000", "port must be a number"),
    ("[::1]:50052", "IPv6"), ("h:1,h:1", "listed twice"),
    ("localhost:50052,127.0.0.1:50052", "listed twice (as localhost:50052 too)"),  # one worker: the load hung
    (",".join(f"h:{p}" for p in range(1, 18)), "at most 16"),
])
def test_bad_endpoints_are_one_line_errors(text, fragment):
    with pytest.raises(rpc.RpcError) as info:
        rpc.parse_endpoints(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_build_without_rpc_names_the_rebuild_command(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))  # a library folder with no ggml-rpc
    with pytest.raises(rpc.RpcUnsupportedError) as info:
        rpc._Native()
    assert rpc.REBUILD_COMMAND in str(info.value) and "\n" not in str(info.value)


def test_layer_devices_follows_llamacpp():
    assert rpc.layer_devices(2, 2, [1, 1]) == [None, 0, 1]  # layer 0 local, layer 1 and output on workers
    assert rpc.layer_devices(4, 5, [1, 1]) == [0, 0, 0, 1, 1]
    assert rpc.layer_devices(4, 0, [1, 1]) == [None] * 5
    assert rpc.layer_devices(4, 3, [3, 1]) == [None, None, 0, 0, 0]


# -- probing ------------------------------------------------------------------------------------------

def test_probe_and_memory(workers):
    limited, plain = workers
    for worker in workers:
        info = rpc.probe(worker.endpoint)
        assert info.version[:2] == (rpc.RPC_PROTO_MAJOR_VERSION, rpc.RPC_PROTO_MINOR_VERSION)
        assert 0 < info.rtt_s < 1
    assert rpc.worker_memory(limited.endpoint) == (512 * MiB, 512 * MiB)  # --mem
    free, total = rpc.worker_memory(plain.endpoint)
    assert total == psutil.virtual_memory().total and free > 0  # a CPU worker reports its RAM
    assert f"local cache    : {plain.log.parent / 'cache'}" in plain.log.read_text()  # --cache


def test_unreachable_worker_is_a_quick_one_line_error(workers):
    dead = rpc.Endpoint("127.0.0.1", free_port())
    start = time.monotonic()
    with pytest.raises(rpc.WorkerUnreachableError) as info:
        rpc.register_workers([workers[0].endpoint, dead])  # probes all before any native call
    assert time.monotonic() - start < 2
    assert f"RPC worker {dead} is not reachable: connection refused" in str(info.value)
    assert "\n" not in str(info.value)


def fake_worker(reply: bytes | None) -> rpc.Endpoint:
    """A loopback server that answers one HELLO with `reply` (None: hang up at once)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn, server:
            if reply is not None:
                conn.recv(64)
                conn.sendall(reply)
    threading.Thread(target=serve, daemon=True).start()
    return rpc.Endpoint("127.0.0.1", server.getsockname()[1])


@pytest.mark.parametrize("reply, fragment", [
    ((28).to_bytes(8, "little") + bytes([6, 0, 0, 0]) + bytes(24), "speaks RPC protocol v6.0.0"),
    ((28).to_bytes(8, "little") + bytes([7, 9, 0, 0]) + bytes(24), "speaks RPC protocol v7.9.0"),
    (None, "ended the handshake"),
])
def test_incompatible_worker_is_refused_before_any_native_call(needs_rpc, reply, fragment):
    endpoint = fake_worker(reply)
    with pytest.raises(rpc.WorkerUnreachableError) as info:
        rpc.register_workers([endpoint])
    assert f"RPC worker {endpoint}" in str(info.value) and fragment in str(info.value)


def test_worker_address_checks(needs_rpc, capsys):
    with pytest.raises(rpc.RpcError, match="IPv4 only"):
        rpc.start_worker("::1", free_port())
    with socket.create_server(("0.0.0.0", 0)) as taken:  # the port is in use: no server starts
        with pytest.raises(rpc.RpcError, match="cannot listen on 0.0.0.0"):
            rpc.start_worker("0.0.0.0", taken.getsockname()[1])
    assert "unauthenticated" in capsys.readouterr().err
    with pytest.raises(rpc.RpcError, match="cannot listen on 127.0.0.1"):
        with socket.create_server(("127.0.0.1", 0)) as taken:
            rpc.start_worker("localhost", taken.getsockname()[1])
    assert "unauthenticated" not in capsys.readouterr().err
    with pytest.raises(rpc.RpcError, match="--host is empty"):  # it listened on every interface
        rpc.start_worker("", free_port())
    with pytest.raises(rpc.RpcError, match="more memory than any machine has"):  # 2**64 wrapped to 0
        rpc.start_worker("127.0.0.1", free_port(), mem=1 << 64)


# -- the target on the workers ------------------------------------------------------------------------

def load_split_target(target, endpoints):
    devices = rpc.target_devices(rpc.register_workers(endpoints))
    return load_on_devices(target, devices, n_ctx=256, n_batch=512, n_ubatch=512, n_threads=1, n_threads_batch=1,
                          n_gpu_layers=2, tensor_split=[1, 1], logits_all=False, verbose=False)


def test_target_split_across_two_workers_matches_local(workers, tiny_pair, tiny_decoder):
    from ggufspec import SpeculativeDecoder
    target, draft = tiny_pair
    endpoints = [w.endpoint for w in workers]
    devices = rpc.target_devices(rpc.register_workers(endpoints))
    llm = load_split_target(target, endpoints)
    try:
        # the tiny target has 2 layers: layer 0 on the local CPU, layer 1 on the first worker, output on the second
        assert rpc.layer_devices(2, 2, [1, 1]) == [None, 0, 1]
        assert rpc.layer_placement(devices, 2, 2, [1, 1]) == {"CPU": 1, str(endpoints[0]): 1, str(endpoints[1]): 1}
        assert [connections_to(w.port) for w in workers] == [1, 1]
        assert rpc.keepalive(endpoints, timeout_s=10) == 2
        for conn in psutil.Process().net_connections("tcp"):
            if conn.raddr and conn.raddr.port in (workers[0].port, workers[1].port):
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        with pytest.raises(rpc.WorkerUnreachableError, match="serving another host"):
            rpc.probe(endpoints[0], timeout=0.5)  # a worker serves one host at a time
        with SpeculativeDecoder(llm, draft, n_ctx=256, n_threads=1) as split:
            for options in (dict(n_draft=3), dict(n_draft=1), dict(n_draft=0)):
                remote = split.generate("the cat sat", n_predict=48, temperature=0, **options)
                local = tiny_decoder.generate("the cat sat", n_predict=48, temperature=0, **options)
                assert remote.tokens == local.tokens, options
            assert split.draft_llm is not None  # the draft stayed local: it never asked for devices
    finally:
        llm.close()
    deadline = time.monotonic() + 5
    while any(connections_to(w.port) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [connections_to(w.port) for w in workers] == [0, 0]  # closing the model frees the workers


HOST_SCRIPT = """
import sys
from ggufspec import SpeculativeDecoder, rpc
from ggufspec.load import load_on_devices
from ggufspec.llamalog import quiet_llama_logs
target, draft, endpoints = sys.argv[1], sys.argv[2], rpc.parse_endpoints(sys.argv[3])
rpc.install_abort_message(endpoints, on_abort=lambda msg: print("partial stats: n_predict = ...", file=sys.stderr))
devices = rpc.target_devices(rpc.register_workers(endpoints))
llm = load_on_devices(target, devices, n_ctx=256, n_threads=1, n_threads_batch=1, n_gpu_layers=2,
                     tensor_split=[1, 1], verbose=False)
quiet_llama_logs()
decoder = SpeculativeDecoder(llm, draft, n_ctx=256, n_threads=1)
print("ready", flush=True)
while True:
    decoder.generate("the cat sat", n_predict=200, n_draft=3, temperature=0)
"""


def test_killing_a_worker_mid_generation_ends_the_host_with_one_clear_line(workers, tiny_pair, tmp_path):
    target, draft = tiny_pair
    doomed = Worker(tmp_path)
    try:
        endpoints = f"{workers[1].endpoint},{doomed.endpoint}"
        host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, str(target), str(draft), endpoints],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            ready, _, _ = select.select([host.stdout], [], [], 60)
            assert ready and host.stdout.readline() == b"ready\n", host.stderr.read().decode()
            time.sleep(0.3)  # generating now
            doomed.process.send_signal(signal.SIGKILL)
            start = time.monotonic()
            _, err = host.communicate(timeout=20)
            elapsed = time.monotonic() - start
        finally:
            if host.poll() is None:
                host.kill()
                host.wait()
    finally:
        doomed.stop()
    text = err.decode(errors="replace")
    assert host.returncode == rpc.ABORT_EXIT_CODE, text
    errors = [line for line in text.splitlines() if line.startswith("ggufspec: error:")]
    assert errors == [f"ggufspec: error: lost the RPC worker {doomed.endpoint} mid-run "
                      f"(it stopped or its port closed); the run cannot go on"], text
    assert "partial stats" in text
    assert elapsed < 10
