"""Numbers past what llama.cpp can hold, and output that cannot be written: one line each, never a native
abort, a hang or a traceback. Thread counts up to GGML_MAX_N_THREADS; -c, -b, -ub in 32 bits (and -c's
memory failing in Python too); bench --streams and serve -np within -c, -b and LLAMA_MAX_SEQ; -ncmoe,
-ncmoed and -ncffn past the model's layers meaning every layer, without a pattern per number; nan and inf
refused by the float options; --image '' refused as --image is; a full disk or /dev/full under stdout or
--log-file; a closed pipe quiet. The cases that aborted or hung the process run in a child process (or on
a model path that does not exist, refused before anything would load), so that the suite survives them."""
import contextlib
import json
import re
import resource
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ggufspec import placement
from ggufspec.cli import main
from ggufspec.tinymodels import Shape
from clierrors import one_line_error

MISSING = "/nonexistent/model.gguf"  # a command refused at parsing fails before it would look for it
PROMPT = ["-p", "the cat sat", "-n", "4", "-t", "1"]


def run(tiny_pair, *flags, command="run"):
    target, draft = tiny_pair
    return CliRunner().invoke(main, [command, "-m", str(target), "-md", str(draft), "-c", "128", *PROMPT, *flags],
                              input="")


def child(*argv, stdout=subprocess.DEVNULL, timeout=120):
    """`ggufspec ARGV` in a child process of at most 4 GiB of address space (what ran away before ends in
    a MemoryError there): its return code and stderr."""
    done = subprocess.run([sys.executable, "-m", "ggufspec.cli", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, timeout=timeout, preexec_fn=_at_most_4_gib)
    return done.returncode, done.stderr.decode(errors="replace")


def _at_most_4_gib():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def one_line(stderr: str, *words) -> str:
    line = stderr.strip()
    assert line.startswith("ggufspec: error:") and "\n" not in line and "Traceback" not in stderr, stderr
    for word in words:
        assert word in line, line
    return line


@contextlib.contextmanager
def within(seconds: int):
    """The block must end within `seconds` (SIGALRM): a loop as long as its N fails instead of hanging."""
    def expired(*_):
        raise TimeoutError(f"took more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- thread counts: GGML_MAX_N_THREADS

@pytest.mark.parametrize("flag", ["-t", "-tb", "-td", "-tbd"])
@pytest.mark.parametrize("value", ["513", str(2 ** 32 + 1)])  # 2**32 + 1 wrapped to 1 thread in ctypes
def test_thread_counts_past_ggml_max_n_threads(tiny_pair, flag, value):
    one_line_error(run(tiny_pair, flag, value), flag, value, "512", "GGML_MAX_N_THREADS")


@pytest.mark.parametrize("command", [["bench", "--prompts", MISSING], ["plan"], ["eval", "humaneval"]])
def test_the_other_commands_threads_too(command):
    result = CliRunner().invoke(main, [*command, "-m", MISSING, "-t", "513"])
    one_line_error(result, "-t", "513", "GGML_MAX_N_THREADS")


def test_a_huge_threads_batch_is_no_native_abort(tiny_pair):
    """The audit's case: std::bad_alloc, exit code 134."""
    code, stderr = child("run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-c", "128", *PROMPT,
                         "-tb", "99999999999999999999")
    assert code == 2, stderr
    one_line(stderr, "-tb", "GGML_MAX_N_THREADS")


# ---------------------------------------------------------------- -c, -b, -ub: 32 bits, and memory

@pytest.mark.parametrize("flags", [["-c", "99999999999999999999"], ["-c", str(2 ** 32)], ["-b", str(2 ** 32 + 9)],
                                   ["-ub", str(2 ** 32)]])
def test_token_counts_past_32_bits_are_refused_at_parsing(tiny_pair, flags):
    """Wrapped in ctypes before (-c 2**32 was 0: the model's own context), or aborted."""
    code, stderr = child("run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), *PROMPT, *flags)
    assert code == 2, stderr
    one_line(stderr, flags[0], flags[1], "4294967295")


def test_a_context_python_has_no_memory_for_is_one_line(tiny_pair, monkeypatch):
    """llama-cpp-python allocates n_ctx-long numpy arrays after the context: their MemoryError is the line
    llama.cpp's own allocation failures get."""
    import llama_cpp

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 16.0 GiB for an array with shape (4294967295,) and data type int32")
    monkeypatch.setattr(llama_cpp, "Llama", out_of_memory)
    one_line_error(run(tiny_pair), "could not load the target model", "Unable to allocate 16.0 GiB",
                   "(-c 128: a smaller context needs less memory)")


# ---------------------------------------------------------------- sequences at once: -c, -b, LLAMA_MAX_SEQ

@pytest.mark.parametrize("flags, words", [
    (["--streams", "129", "-c", "128"], ["--streams 129", "at most 128", "raise -c"]),
    (["--streams", "1,300", "-c", "4096"], ["--streams 300", "at most 256", "LLAMA_MAX_SEQ"]),
    (["--streams", "16", "-c", "4096", "-b", "9"], ["--streams 16", "at most 9", "raise -b"]),
])
def test_bench_streams_within_what_a_context_holds(flags, words):
    result = CliRunner().invoke(main, ["bench", "-m", MISSING, "-md", MISSING, "-t", "1", *flags])
    one_line_error(result, *words)


@pytest.mark.parametrize("flags, words", [
    (["-np", "64", "-c", "32"], ["-np 64", "at most 32", "raise -c"]),
    (["-np", "8", "-b", "4", "--draft", "3"], ["-np 8", "at most 4", "raise -b"]),
])
def test_serve_slots_within_what_a_context_holds(flags, words):
    one_line_error(CliRunner().invoke(main, ["serve", "-m", MISSING, "-md", MISSING, *flags]), *words)


def test_serve_strict_slots_each_have_their_own_cells(monkeypatch):
    """--strict gives each slot a cache of its own (-c cells each): -c bounds nothing there."""
    from ggufspec.cli import generate
    from ggufspec.errors import GgufspecError
    checked = []

    def check(*args):
        checked.append(args)
        raise GgufspecError("checked")
    monkeypatch.setattr(generate, "check_sequences", check)
    one_line_error(CliRunner().invoke(main, ["serve", "-m", MISSING, "-np", "64", "-c", "32", "--strict"]), "checked")
    assert checked == [("-np", 64, None, None, None)]


def test_the_audits_streams_past_the_context_is_no_native_abort(tiny_pair, tmp_path):
    """GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) before."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "raw", "prompt": "the cat sat"}) + "\n")
    code, stderr = child("bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-n", "4", "-t", "1", "-c", "128",
                         "--prompts", str(prompts), "--streams", "129")
    assert code == 2, stderr
    one_line(stderr, "--streams 129", "at most 128")


# ---------------------------------------------------------------- -ncmoe, -ncmoed, -ncffn past the layers

def test_a_huge_layer_count_builds_no_pattern_per_number(tiny_pair):
    with within(3):
        experts = placement.tensor_overrides((), cpu_moe=False, n_cpu_moe=99999999999)
        dense = placement.dense_ffn_overrides(99999999999)
    assert len(experts) == len(dense) == placement.MAX_LAYERS
    assert experts[:2] == placement.expert_overrides(False, 2)
    target = tiny_pair[0]
    assert placement.block_count(target) == Shape().n_layer
    array = placement.override_array(experts + dense, "-ot", target)  # what llama.cpp gets: the model's layers
    assert [array[i].pattern.decode() for i in range(len(array) - 1)] == [
        pattern for pattern, _ in placement.expert_overrides(False, 2) + placement.dense_ffn_overrides(2)]
    tensors = [(f"blk.{i}.ffn_up.weight", 10) for i in range(2)] + [("output.weight", 5)]
    with within(3):
        assert placement.host_tensor_bytes(tensors, experts + dense) == {"blk.0.ffn_up.weight": 10,
                                                                         "blk.1.ffn_up.weight": 10}


def test_a_huge_ncffn_is_every_layer_on_the_cli(tiny_pair):
    """The dense FFN weights of every layer on the CPU (llama.cpp's load log, -v), in the time of a small N."""
    code, stderr = child("run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-c", "128", *PROMPT, "-v",
                         "-ncmoe", "99999999999", "-ncmoed", "99999999999", "-ncffn", "99999999999", timeout=90)
    assert code == 0, stderr[-2000:]
    moved = set(re.findall(r"tensor (blk\.\d+\.ffn_\w+)\.weight .* buffer type overridden to CPU", stderr))
    assert moved == {f"blk.{i}.ffn_{part}" for i in range(Shape().n_layer) for part in ("up", "down", "gate")}


# ---------------------------------------------------------------- nan, inf; --image ''

@pytest.mark.parametrize("flags, words", [
    (["-sps", "nan"], ["-sps", "nan", "finite"]),
    (["--sse-ping-interval", "-5"], ["--sse-ping-interval", "-5"]),
    (["--rpc-timeout", "nan"], ["--rpc-timeout", "nan", "finite"]),
    (["--rpc-timeout", "inf"], ["--rpc-timeout", "inf", "finite"]),
    (["--spec-draft-p-min", "nan"], ["--spec-draft-p-min", "nan", "finite"]),
    (["-to", "1" + "0" * 400], ["-to", "more than 2147483647"]),  # was an OverflowError in every request
    (["--threads-http", "1" + "0" * 30], ["--threads-http", "more than 2147483647"]),
])
def test_serve_refuses_nan_and_inf(flags, words):
    one_line_error(CliRunner().invoke(main, ["serve", "-m", MISSING, *flags]), *words)


@pytest.mark.parametrize("command, flags", [
    (["run", "-p", "hi"], ["--rpc-timeout", "nan"]),
    (["run", "-p", "hi"], ["--draft-p-min", "nan"]),
    (["bench"], ["--draft-p-min", "nan"]),
    (["eval", "humaneval"], ["--temp", "nan"]),
])
def test_the_other_commands_refuse_nan(command, flags):
    one_line_error(CliRunner().invoke(main, [*command, "-m", MISSING, *flags]), flags[0], "nan", "finite")


@pytest.mark.parametrize("flags", [["--image", ""], ["--audio", ""]])
def test_an_empty_image_is_refused_as_any_image(tiny_pair, flags):
    one_line_error(run(tiny_pair, *flags), "--image/--audio/--video ", "not supported on run")


# ---------------------------------------------------------------- output that cannot be written

@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_run_to_a_full_disk_is_one_line(tiny_pair, flags):
    with open("/dev/full", "w") as full:
        code, stderr = child("run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-c", "128", *PROMPT,
                             *flags, stdout=full)
    assert code == 1, stderr
    assert one_line(stderr.splitlines()[-1]) == "ggufspec: error: could not write the output: No space left on device"
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_list_to_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        code, stderr = child("list", stdout=full)
    assert code == 1
    one_line(stderr, "could not write the output: No space left on device")


def test_a_log_file_on_a_full_disk_is_one_line(tiny_pair):
    code, stderr = child("run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-c", "128", *PROMPT,
                         "--log-file", "/dev/full")
    assert code == 1, stderr
    assert "Traceback" not in stderr, stderr
    one_line(stderr.strip().splitlines()[-1], "--log-file /dev/full: could not write the log: No space left on device")


def test_a_closed_pipe_ends_quietly(tiny_pair):
    """`ggufspec run ... | head -c1`: no traceback, no error line (click's exit code 1 for a broken pipe)."""
    process = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "run", "-m", str(tiny_pair[0]), "-md",
                                str(tiny_pair[1]), "-c", "128", *PROMPT, "--ignore-eos"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    process.stdout.close()  # before the models load: every write finds the pipe closed
    stderr = process.stderr.read().decode(errors="replace")
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "error" not in stderr and "Exception ignored" not in stderr, stderr
