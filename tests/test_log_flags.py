"""llama.cpp's log flags (-v, -lv N, --log-disable, --log-file, --log-prefix, --log-timestamps, --log-colors)
on the real CLI, on a tiny model: what reaches stderr, the file and stdout. The `run` command lines run
at once, in parallel, in one module fixture; the tests read their results."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from serverproc import start_server, stop_server

from ggufspec.cli import main

LOADER = "llama_model_loader:"  # the load log: ggml info, llama.cpp's verbosity 4 (trace)
DEBUG_LINE = "init_tokenizer:"  # a ggml debug line: verbosity 5
WARNING = "n_ctx_train"  # llama_context's warning that -c 4096 exceeds the tiny model's 2048: verbosity 2
TIMESTAMP = re.compile(r"^\d+\.\d\d\.\d{3}\.\d{3} I llama_model_loader:", re.M)
RUNS = {
    "plain": [],
    "verbose": ["-v"],
    "env verbose": [],  # GGUFSPEC_VERBOSE=1
    "last wins": ["-v", "-lv", "3", "--log-prefix"],
    "trace": ["-lv", "4", "--log-prefix", "--log-timestamps", "--log-colors", "on", "--log-file", "{tmp}/trace.log"],
    "disabled": ["--log-disable", "-v", "--log-file", "{tmp}/disabled.log"],
}


def environment(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GGUFSPEC_VERBOSE", "NO_COLOR")}
    return {**env, "GGUFSPEC_HOME": str(home), **extra}


@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory):
    """name -> (exit code, stdout, stderr) of `ggufspec run` on the tiny pair with RUNS[name]'s flags."""
    target, draft = tiny_pair
    tmp = tmp_path_factory.mktemp("log-flags")
    started = {}
    for name, flags in RUNS.items():
        env = environment(tmp / name.replace(" ", "-"), **({"GGUFSPEC_VERBOSE": "1"} if name == "env verbose" else {}))
        command = [sys.executable, "-m", "ggufspec.cli", "run", "-m", str(target), "-md", str(draft), "-p", "the cat",
                   "-n", "4", "--temp", "0", "-t", "1", *[f.format(tmp=tmp) for f in flags]]
        started[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = {name: (proc.communicate(timeout=120), proc.returncode) for name, proc in started.items()}
    return {name: (code, out, err) for name, ((out, err), code) in done.items()}, tmp


def test_without_flags_stderr_has_no_llama_log_and_with_v_all_of_it(runs):
    results, _ = runs
    code, out, err = results["plain"]
    assert code == 0 and out, err
    assert LOADER not in err and "llama_context" not in err
    code, out, err = results["verbose"]
    assert code == 0, err
    assert LOADER in err and DEBUG_LINE in err  # debug lines too: -v is every verbosity
    assert err.count(LOADER) == results["env verbose"][2].count(LOADER)  # GGUFSPEC_VERBOSE=1 is -v


def test_lv_shows_up_to_its_verbosity_and_the_last_of_v_and_lv_wins(runs):
    results, _ = runs
    code, _, err = results["last wins"]  # -v then -lv 3: 3, llama-server's default: warnings, not the load log
    assert code == 0, err
    assert f"W llama_context: n_ctx_seq (4096) > {WARNING}" in err
    assert LOADER not in err
    code, _, err = results["trace"]  # -lv 4: the load log, no debug lines
    assert code == 0, err
    assert LOADER in err and DEBUG_LINE not in err


def test_log_file_has_the_lines_stderr_has_with_prefix_and_timestamps_plain(runs):
    results, tmp = runs
    _, _, err = results["trace"]
    copied = (tmp / "trace.log").read_text()
    assert TIMESTAMP.search(copied), copied[:500]  # M.SS.mmm.uuu and the level letter, llama.cpp's
    assert "\033[" not in copied  # the copy is plain...
    assert "\033[32mI \033[0mllama_model_loader:" in err  # ... stderr coloured (--log-colors on)
    assert re.sub(r"\033\[\d+m", "", err) == copied  # ggufspec's own lines too (the statistics block)
    assert "n_accept" in copied


def test_log_disable_leaves_stderr_empty_and_stdout_the_answer(runs):
    results, tmp = runs
    code, out, err = results["disabled"]
    assert code == 0
    assert err == ""  # neither llama.cpp's log (-v notwithstanding) nor the statistics block
    assert out == results["plain"][1]
    assert (tmp / "disabled.log").read_text() == ""


@pytest.mark.parametrize("flags, says", [
    (["-lv", "abc"], "Invalid value for '-lv' / '--verbosity' / '--log-verbosity': 'abc' is not a valid integer"),
    (["--log-colors", "maybe"], "Invalid value for '--log-colors': 'maybe': give on, off or auto"),
    (["--log-file", "/nonexistent/dir/f"], "--log-file /nonexistent/dir/f: No such file or directory"),
    (["--log-jsonl"], "--log-jsonl is not supported: llama.cpp writes its log as JSON lines on stdout"),
    (["--log-prompts-dir", "prompts"], "--log-prompts-dir is not supported: ggufspec writes no prompt files"),
])
def test_a_bad_or_unmapped_value_is_one_line_before_anything_loads(tiny_pair, flags, says):
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the", *flags])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"ggufspec: error: {says}") and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("command", [["run"], ["chat"], ["serve"], ["bench"], ["eval", "humaneval"]])
def test_each_command_that_loads_models_lists_the_flags(command):
    shown = CliRunner().invoke(main, [*command, "--help"]).output
    for flag in ("--log-disable", "--log-file", "--log-colors", "-v, --verbose", "-lv, --verbosity", "--log-prefix",
                 "--log-timestamps"):
        assert flag in shown, (command, flag)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_with_log_disable_writes_nothing_on_stderr(tiny_pair, tmp_path):
    """Not even the line with its URL (llama-server's is a log line too): the port is given, /health found."""
    target, draft = tiny_pair
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "serve", "-m", str(target), "-md", str(draft),
                                 "-t", "1", "--port", str(port), "--log-disable"], stdout=subprocess.DEVNULL,
                                stderr=stderr, env=environment(tmp_path / "home"))
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "the", "max_tokens": 2},
                            timeout=30)
        assert answer.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text() == ""  # no uvicorn line either


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_with_v_logs_the_load_and_each_request_on_stderr(tiny_pair, tmp_path):
    target, draft = tiny_pair
    server = start_server(tmp_path, "-m", str(target), "-md", str(draft), "-v")
    try:
        server.health()
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert LOADER in log
    assert '"GET /health HTTP/1.1" 200' in log  # uvicorn's access log, on stderr (off without -v or -lv 4)
    assert "INFO:     Application startup complete." in log
