"""Statistics invariants, and bad input: a one-line error and exit code 2."""
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder
from ggufspec.cli import main
from ggufspec.tinymodels import Shape, make_weights, write_model


def test_stats_invariants(tiny_decoder):
    for k in (1, 3, 8):
        out = tiny_decoder.generate("the dog ran", n_predict=40, n_draft=k)
        s = out.stats
        assert 0 <= s.n_accept <= s.n_drafted
        assert s.n_predict == len(out.tokens)
        assert s.n_draft == k


def test_draft_equal_to_target_accepts_everything(tiny_pair):
    target, _ = tiny_pair
    with SpeculativeDecoder(target, target, n_ctx=256, n_threads=1) as decoder:
        out = decoder.generate([1, 260, 261], n_predict=40, n_draft=4)
    assert out.stats.n_drafted > 0
    assert out.stats.acceptance == 1.0


def run_cli(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def one_line_error(output):
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ggufspec: error:"), output
    return lines[0]


def test_cli_runs_and_prints_the_llamacpp_block(tiny_pair):
    target, draft = tiny_pair
    code, output = run_cli("run", "-m", str(target), "-md", str(draft), "-p", "the cat", "-n", "16",
                           "--draft", "3", "--temp", "0", "-c", "128", "-t", "1")
    assert code == 0, output
    for field in ("n_draft   = 3", "n_predict =", "n_drafted =", "n_accept  =", "accept    =", "encoded", "decoded"):
        assert field in output


def test_cli_json(tiny_pair):
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the",
                                                       "-n", "8", "--json", "-c", "128", "-t", "1"]) \
        if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else \
        CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the", "-n", "8", "--json",
                                  "-c", "128", "-t", "1"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["stats"]["n_predict"] == len(payload["tokens"])


def test_missing_file(tiny_pair, tmp_path):
    code, output = run_cli("run", "-m", str(tmp_path / "nope.gguf"), "-md", str(tiny_pair[1]), "-p", "x")
    assert code == 2
    assert "not found" in one_line_error(output)


def test_not_a_gguf_file(tiny_pair, tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"<html>not a model</html>")
    code, output = run_cli("run", "-m", str(tiny_pair[0]), "-md", str(bogus), "-p", "x")
    assert code == 2
    assert "not a GGUF file" in one_line_error(output)


def test_incompatible_vocabularies(tiny_pair, tmp_path):
    shape = Shape()
    from ggufspec.tinymodels import vocabulary
    tokens, _ = vocabulary()
    tokens[270] = "▁zebra"
    other = write_model(tmp_path / "other.gguf", shape, make_weights(shape, 5), tokens=tokens)
    code, output = run_cli("run", "-m", str(tiny_pair[0]), "-md", str(other), "-p", "x", "-c", "128")
    assert code == 2
    line = one_line_error(output)
    assert "token 270" in line and "zebra" in line


def test_vocabulary_size_difference(tiny_pair, tmp_path):
    shape = Shape(extra_words=200)
    bigger = write_model(tmp_path / "bigger.gguf", shape, make_weights(shape, 5))
    code, output = run_cli("run", "-m", str(tiny_pair[0]), "-md", str(bigger), "-p", "x", "-c", "128")
    assert code == 2
    assert "vocabulary sizes differ" in one_line_error(output)


@pytest.mark.parametrize("args, message", [
    (["--draft", "-1"], "--draft must be >= 0"),
    (["--temp", "-0.5"], "--temp must be >= 0"),
    (["-n", "0"], "-n/--n-predict must be >= 1"),
    (["--top-p", "0"], "--top-p must be in"),
    (["--temp", "nan"], "--temp must be a number"),
    (["--lookup", "--hybrid"], "choose one of --lookup and --hybrid"),
    (["--system", "be brief"], "give --chat too"),
])
def test_bad_generation_options(tiny_pair, args, message):
    target, draft = tiny_pair
    code, output = run_cli("run", "-m", str(target), "-md", str(draft), "-p", "the cat", "-c", "128", *args)
    assert code == 2
    assert message in one_line_error(output)


def test_prompt_longer_than_context(tiny_pair):
    target, draft = tiny_pair
    code, output = run_cli("run", "-m", str(target), "-md", str(draft), "-p", "the cat " * 200, "-c", "64")
    assert code == 2
    assert "context holds" in one_line_error(output)


def test_no_prompt_and_no_draft_model(tiny_pair):
    code, output = run_cli("run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]))
    assert code == 2 and "no prompt" in one_line_error(output)
    code, output = run_cli("run", "-m", str(tiny_pair[0]), "-p", "x", "-n", "4", "-c", "128", "-t", "1")
    assert code == 0 and "ggufspec: draft:" in output  # -m alone: a draft is chosen (test_finddraft)


def test_escapes_and_chat(tiny_pair):
    from ggufspec.cli import process_escapes
    assert process_escapes(r"a\nb\tc\x41\\") == "a\nb\tcA\\"
    # as llama.cpp: \xHH is a byte (two make "é"), and a \x without two hex digits stays as written
    assert process_escapes(r"caf\xC3\xA9 a\xZZ b\x4 \q") == "café a\\xZZ b\\x4 \\q"
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "hi", "--chat",
                                                   "--system", "be brief", "-n", "8", "-c", "128", "-t", "1",
                                                   "--draft", "2", "--json"])
    assert result.exit_code == 0, result.output
    ran = json.loads(result.stdout)
    with SpeculativeDecoder(target, draft, n_ctx=128, n_threads=1) as decoder:
        templated = decoder.tokenize("hi", chat=True, system="be brief")
        assert templated != decoder.tokenize("hi")  # the template really wraps the prompt
        expected = decoder.generate("hi", chat=True, system="be brief", n_predict=8, n_draft=2)
    assert ran["stats"]["n_prompt"] == len(templated)  # the templated prompt, system message included
    assert ran["tokens"] == expected.tokens


def test_utf8_pieces_never_split_a_character():
    from ggufspec.generation import Step, pieces

    class Bytes:
        def piece(self, token):
            return bytes([token])
    euro = "€ ok".encode()
    out = list(pieces(Bytes(), (Step(b, False) for b in euro)))
    assert [p.text for p in out] == ["", "", "€", " ", "o", "k"]


def test_ctrl_c_stops_cleanly_and_prints_the_statistics(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from ggufspec.tinymodels import Shape, make_weights, write_model
    shape = Shape(n_layer=16, n_embd=256, n_ff=768)
    weights = make_weights(shape, seed=2)
    weights["output.weight"][2] = 0  # no EOS: it runs until interrupted
    target = write_model(tmp_path / "slow.gguf", shape, weights)
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "run", "-m", str(target), "--no-draft", "-p", "x",
                             "-n", "-1", "-c", "2048", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace")
    assert proc.stdout.read(1)  # generation has started (text streams as it is decided)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "n_predict =" in err and "stop:   interrupted" in err
    assert "Traceback" not in err


def test_color_marks_accepted_draft_tokens(tiny_pair):
    target, draft = tiny_pair
    code, output = run_cli("run", "-m", str(target), "-md", str(draft), "-p", "the cat", "-n", "24", "--draft", "3",
                           "--color", "-c", "128", "-t", "1")
    assert code == 0 and "\x1b[36m" in output


def test_llamacpp_current_and_old_draft_flag_names(tiny_pair):
    """llama.cpp renamed --draft-max/--draft-min/--draft-p-min to --spec-draft-n-max/-n-min/-p-min:
    both spellings work, --help shows the current one."""
    target, draft = tiny_pair
    runs = {}
    for names in (("--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min"),
                  ("--draft-max", "--draft-min", "--draft-p-min")):
        code, output = run_cli("run", "-m", str(target), "-md", str(draft), "-p", "the cat", "-n", "16", "-t", "1",
                               "--json", names[0], "2", names[1], "1", names[2], "0.5")
        assert code == 0, output
        runs[names[0]] = json.loads(output.splitlines()[-1])["tokens"]
    assert runs["--spec-draft-n-max"] == runs["--draft-max"]
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    assert "--spec-draft-n-max" in help_text and "(also: --draft-max)" in help_text


def test_a_draft_without_its_target_is_an_error_not_ignored(tiny_pair):
    code, output = run_cli("run", "-md", str(tiny_pair[1]), "-p", "x", "-n", "4")
    assert code == 2 and "-md needs -m" in one_line_error(output)


def test_bench_checks_what_it_will_write_and_what_it_runs_before_running(tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the cat", "kind": "raw"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    common = ["bench", "-m", str(target), "-md", str(draft), "-n", "4", "-c", "128", "-t", "1"]
    for args, message in ((["--prompts", str(tmp_path / "empty.jsonl")], "holds no prompt"),
                          (["--prompts", str(prompts), "--draft", ","], "names no configuration"),
                          (["--prompts", str(prompts), "--record-trace", str(tmp_path / "no" / "t.jsonl")],
                           "does not exist"),
                          (["--prompts", str(prompts), "--plot", str(tmp_path)], "is a folder")):
        code, output = run_cli(*common, *args)
        assert code == 2 and message in one_line_error(output), args
    code, output = run_cli(*common, "--prompts", str(prompts), "--repeat", "0")
    assert code == 2 and "--repeat" in output


def test_the_python_api_names_a_bad_argument(tiny_decoder):
    from ggufspec.errors import GgufspecError
    for prompt, options, message in (("the", {"n_draft": 1.5}, "n_draft must be a whole number"),
                                     ("the", {"n_predict": "8"}, "n_predict must be a whole number"),
                                     ([1, 99999], {}, "token ids must be whole numbers in"),
                                     ([-1], {}, "token ids must be whole numbers in")):
        with pytest.raises(GgufspecError, match=message):
            tiny_decoder.generate(prompt, **options)
    for messages in ("hi", [], [{"content": "x"}]):
        with pytest.raises(GgufspecError, match="messages must be a non-empty list"):
            tiny_decoder.chat(messages)
    with pytest.raises(GgufspecError, match="no target model"):
        SpeculativeDecoder(None)


def test_a_blank_api_key_and_bad_eval_options_fail_before_loading(tiny_pair):
    target, draft = tiny_pair
    code, output = run_cli("serve", "-m", str(target), "-md", str(draft), "--api-key", "  ")
    assert code == 2 and "is blank" in one_line_error(output)
    for args in (["-c", "-3"], ["-t", "-2"], ["-n", "0"]):
        code, output = run_cli("eval", "humaneval", "-m", str(target), "-md", str(draft), *args)
        assert code == 2 and "Invalid value" in output, args


def test_a_failed_decode_says_how_the_generation_ended(tiny_pair, monkeypatch):
    from ggufspec.errors import DecodeError
    from ggufspec.native import Context
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as decoder:
        calls, real = [], Context.decode

        def failing(self, tokens, n_logits=1):
            calls.append(1)
            if len(calls) > 3:
                raise DecodeError("llama_decode failed on the target model (code -1)")
            return real(self, tokens, n_logits)
        monkeypatch.setattr(Context, "decode", failing)
        with pytest.raises(DecodeError):
            decoder.generate("the cat", n_predict=40, n_draft=0)
        assert decoder.last_stats.stop_reason == "error"


def test_rpc_timeout_needs_rpc(tiny_pair):
    code, output = run_cli("serve", "-m", str(tiny_pair[0]), "--rpc-timeout", "5")
    assert code == 2 and "give --rpc too" in one_line_error(output)


def test_a_prompt_the_busy_slots_leave_no_cells_for_is_a_503_to_retry():
    """CacheFullError: llama_decode found no room (code 1) because other slots' sequences hold the
    unified cache; theirs end soon, so a client retries (the openai SDK does, after Retry-After)."""
    from ggufspec.errors import CacheFullError
    from ggufspec.server.errors import engine_error
    error = engine_error(CacheFullError("no room in the target model's KV cache: its 512 cells (-c) are taken"))
    assert (error.status, error.code, error.headers) == (503, "kv_cache_full", {"Retry-After": "2"})
    assert "larger -c" in error.message
    assert error.body("/v1/messages")["error"]["type"] == "overloaded_error"


def test_ctrl_c_while_a_model_loads_stops_once_the_load_returns():
    """Python runs a signal's handler at the next Python code, which during a load is llama.cpp's log
    callback: the KeyboardInterrupt raised there, ctypes dropped, and the load (and the run after it)
    went on as if Ctrl-C had not been pressed. The demo target loads for a second or so."""
    import os
    import signal
    import threading
    import time
    from conftest import demo_pair_paths
    from ggufspec.load import LoadParams, open_model
    target, _ = demo_pair_paths()
    started = time.perf_counter()
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        open_model(target, "target", LoadParams(n_threads=1))
        time.sleep(60)  # a Ctrl-C lost in the load would land here (or never: 60 s)
    assert time.perf_counter() - started < 45  # the load alone, however busy the machine


def _cli(*args, env=None, **kwargs):
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "ggufspec.cli", *args], capture_output=True, text=True,
                          errors="replace", env={**os.environ, **(env or {})}, timeout=120, **kwargs)


def test_a_terminal_that_cannot_show_utf8_gets_replacements_not_a_traceback(tiny_pair):
    target, draft = tiny_pair
    done = _cli("run", "-m", str(target), "-md", str(draft), "-t", "1", "-p", "the cat", "-n", "8", "-c", "128",
                env={"PYTHONIOENCODING": "ascii", "LC_ALL": "C", "PYTHONUTF8": "0"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_closed_standard_streams_are_one_line_or_an_empty_input(tiny_pair):
    import subprocess
    target, draft = tiny_pair
    script = ("import os, subprocess, sys; os.close(1); "
              f"sys.exit(subprocess.call([sys.executable, '-m', 'ggufspec.cli', 'run', '-m', {str(target)!r}, '-t', '1', "
              "'-p', 'hi', '-n', '4'], stdout=None))")
    done = subprocess.run([__import__("sys").executable, "-c", script], stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2 and "standard output is closed" in done.stderr and "Traceback" not in done.stderr
    chat = subprocess.run([__import__("sys").executable, "-m", "ggufspec.cli", "chat", "-m", str(target), "-md",
                           str(draft), "-t", "1", "-c", "128"], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr


@pytest.mark.parametrize("flag, value", [("-n", "0"), ("-t", "0"), ("-t", "-3"), ("-s", "-5"), ("-c", "-5"),
                                         ("--spec-draft-p-min", "5"), ("--temp", "nan")])
def test_bench_refuses_what_run_refuses_before_loading_anything(flag, value):
    result = CliRunner().invoke(main, ["bench", "-m", "/nonexistent.gguf", flag, value])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "nonexistent" not in result.output  # refused before the models were looked for


def test_bench_plot_without_matplotlib_fails_before_the_run_not_after(tmp_path):
    import importlib.util
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed here")
    result = CliRunner().invoke(main, ["bench", "-m", "/nonexistent.gguf", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "--plot needs matplotlib" in result.output, result.output


def test_messages_that_point_at_the_fix(tiny_pair, tmp_path):
    target, _ = tiny_pair
    for args, says in ((["run", "-m", str(tmp_path), "-p", "hi"], "is a folder: give a .gguf file"),
                       (["plan", "-m", str(tmp_path)], "is a folder: give a .gguf file"),
                       (["run", str(target), "-p", "hi"], "a model file is given with -m FILE"),
                       (["run", "-m", str(target), "--no-draft", "--lookup", "-p", "hi"], "--no-draft runs the target alone")):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and says in result.output, (args, result.output)


def test_a_chat_turn_cut_by_the_context_says_so():
    from ggufspec.stats import Stats
    from ggufspec.terminal import chat_stats_line
    stats = Stats()
    stats.stop_reason = "context"
    assert "the context is full: /reset" in chat_stats_line(stats)


def test_exact_refuses_what_it_cannot_make_exact(tiny_pair):
    """--exact: float weights take llamafile's batch kernels (nothing switches them off), and a model
    opened earlier in the process may have fixed the tiled products' switch (read once per process):
    both refused in one line, not answers that are silently not bit-exact. A fresh process each."""
    import subprocess
    import sys
    target, _ = tiny_pair
    done = subprocess.run([sys.executable, "-m", "ggufspec.cli", "run", "-m", str(target), "--exact", "-p", "hi",
                           "-n", "4", "-t", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "weights are F32" in done.stderr and "--strict" in done.stderr, done.stderr
    script = ("import sys; from ggufspec.load import LoadParams, open_model; from ggufspec.errors import GgufspecError\n"
              f"open_model({str(target)!r}, 'target', LoadParams(n_ctx=64, n_threads=1))\n"
              "try:\n"
              f"    open_model({str(target)!r}, 'target', LoadParams(n_ctx=64, n_threads=1, exact=True))\n"
              "except GgufspecError as exc:\n"
              "    print(exc)\n")
    later = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "open the --exact one in a fresh process" in later.stdout, later.stdout + later.stderr


def test_a_load_that_ran_out_of_memory_says_where_and_what_to_change():
    """llama.cpp's exception says only "Failed to load model from file"; its log names the buffer."""
    from ggufspec import llamalog
    from ggufspec.load import LoadParams, load_failure
    failed = RuntimeError("Failed to load model from file")
    for line, says in [(b"alloc_tensor_range: failed to allocate CUDA0 buffer of size 1073741824\n",
                        "CUDA0 ran out of memory: it could not allocate 1024.0 MiB; use fewer layers there (-ngl N)"),
                       (b"failed to allocate CPU buffer of size 2097152\n", "CPU ran out of memory: it could not "
                                                                            "allocate 2.0 MiB; use a smaller context")]:
        llamalog._log_to_stderr_if_verbose(4, line, None)
        assert load_failure(failed, LoadParams(n_ctx=4096)).startswith(says)
        assert llamalog.allocation_failures() == []  # taken by the load that failed
    assert load_failure(failed, LoadParams()) == "Failed to load model from file"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/maps")
def test_a_stop_signal_while_serve_loads_its_model_ends_it_once_the_load_returns(tmp_path):
    """SIGTERM (a service manager's stop) during the load ran serve's SystemExit in llama.cpp's log
    callback, which ctypes drops ("Exception ignored"): the load went on and the server began to serve.
    Sent once the target file is mapped (the load under way), it now ends the server after the load."""
    import os
    import signal
    import subprocess
    import time
    from conftest import demo_pair_paths
    target, _ = demo_pair_paths()
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "serve", "--port", "0", "-m", str(target),
                             "--no-draft", "-t", "1"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GGUFSPEC_HOME": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while str(target) not in Path(f"/proc/{proc.pid}/maps").read_text() and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)  # it served on, before: a timeout
        assert proc.returncode == 0 and "serving" not in stderr and "Traceback" not in stderr, stderr
    finally:
        proc.kill()
