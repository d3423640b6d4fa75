"""llama.cpp's --spec-type on run/chat/serve: its kinds of speculative decoding as ggufspec's drafters
(none: the target alone; draft-simple: the draft model; draft-mtp: MTP heads; ngram-*: n-gram lookup; a
model kind with an n-gram one: hybrid), and the kinds and n-gram sizes ggufspec lacks refused in one line.
The text is the target's whichever drafter: the same greedy answer as --no-draft."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.cli.spec_type import apply_spec_type
from ggufspec.errors import GgufspecError
from clierrors import one_line_error


def mapped(value, **given):
    opts = {"spec_type": value, "model_draft": None, **given}
    opts.update({name: None for name in ("spec_ngram_mod_n_min", "spec_ngram_mod_n_max", "spec_ngram_mod_n_match",
                                         "spec_ngram_simple_size_n", "spec_ngram_simple_size_m",
                                         "spec_ngram_simple_min_hits", "spec_ngram_map_k_size_n",
                                         "spec_ngram_map_k_size_m", "spec_ngram_map_k_min_hits",
                                         "spec_ngram_map_k4v_size_n", "spec_ngram_map_k4v_size_m",
                                         "spec_ngram_map_k4v_min_hits", "spec_ngram_size_n", "spec_ngram_size_m",
                                         "spec_ngram_min_hits") if name not in given})
    apply_spec_type(opts)
    return {k: v for k, v in opts.items() if v is not None and not k.startswith("spec_ngram")}


@pytest.mark.parametrize("value, expected", [
    ("none", {"no_draft": True}),
    ("draft-simple", {}),
    ("draft-mtp", {"model_draft": "mtp"}),
    ("ngram-mod", {"lookup": True}),
    ("ngram-simple,ngram-map-k", {"lookup": True}),
    ("draft-simple,ngram-mod", {"hybrid": True}),
    ("draft-mtp,ngram-cache", {"model_draft": "mtp", "hybrid": True}),
])
def test_each_kind_is_one_of_ggufspecs_drafters(value, expected):
    assert mapped(value) == expected


@pytest.mark.parametrize("value, given, words", [
    ("draft-eagle3", {}, "ggufspec drafts with a draft model"),
    ("ngram-fancy", {}, "unknown kind 'ngram-fancy'"),
    ("none,ngram-mod", {}, "none drafts nothing"),
    ("draft-simple,draft-mtp", {}, "not both"),
    ("draft-mtp", {"model_draft": "d.gguf"}, "give one of them"),
    (None, {"spec_ngram_size_n": "3"}, "--spec-ngram-size-n is not supported"),
])
def test_what_ggufspec_lacks_is_one_line(value, given, words):
    with pytest.raises(GgufspecError, match=words):
        mapped(value, **given)


def run(tiny_pair, *flags):
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "-p", "the cat sat", "-n", "24", "-c", "256", "-t",
                                       "1", "--temp", "0", "--json", *flags])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_run_drafts_as_the_kind_says_and_the_text_stays_the_targets(tiny_pair):
    alone = run(tiny_pair, "--no-draft")
    for flags, drafter in ((["--spec-type", "none", "-md", str(tiny_pair[1]), "--draft", "3"], "none"),  # none wins
                           (["--spec-type", "ngram-mod", "--draft", "3"], "lookup"),
                           (["--spec-type", "draft-simple", "-md", str(tiny_pair[1]), "--draft", "3"], "model"),
                           (["--spec-type", "draft-simple,ngram-simple", "-md", str(tiny_pair[1]), "--draft", "3"],
                            "hybrid")):
        got = run(tiny_pair, *flags)
        assert got["stats"]["drafter"] == drafter, flags
        assert got["text"] == alone["text"], flags


def test_a_pasted_ngram_size_fails_before_anything_loads():
    result = CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", "--spec-type", "ngram-mod",
                                       "--spec-ngram-mod-n-match", "24"])
    one_line_error(result, "--spec-ngram-mod-n-match is not supported")
