"""`ggufspec chat` driven through a pipe: turns, the statistics line, /reset, Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path


from ggufspec import SpeculativeDecoder
from ggufspec.tinymodels import CHAT_TEMPLATE
from ggufspec.tinymodels import Shape, make_weights, write_model

GGUFSPEC = str(Path(sys.executable).with_name("ggufspec"))
STATS_LINE = re.compile(r"^\[(\d+) tokens, [\d.]+ tok/s, (?:accepted (\d+)/(\d+) drafted|no drafts), "
                        r"prompt (\d+) tokens \((\d+) cached\)(, stopped)?\]$")


def chat(args, stdin: str | bytes, tmp_path: Path):
    env = {**os.environ, "GGUFSPEC_HOME": str(tmp_path / "home"), "PYTHONIOENCODING": "utf-8"}
    stdin = stdin if isinstance(stdin, bytes) else stdin.encode()
    done = subprocess.run([GGUFSPEC, "chat", "-t", "1", "-c", "512", *args], input=stdin,
                          capture_output=True, env=env, timeout=120)
    return done.returncode, done.stdout, done.stderr.decode(errors="replace")


def test_two_turns_the_stats_line_and_reset(chat_pair, tmp_path):
    target, draft = chat_pair
    code, out, err = chat(["-m", str(target), "-md", str(draft), "-n", "12", "--system", "be brief"],
                          "hi\n\nhello there\n/reset\nhi\n", tmp_path)
    assert code == 0, err
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        first = decoder.chat(history, n_predict=12).text
        history += [{"role": "assistant", "content": first}, {"role": "user", "content": "hello there"}]
        second = decoder.chat(history, n_predict=12).text
    # after /reset the conversation starts again: the same first answer
    assert out == "\n".join([first, second, first, ""]).encode()
    lines = [STATS_LINE.match(line) for line in err.splitlines() if line.startswith("[")]
    assert len(lines) == 3 and all(lines), err
    assert "(conversation cleared)" in err
    n_predict, accepted, drafted, n_prompt, cached = (int(g) if g else 0 for g in lines[1].groups()[:5])
    assert 0 < n_predict <= 12 and accepted <= drafted
    one_prompt = int(lines[0].group(4))
    assert cached >= one_prompt - 1 and n_prompt > one_prompt  # turn two prefilled only the new message


def test_bytes_that_are_no_utf8_and_unknown_commands_do_not_end_the_session(chat_pair, tmp_path):
    target, draft = chat_pair
    code, out, err = chat(["-m", str(target), "-md", str(draft), "-n", "4"], b"the \xff\xfe cat\n/help\nhi\n", tmp_path)
    assert code == 0, err
    assert "unknown command /help" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if STATS_LINE.match(line)]) == 2  # two answers, /help none


def test_ctrl_c_stops_the_answer_not_the_session(tmp_path):
    shape = Shape(n_layer=16, n_embd=256, n_ff=768)
    weights = make_weights(shape, seed=2)
    weights["output.weight"][2] = 0  # no EOS: answers run until stopped
    target = write_model(tmp_path / "slow.gguf", shape, weights, CHAT_TEMPLATE)
    env = {**os.environ, "GGUFSPEC_HOME": str(tmp_path / "home"), "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.Popen([GGUFSPEC, "chat", "-m", str(target), "--no-draft", "-t", "1", "-c", "512", "-n", "2000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        proc.stdin.write(b"x\n")
        proc.stdin.flush()
        assert proc.stdout.read(1)  # answering
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(b"/exit\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode(errors="replace")
    assert proc.returncode == 0, err
    lines = [STATS_LINE.match(line) for line in err.splitlines() if line.startswith("[")]
    assert len(lines) == 1 and lines[0] and lines[0].group(6), err  # ", stopped"
    assert int(lines[0].group(1)) < 2000
    assert "Traceback" not in err
