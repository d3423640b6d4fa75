"""llama.cpp's sampler flags and its chain's order, on run, chat and serve: taken (the command goes on to
the model), or a chain in another order than ggufspec's, or a bad value, refused in one line before
anything loads. Every llama.cpp sampler is ggufspec's (tests/test_llamacpp_samplers.py, tests/test_dry.py,
tests/test_stateful_samplers.py): a chain may leave one out where it is off; adaptive-p acts only where
the chain lists adaptive_p."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from clierrors import one_line_error

DEFAULT_CHAIN = "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature"


def invoke(command: str, *flags: str):
    extra = ["-p", "hi"] if command == "run" else []
    return CliRunner().invoke(main, [command, "-m", "/nonexistent.gguf", *extra, *flags], input="")


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
@pytest.mark.parametrize("flags", [
    ["--mirostat", "0", "--mirostat-lr", "0.2", "--mirostat-ent", "4"],
    ["--typical", "1", "--top-nsigma", "-1", "--xtc-probability", "0", "--xtc-threshold", "0.2"],
    ["--dry-multiplier", "0", "--dry-base", "1.75", "--dry-allowed-length", "2", "--dry-sequence-breaker", "none"],
    ["--dynatemp-range", "0", "--dynatemp-exp", "1", "--adaptive-target", "-1", "--adaptive-decay", "0.9"],
    ["--min-keep", "1"],
    ["--min-keep", "5", "--top-p", "0.5"],
    ["--adaptive-target", "0.3", "--xtc-probability", "0.5"],  # adaptive-p off: the chain does not list it
    ["--adaptive-target", "0.3", "--adaptive-decay", "0.5", "--samplers", DEFAULT_CHAIN + ";adaptive_p"],
    ["--samplers", DEFAULT_CHAIN],
    ["--samplers", "penalties;top-k;nucleus;min-p;temp"],
    ["--sampling-seq", "edkypmxt"],
    ["--typical", "0.9", "--top-nsigma", "1.5", "--xtc-probability", "0.5", "--xtc-threshold", "0.2"],
    ["--typical", "0.9", "--samplers", "penalties;top_k;typ_p;top_p;min_p;temperature"],
    ["--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3", "--dry-penalty-last-n", "-1",
     "--dry-sequence-breaker", ":", "--dry-sequence-breaker", "end"],
    ["--dynatemp-range", "0.5", "--dynatemp-exp", "2", "--samplers", "penalties;dry;top_k;top_p;min_p;temperature"],
    ["--mirostat", "2", "--mirostat-ent", "3", "--mirostat-lr", "0.2", "--samplers", "top_p;top_k"],  # not read there
])
def test_off_values_and_the_default_chain_are_taken(command, flags):
    said = invoke(command, *flags).stderr
    assert "target model not found" in said, said  # past the flags, to the model


@pytest.mark.parametrize("flags, words", [
    (["--mirostat", "3"], "--mirostat must be 0 (off), 1 or 2"),
    (["--mirostat", "2", "--mirostat-ent", "nan"], "mirostat_tau must be a finite number"),
    (["--typical", "0.9", "--samplers", "penalties;top_k;top_p;min_p;temperature"], "all and in that order"),
    (["--xtc-probability", "0.5", "--sampling-seq", "ekpmt"], "all and in that order"),
    (["--typical", "-0.5"], "--typical must be >= 0"),
    (["--xtc-probability", "2"], "--xtc-probability must be in [0, 1]"),
    (["--top-nsigma", "nan"], "top_n_sigma must be a finite number"),
    (["--dry-multiplier", "0.8", "--samplers", "penalties;top_k;top_p;min_p;temperature"], "all and in that order"),
    (["--dry-base", "0.5"], "dry_base must be a number >= 1"),
    (["--dry-penalty-last-n", "-3"], "dry_penalty_last_n must be >= -1"),
    (["--dry-sequence-breaker", "none", "--dry-sequence-breaker", ":"], "none means no breakers"),
    (["--dynatemp-exp", "-1"], "--dynatemp-exp must be >= 0"),
    (["--adaptive-decay", "1.5"], "adaptive_decay must be in [0, 0.99]"),
    (["--adaptive-target", "0.3", "--xtc-probability", "0.5", "--samplers", DEFAULT_CHAIN + ";adaptive_p"],
     "adaptive-p with XTC"),
    (["--min-keep", "-1"], "--min-keep must be >= 0"),
    (["--sampling-seq", "kt"], "all and in that order"),
    (["--samplers", "top_p;top_k;min_p;temperature;penalties"], "all and in that order"),
    (["--samplers", "penalties;fancy"], "unknown sampler 'fancy'"),
    (["--sampling-seq", "ekpmti"], "the infill sampler is not supported"),
])
def test_a_sampler_turned_on_or_another_order_is_one_line(flags, words):
    for command in ("run", "serve"):
        one_line_error(invoke(command, *flags), words)
