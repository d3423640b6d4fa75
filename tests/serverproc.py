"""`ggufspec serve` as a real process on loopback (test_server, test_chat_page), the tiny chat pair
that test_server and test_chat_cli serve, a module's server over a pair (the server tests' fixture), and a
server over conftest's slow target with the resumable streams' helpers (test_server_resumable,
test_chat_page_resume)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ggufspec.tinymodels import Shape, make_pair

GGUFSPEC = str(Path(sys.executable).with_name("ggufspec"))


def make_chat_pair(directory: Path) -> tuple[Path, Path]:
    """conftest's tiny_pair (the same files), written to `directory` for a module's own fixtures.

    Its chat template (tinymodels.CHAT_TEMPLATE) renders a conversation as the previous turn's prompt
    and answer followed by the new messages, as real templates (ChatML...) do, so the KV cache is
    reused across turns."""
    return make_pair(directory, seed=0, shape=Shape(eos_bias=4.0))


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path, key: str | None = None):
        self.url, self.proc, self.log = url, proc, log
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}  # its --api-key, for raw requests

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             timeout=kwargs.pop("timeout", 60), **kwargs)

    def health(self, **kwargs) -> dict:
        response = httpx.get(self.url + "/health", timeout=10, **kwargs)
        assert response.status_code == 200
        return response.json()


def start_server(tmp_path: Path, *args: str, prefix: str = "") -> Server:
    """`ggufspec serve --port 0 ARGS`, once it prints its URL (its stderr goes to tmp_path/server.log);
    `prefix`: the --api-prefix it serves under (the Server's url is the origin, without it)."""
    log = tmp_path / "server.log"
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    env = {**os.environ, "GGUFSPEC_HOME": str(tmp_path / "home")}
    with log.open("w") as stderr:
        proc = subprocess.Popen([GGUFSPEC, "serve", "--port", "0", "-t", "1", *args], stdout=subprocess.DEVNULL,
                                stderr=stderr, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"at (https?://127\.0\.0\.1:\d+)" + re.escape(prefix) + "/v1", log.read_text())
        if match:
            return Server(match.group(1), proc, log, key)
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the server did not start: " + log.read_text())


def stop_server(server: Server) -> None:
    """SIGTERM; the server must exit 0 without a traceback in its log."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        assert server.proc.wait(timeout=20) == 0, server.log.read_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "Traceback" not in server.log.read_text(), server.log.read_text()


@contextlib.contextmanager
def serving(tmp_path: Path, *args: str):
    """start_server ... stop_server around a block (the exit checks included)."""
    running = start_server(tmp_path, *args)
    try:
        yield running
    finally:
        stop_server(running)


def pair_server_fixture(*args: str, pair: str = "chat_pair", name: str = "server"):
    """A module-scoped fixture `name`: a server over the (target, draft) the fixture `pair` gives (conftest's
    chat_pair unless told); `args`: more serve flags."""
    @pytest.fixture(scope="module", name=name)
    def pair_server(request, tmp_path_factory):
        target, draft = request.getfixturevalue(pair)
        with serving(tmp_path_factory.mktemp(name), "-m", str(target), "-md", str(draft), *args) as running:
            yield running
    return pair_server


def slow_server_fixture(key: str, *args: str, name: str = "slow_server"):
    """A module-scoped fixture `name`: a server over conftest's slow_target alone (a few milliseconds a token,
    no end-of-sequence), greedy, behind the API key `key`; `args`: more serve flags."""
    @pytest.fixture(scope="module", name=name)
    def slow_server(slow_target, tmp_path_factory):
        with serving(tmp_path_factory.mktemp(name), "-m", str(slow_target), "--no-draft", "--api-key", key,
                     "--temp", "0", *args) as running:
            yield running
    return slow_server


def replay(server: Server, conversation: str, offset: int = 0) -> httpx.Response:
    """GET /v1/stream: the conversation's resumable stream, from byte `offset` on."""
    return httpx.get(server.url + "/v1/stream", params={"conv_id": conversation, "from": offset},
                     headers=server.auth, timeout=60)


def answer_text(raw: bytes) -> str:
    """The chat stream's content deltas, joined (pings and [DONE] passed over)."""
    text = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[6:]).get("choices") or [{}]
            text.append(choices[0].get("delta", {}).get("content") or "")
    return "".join(text)


def wait_idle(server: Server, seconds: float = 10) -> dict:
    """/health once no generation runs (within `seconds`, or the test fails)."""
    deadline = time.monotonic() + seconds
    while (health := server.health(headers=server.auth))["busy"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    return health


def raw_events(server: Server, path: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed answer's SSE events as (event name, data), with the server's key if it has one."""
    events, name = [], None
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=server.auth,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events
