"""`ggufspec serve` as a real process on loopback (test_server, test_chat_page), and the tiny chat pair
that test_server and test_chat_cli serve."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from ggufspec.tinymodels import Shape, make_pair

GGUFSPEC = str(Path(sys.executable).with_name("ggufspec"))


def make_chat_pair(directory: Path) -> tuple[Path, Path]:
    """conftest's tiny_pair (the same files), written to `directory` for a module's own fixtures.

    Its chat template (tinymodels.CHAT_TEMPLATE) renders a conversation as the previous turn's prompt
    and answer followed by the new messages, as real templates (ChatML...) do, so the KV cache is
    reused across turns."""
    return make_pair(directory, seed=0, shape=Shape(eos_bias=4.0))


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

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
    env = {**os.environ, "GGUFSPEC_HOME": str(tmp_path / "home")}
    with log.open("w") as stderr:
        proc = subprocess.Popen([GGUFSPEC, "serve", "--port", "0", "-t", "1", *args], stdout=subprocess.DEVNULL,
                                stderr=stderr, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"at (https?://127\.0\.0\.1:\d+)" + re.escape(prefix) + "/v1", log.read_text())
        if match:
            return Server(match.group(1), proc, log)
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
