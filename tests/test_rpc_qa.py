"""QA of the RPC area: bad --rpc values, workers that die or stall, `serve --rpc`'s front. Real worker
processes on loopback (tests/rpcworkers.py), the tiny models written at test time."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from ggufspec import rpc
from rpcworkers import Worker, free_port
from serverproc import GGUFSPEC, make_chat_pair, start_server, stop_server

MESSAGES = [{"role": "user", "content": "the cat"}]


# -- addresses ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["127.0.0.1:\u00b2", "127.0.0.1:5\u00b2", "h:\u0665\u0660\u0660\u0665\u0662"])
def test_a_port_of_non_ascii_digits_is_a_one_line_error(text):
    """str.isdigit() takes superscripts (int() then raised a ValueError: a traceback from the CLI)."""
    with pytest.raises(rpc.RpcError, match="port must be a number"):
        rpc.parse_endpoints(text)


def test_a_bad_port_from_the_cli_is_one_line(tiny_pair):
    done = subprocess.run([GGUFSPEC, "run", "-m", str(tiny_pair[0]), "-p", "hi", "-n", "2", "--rpc", "127.0.0.1:5\u00b2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("ggufspec: error: RPC worker"), done.stderr


@pytest.fixture(scope="module")
def worker(needs_rpc, tmp_path_factory):
    started = Worker(tmp_path_factory.mktemp("rpc-qa-worker"))
    yield started
    started.stop()


def test_one_worker_under_two_addresses_is_named_not_a_hang(worker, tiny_pair):
    """127.0.0.1:P and 0.0.0.0:P reach the same worker (on Linux 0.0.0.0 is this machine), which the
    name check cannot see: ggml-rpc's second connection waited for ever for the first to close."""
    twice = f"{worker.endpoint},0.0.0.0:{worker.port}"
    start = time.monotonic()
    with pytest.raises(rpc.RpcError, match=f"0.0.0.0:{worker.port} is the worker {worker.endpoint} again"):
        rpc.register_workers(rpc.parse_endpoints(twice), timeout=1.0)
    assert time.monotonic() - start < 5
    done = subprocess.run([GGUFSPEC, "run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-p", "the cat", "-n", "4",
                           "-t", "1", "-ngl", "99", "--rpc", twice], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "again" in done.stderr.strip().splitlines()[-1], done.stderr
    rpc.probe(worker.endpoint)  # and the worker is free for the next host


def test_an_empty_cache_folder_is_refused_not_the_current_folder(needs_rpc, tmp_path):
    """`ggufspec worker --cache=` cached the tensors hosts send in the folder it was started from."""
    done = subprocess.run([GGUFSPEC, "worker", "--port", str(free_port()), "--cache="], capture_output=True, text=True,
                          timeout=10, cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "ggufspec: error: --cache is empty: give the folder to keep tensors in"


# -- serve --rpc: the front ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(worker, tmp_path_factory):
    target, draft = make_chat_pair(tmp_path_factory.mktemp("rpc-qa-pair"))
    running = start_server(tmp_path_factory.mktemp("rpc-qa-serve"), "-m", str(target), "-md", str(draft), "-c", "4096",
                           "--rpc", str(worker.endpoint), "--rpc-timeout", "3")
    yield running
    stop_server(running)


def wait_health(server, status: int, seconds: float = 40) -> None:
    deadline = time.monotonic() + seconds
    while httpx.get(server.url + "/health", timeout=30).status_code != status:
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.1)


def restart(worker) -> None:
    worker.stop()
    worker.__init__(worker.log.parent, port=worker.port)


def test_a_request_whose_body_arrives_after_the_worker_is_lost_is_a_503(server, worker):
    """The front chose the model process when the headers came; the body came after that process had
    gone. The request was queued on the model socket (which the front keeps) and hung until a new
    model process took it (never, while the worker stays away)."""
    wait_health(server, 200)
    body = json.dumps({"model": "target", "messages": MESSAGES, "max_tokens": 4}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        time.sleep(0.5)  # the front has the headers
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.wait(timeout=10)
        wait_health(server, 503)
        client.sendall(body[10:])
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                chunk = client.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except socket.timeout:
            pytest.fail("no answer within 15 s after the worker was lost")
    assert answer.startswith(b"HTTP/1.1 503"), answer
    restart(worker)
    wait_health(server, 200)


def test_a_worker_lost_mid_generation_without_a_stream_is_an_openai_503(server, worker):
    wait_health(server, 200)
    result = {}

    def ask():
        result["answer"] = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "target", "prompt": "the cat", "max_tokens": 4000, "logit_bias": {"2": -100}})
    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 10
    while not httpx.get(server.url + "/health", timeout=10).json().get("busy"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.wait(timeout=10)
    asking.join(30)
    answer = result["answer"]
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "worker_lost" and error["type"] == "server_error" and str(worker.endpoint) in error["message"]
    restart(worker)
    wait_health(server, 200)


def test_a_small_rpc_timeout_does_not_kill_an_idle_model(needs_rpc, tmp_path):
    """The supervisor asked the model process's /health within --rpc-timeout: under a small one an idle
    model process (no generation, nothing stalled) was killed as hung, and reloaded, over and over."""
    own = Worker(tmp_path)
    try:
        target, draft = make_chat_pair(tmp_path)
        running = start_server(tmp_path, "-m", str(target), "-md", str(draft), "--rpc", str(own.endpoint),
                               "--rpc-timeout", "0.001")
        try:
            wait_health(running, 200)
            time.sleep(4)
            assert httpx.get(running.url + "/health", timeout=10).status_code == 200
            assert "stopped answering" not in running.log.read_text(), running.log.read_text()
        finally:
            stop_server(running)
    finally:
        own.stop()
