"""`ggufspec serve --rpc` under faults, with the official openai client: the target on one RPC worker
(a real process on loopback); the worker killed (503 naming it, an SSE error in a stream, the server
alive, /health unavailable), started again on its port (the same greedy text), and stopped with
SIGSTOP (503 within about --rpc-timeout, then recovery on SIGCONT). One server for the whole module,
the tests in order: each starts from the state the previous one left."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from rpcworkers import Worker, free_port
from serverproc import GGUFSPEC, make_chat_pair, start_server, stop_server

RPC_TIMEOUT = 3
MESSAGES = [{"role": "user", "content": "the cat"}]
NO_EOS = {"2": -100}  # the tiny models' end of sequence, banned: an answer as long as max_tokens


@pytest.fixture(scope="module")
def worker(needs_rpc, tmp_path_factory):
    started = Worker(tmp_path_factory.mktemp("rpc-serve-worker"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def server(worker, tmp_path_factory):
    target, draft = make_chat_pair(tmp_path_factory.mktemp("rpc-serve-pair"))
    running = start_server(tmp_path_factory.mktemp("rpc-serve"), "-m", str(target), "-md", str(draft), "-c", "2048",
                           "--rpc", str(worker.endpoint), "--rpc-timeout", str(RPC_TIMEOUT))
    yield running
    stop_server(running)


def greedy_answer(server) -> str:
    answer = server.client(timeout=30).chat.completions.create(model="target", messages=MESSAGES, max_tokens=24,
                                                                temperature=0)
    return answer.choices[0].message.content


def health(server) -> httpx.Response:
    # 30 s: once in a CI rehearsal the front took over 10 s to answer while the model process reloaded
    return httpx.get(server.url + "/health", timeout=30)


def wait_healthy(server, seconds: float = 40) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log.read_text()
        if health(server).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"/health still {health(server).json()} after {seconds} s: {server.log.read_text()}")


def restart(worker) -> None:
    worker.stop()
    worker.__init__(worker.log.parent, port=worker.port)


@pytest.fixture(scope="module")
def first_text(server):
    return greedy_answer(server)


def test_a_chat_completion_through_the_supervisor(server, first_text):
    assert first_text
    body = health(server).json()
    assert body["status"] == "ok" and body["stalled_s"] == 0
    with pytest.raises(openai.BadRequestError, match="temperature"):  # bad values: a 400, the server fine after
        server.client().chat.completions.create(model="target", messages=MESSAGES, temperature="hot")
    assert greedy_answer(server) == first_text
    message = httpx.post(server.url + "/v1/messages", json={"max_tokens": 24, "messages": MESSAGES}, timeout=30)
    assert message.status_code == 200 and message.json()["content"][0]["text"] == first_text  # the front passes it


def test_concurrent_clients_and_malformed_requests_through_the_front(server, first_text):
    """Four clients at once (two streamed) all get the greedy answer; malformed JSON and a wrong
    field type are 400s passed through the front; the server answers after."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(streamed: bool) -> str:
        client = server.client(timeout=60)
        if not streamed:
            return greedy_answer(server)
        chunks = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=24, temperature=0,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [False, True, False, True]))
    assert answers == [first_text] * 4
    bad = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                     headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    wrong = httpx.post(server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=10)
    assert wrong.status_code == 400 and "messages" in wrong.json()["error"]["message"]
    assert greedy_answer(server) == first_text


def test_the_front_checks_host_names_origins_and_bodies(server, first_text):
    """The supervisor's front faces the clients: it refuses what a plain `serve` refuses (the model
    process behind it trusts it), and its CORS headers are the ones the client sees."""
    evil_host = httpx.get(server.url + "/health", headers={"Host": "evil.example"}, timeout=10)
    assert evil_host.status_code == 403 and evil_host.json()["error"]["code"] == "host_not_allowed"
    foreign = httpx.post(server.url + "/v1/chat/completions", timeout=10, headers={"Origin": "http://evil.example"},
                         json={"messages": MESSAGES, "max_tokens": 2})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
    too_large = httpx.post(server.url + "/v1/chat/completions", timeout=10, content=b" " * (4 * 1024 * 1024 + 1))
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    local = httpx.post(server.url + "/v1/chat/completions", timeout=30, headers={"Origin": "http://localhost:3000"},
                       json={"messages": MESSAGES, "max_tokens": 24, "temperature": 0})
    assert local.status_code == 200 and local.json()["choices"][0]["message"]["content"] == first_text
    assert local.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]
    assert "web pages: loopback; Host: loopback" in server.log.read_text()


def test_a_lost_worker_is_a_503_naming_it_and_an_sse_error_in_a_stream(server, worker):
    stream = server.client(timeout=30).chat.completions.create(
        model="target", messages=MESSAGES, max_tokens=1500, temperature=0, stream=True, logit_bias=NO_EOS)
    chunks = iter(stream)
    next(chunks), next(chunks)  # the stream has started
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.wait(timeout=10)
    with pytest.raises(openai.APIError) as lost:
        for _ in chunks:
            pass
    assert str(worker.endpoint) in str(lost.value), lost.value
    with pytest.raises(openai.InternalServerError) as refused:  # the next request: 503, what happened
        server.client().chat.completions.create(model="target", messages=MESSAGES, max_tokens=8)
    assert refused.value.status_code == 503 and str(worker.endpoint) in refused.value.message
    anthropic_refused = httpx.post(server.url + "/v1/messages", json={"max_tokens": 8, "messages": MESSAGES}, timeout=10)
    assert anthropic_refused.status_code == 503 and anthropic_refused.json()["type"] == "error"  # Anthropic's shape
    assert str(worker.endpoint) in anthropic_refused.json()["error"]["message"]
    assert server.proc.poll() is None
    down = health(server)
    assert down.status_code == 503 and down.json()["status"] == "unavailable"
    assert str(worker.endpoint) in down.json()["error"]["message"]


def test_the_worker_back_on_its_port_serves_the_same_text(server, worker, first_text):
    restart(worker)
    wait_healthy(server)
    assert greedy_answer(server) == first_text
    assert "the model is back" in server.log.read_text()


def test_an_idle_worker_lost_is_seen_without_a_request_and_reloaded_when_back(server, worker, first_text):
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while health(server).status_code == 200:  # the model process saw its connection close
        assert time.monotonic() < deadline, "/health still ok 10 s after the worker died"
        time.sleep(0.1)
    assert str(worker.endpoint) in health(server).json()["error"]["message"]
    restart(worker)
    wait_healthy(server)  # reloaded before any request asked
    assert greedy_answer(server) == first_text


def test_a_hung_worker_is_a_503_within_the_timeout_then_recovers(server, worker, first_text):
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as hung:
            server.client(timeout=60).chat.completions.create(model="target", messages=MESSAGES, max_tokens=24,
                                                              temperature=0)
        waited = time.monotonic() - started
        assert hung.value.status_code == 503 and "stopped answering" in hung.value.message
        assert str(worker.endpoint) in hung.value.message
        assert RPC_TIMEOUT <= waited < RPC_TIMEOUT + 8, waited
        assert health(server).status_code == 503 and server.proc.poll() is None
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    wait_healthy(server)
    assert greedy_answer(server) == first_text


def test_a_stream_whose_worker_hangs_ends_with_an_sse_error(server, worker, first_text):
    stream = server.client(timeout=60).chat.completions.create(
        model="target", messages=MESSAGES, max_tokens=1500, temperature=0, stream=True, logit_bias=NO_EOS)
    chunks = iter(stream)
    next(chunks), next(chunks)
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="stopped answering"):
            for _ in chunks:
                pass
        assert time.monotonic() - started < RPC_TIMEOUT + 8
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    wait_healthy(server)
    assert greedy_answer(server) == first_text


def test_a_client_that_leaves_a_stream_stops_its_generation(server):
    stream = server.client().chat.completions.create(model="target", messages=MESSAGES, max_tokens=1500,
                                                     stream=True, logit_bias=NO_EOS)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    deadline = time.monotonic() + 10
    while health(server).json()["busy"]:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.1)
    assert health(server).json()["last"]["n_predict"] < 1500


def test_an_unreachable_worker_at_start_is_one_line_and_exit_code_1(tmp_path):
    target, draft = make_chat_pair(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    command = [GGUFSPEC, "serve", "--port", "0", "-m", str(target), "-md", str(draft), "--rpc", endpoint]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GGUFSPEC_HOME": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("ggufspec: error:")]
    assert len(errors) == 1 and endpoint in errors[0] and "Traceback" not in done.stderr
