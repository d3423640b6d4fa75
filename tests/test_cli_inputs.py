"""Input the command line refuses in one line (exit code 2) instead of a traceback or a silent choice:
text that is no UTF-8, -s below -1, contradictory drafting flags; and -s -1 as llama.cpp means it."""
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.speculate import SpeculativeDecoder
from clierrors import one_line_error


def run(tiny_pair, *flags):
    target, draft = tiny_pair
    return CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-n", "4", "-c", "128", "-t", "1",
                                     *flags])


def test_a_prompt_file_that_is_not_utf8(tiny_pair, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9\n")
    one_line_error(run(tiny_pair, "-f", str(latin1)), "-f/--file", "latin1.txt", "not UTF-8", "0xe9")


def test_an_empty_prompt_file_is_named(tiny_pair, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    one_line_error(run(tiny_pair, "-f", str(tmp_path / "empty.txt")), "-f", "empty.txt: the file is empty")


def test_a_grammar_file_that_is_not_utf8(tiny_pair, tmp_path):
    grammar = tmp_path / "bad.gbnf"
    grammar.write_bytes(b'root ::= "\xe9"\n')
    one_line_error(run(tiny_pair, "-p", "hi", "--grammar-file", str(grammar)), "--grammar-file", "not UTF-8")


@pytest.mark.parametrize("flags, option", [
    (["-p", "caf\udce9"], "-p/--prompt"),                     # how Python hands over argv bytes that are no UTF-8
    (["-p", "hi", "--chat", "--system", "\udce9"], "--system"),
    (["-p", "hi", "--grammar", 'root ::= "\udce9"'], "--grammar"),
    (["-p", "hi", "-j", '{"const": "\udce9"}'], "--json-schema"),
])
def test_argv_text_that_is_not_utf8(tiny_pair, flags, option):
    one_line_error(run(tiny_pair, *flags), option, "not UTF-8", "0xe9")


def test_argv_bytes_that_are_not_utf8_from_a_shell(tiny_pair):
    """The real thing: a shell passing -p $'caf\\xe9' to the command."""
    target, draft = tiny_pair
    done = subprocess.run([sys.executable, "-m", "ggufspec.cli", "run", "-m", str(target), "-md", str(draft),
                           "-n", "2", "-t", "1", "-p", b"caf\xe9"], capture_output=True,
                          env={**os.environ, "LC_ALL": "C.UTF-8"}, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode(errors="replace").strip().count("\n") == 0
    assert b"-p/--prompt is not UTF-8 text" in done.stderr


def test_chat_system_that_is_not_utf8(tiny_pair):
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["chat", "-m", str(target), "-md", str(draft), "--system", "\udce9"], input="")
    one_line_error(result, "--system", "not UTF-8")


def test_seed_minus_one_is_random(tiny_pair, monkeypatch):
    seeds = []
    stream = SpeculativeDecoder.stream

    def recording(self, prompt, **options):
        seeds.append(options.get("seed"))
        return stream(self, prompt, **options)
    monkeypatch.setattr(SpeculativeDecoder, "stream", recording)
    for seed in ("-1", "7"):
        result = run(tiny_pair, "-p", "hi", "-s", seed, "--temp", "1.5", "--json")
        assert result.exit_code == 0, result.output
    assert seeds == [None, 7]  # None: a random seed per generation, as without -s


def test_seed_below_minus_one_is_refused(tiny_pair):
    one_line_error(run(tiny_pair, "-p", "hi", "-s", "-2"), "-s/--seed", "-1 for a random one")


@pytest.mark.parametrize("flags, words", [
    (["--no-draft", "--draft", "3"], ["--no-draft", "--draft 3"]),
    (["--spec-draft-n-min", "5", "--spec-draft-n-max", "2"], ["--spec-draft-n-min 5", "--spec-draft-n-max 2"]),
    (["--draft", "2", "--draft-min", "3"], ["--spec-draft-n-min 3", "--draft 2"]),
])
def test_contradictory_drafting_flags(tiny_pair, flags, words):
    one_line_error(run(tiny_pair, "-p", "hi", *flags), *words)


@pytest.mark.parametrize("flags", [["--no-draft"], ["--no-draft", "--draft", "0"],
                                   ["--spec-draft-n-min", "2", "--spec-draft-n-max", "2"]])
def test_consistent_drafting_flags_still_run(tiny_pair, flags):
    result = run(tiny_pair, "-p", "hi", "--json", *flags)
    assert result.exit_code == 0, result.output


def test_llama_cpps_long_flag_names_are_taken_too(tiny_pair):
    """A llama.cpp command line copied over: --n-gpu-layers, --n-gpu-layers-draft and -sys/--system-prompt
    (llama.cpp's names) are -ngl, -ngld and --system here."""
    short = run(tiny_pair, "-p", "hi", "--chat", "--system", "Be brief.", "-ngl", "0", "-ngld", "0", "--temp", "0")
    for flags in (["-sys", "Be brief.", "--n-gpu-layers", "0", "--n-gpu-layers-draft", "0"],
                  ["--system-prompt", "Be brief.", "--gpu-layers", "0", "--gpu-layers-draft", "0"]):
        long = run(tiny_pair, "-p", "hi", "--chat", *flags, "--temp", "0")
        assert long.exit_code == short.exit_code == 0 and long.stdout == short.stdout, long.output


@pytest.mark.parametrize("args, words", [
    (["run", "-jf", "/nonexistent/schema.json", "-p", "x"], ["'-jf' / '--json-schema-file'", "/nonexistent/schema.json",
                                                              "'ggufspec run --help'"]),
    (["run", "--grammar-file", "/nonexistent/g.gbnf"], ["'--grammar-file'", "does not exist"]),
    (["run", "-n", "many"], ["'-n' / '--n-predict'", "'many' is not a valid integer"]),
    (["serve", "--no-such-flag"], ["No such option '--no-such-flag'", "'ggufspec serve --help'"]),
    (["runn"], ["No such command 'runn'", "Did you mean 'run'?", "'ggufspec --help'"]),
    (["eval", "humaneval", "--bogus"], ["'--bogus'", "'ggufspec eval humaneval --help'"]),
])
def test_a_usage_error_is_one_line_naming_the_help_to_read(args, words):
    """Click writes a usage error in four lines (usage, a hint, a blank, the error): one line here,
    as every other error of ggufspec's, exit code 2 as click's."""
    one_line_error(CliRunner().invoke(main, args, prog_name="ggufspec"), *words)


def test_a_group_without_its_command_still_shows_its_help():
    result = CliRunner().invoke(main, ["eval"])
    assert result.exit_code == 2 and "humaneval" in result.output and "Usage:" in result.output


def test_a_truncated_model_is_one_line_and_nothing_from_ggml(tiny_pair, tmp_path):
    """ggml's reader printed "gguf_init_from_reader: failed to read key-value pairs" above the error (the MTP
    blocks' check read the header without capturing ggml's log, audit): `ggufheader` reads every header."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_pair[0].read_bytes()[:300])
    done = subprocess.run([sys.executable, "-m", "ggufspec.cli", "run", "-m", str(cut), "-p", "the cat", "-n", "2",
                           "-t", "1"], capture_output=True, text=True, env={**os.environ, "GGUFSPEC_HOME": str(tmp_path)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot read its GGUF header" in done.stderr and "gguf_init" not in done.stderr


def test_a_model_whose_tensor_data_is_cut_short_says_so_and_to_download_it_again(tiny_pair, tmp_path):
    """llama.cpp says only "Failed to load model from file" (audit)."""
    data = tiny_pair[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) * 3 // 4])
    one_line_error(run(tiny_pair, "-m", str(cut), "-p", "the cat"), "the file is cut short",
                   f"{len(data) * 3 // 4:,} of the {len(data):,} bytes", "download it again")
