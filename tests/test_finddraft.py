"""Which draft `-m` alone gets (tokenizer fingerprints from GGUF headers, sizes, --draft-dir, the
registry's pair, else n-gram drafting), and the one-line errors of bad drafting input."""
import json
import shutil

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.errors import GgufspecError, IncompatibleModelsError
from ggufspec.finddraft import check_draft, check_draft_dir, choose_draft
from ggufspec.fingerprint import differences, read_fingerprint
from ggufspec.tinymodels import Shape, make_weights, vocabulary, write_model
from serverproc import serving


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 12-layer target; a 1-layer draft with its tokenizer (over 5x smaller); the same draft with one
    token text changed; a 1-layer model with 16 extra words (a size llama.cpp still pairs); and a
    second target (2 layers) too close in size to the draft."""
    folder = tmp_path_factory.mktemp("finddraft")
    big = Shape(n_layer=12, eos_bias=4.0)
    weights = make_weights(big, seed=0)
    one = Shape(**{**big.__dict__, "n_layer": 1})
    first_layer = {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    tokens, _ = vocabulary()
    tokens[270] = "▁zebra"
    extra = Shape(**{**one.__dict__, "extra_words": 16})
    (folder / "drafts").mkdir()
    return {"target": write_model(folder / "target.gguf", big, weights),
            "draft": write_model(folder / "drafts" / "small.gguf", one, first_layer),
            "other": write_model(folder / "other.gguf", one, first_layer, tokens=tokens),
            "extra": write_model(folder / "extra.gguf", extra, make_weights(extra, seed=1)),
            "close": write_model(folder / "close.gguf", Shape(n_layer=2), make_weights(Shape(n_layer=2), seed=0)),
            "folder": folder}


def test_fingerprints_compare_tokenizers_not_file_names(models):
    target, draft = read_fingerprint(models["target"]), read_fingerprint(models["draft"])
    assert target == draft and target.n_vocab == len(vocabulary()[0]) and target.pre == "default"
    assert differences(target, read_fingerprint(models["other"])) == ["token texts"]
    # 16 more ids: pairs (as llama.cpp) when the ids both have agree, which reads both lists again
    extra = read_fingerprint(models["extra"])
    assert differences(target, extra, models["target"], models["extra"]) == []
    assert differences(target, extra) == [f"token texts (of the {target.n_vocab} ids both have)"]


def test_a_matching_smaller_model_is_chosen(models):
    choice = choose_draft(models["target"], [models["draft"].parent])
    assert choice.kind == "model" and choice.path == str(models["draft"])
    assert "shares the target's tokenizer" in choice.why and "x smaller" in choice.why


def test_a_draft_cut_short_is_neither_chosen_nor_offered(models, tmp_path):
    """Its header reads, so it was chosen (or offered as a file that would work) and then failed to load (audit)."""
    data = models["draft"].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    assert choose_draft(models["target"], [tmp_path]).kind == "ngram"
    with pytest.raises(IncompatibleModelsError) as caught:
        check_draft(models["target"], models["other"], folders=[tmp_path])
    assert "cut.gguf" not in str(caught.value)
    shutil.copy(models["draft"], tmp_path / "whole.gguf")
    assert choose_draft(models["target"], [tmp_path]).path == str(tmp_path / "whole.gguf")


def test_no_match_no_pair_means_ngram(models, tmp_path):
    shutil.copy(models["other"], tmp_path / "renamed-small.gguf")  # a matching name proves nothing
    choice = choose_draft(models["target"], [tmp_path])
    assert choice.kind == "ngram" and choice.path is None and "at least 5x smaller" in choice.why
    # a matching tokenizer that is not 5x smaller is not taken either
    assert choose_draft(models["close"], [models["draft"].parent]).kind == "ngram"


def test_the_registry_pair_for_the_target(models, ggufspec_home):
    """A target the registry knows by its file: its pair's draft when on disk, else how to get it."""
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    (ggufspec_home / "models.toml").write_text(
        '[models.tiny-target]\nrepo = "org/tiny-GGUF"\nfile = "target.gguf"\n'
        '[models.tiny-draft]\nrepo = "org/tiny-draft-GGUF"\nfile = "d.gguf"\n'
        '[pairs.tiny]\ntarget = "tiny-target"\ndraft = "tiny-draft"\n')
    choice = choose_draft(models["target"], [])
    assert choice.kind == "ngram" and "`ggufspec pull tiny` gets its draft" in choice.why
    stored = ggufspec_home / "models" / "org__tiny-draft-GGUF" / "d.gguf"
    stored.parent.mkdir(parents=True)
    shutil.copy(models["close"], stored)  # not 5x smaller, but the registry pairs them
    choice = choose_draft(models["target"], [])
    assert choice.kind == "model" and choice.path == str(stored) and choice.why == "the registry pair tiny"


def test_a_named_draft_is_checked_against_the_target(models, ggufspec_home):
    check_draft(models["target"], models["draft"])
    check_draft(models["target"], models["extra"])  # within 128 ids, the shared texts agree
    with pytest.raises(IncompatibleModelsError) as error:
        check_draft(models["target"], models["other"], folders=[models["draft"].parent])
    message = str(error.value)
    assert "token texts" in message and "token 270" in message and "zebra" in message
    assert "files on disk that would work: small.gguf" in message


def test_bad_drafting_input_is_one_line(models, tmp_path):
    with pytest.raises(GgufspecError, match="--draft-dir .*: no such folder"):
        check_draft_dir(tmp_path / "nope")
    for args, message in ((["--draft-dir", str(tmp_path / "nope")], "no such folder"),
                          (["--lookup-pool", "0"], "--lookup-pool must be 1 to"),
                          (["-md", str(models["other"])], "cannot draft for target.gguf: its tokenizer differs")):
        result = CliRunner().invoke(main, ["run", "-m", str(models["target"]), "-p", "x", "-c", "128", *args])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output


def test_run_with_m_alone(models):
    """run -m: the draft found in --draft-dir, said on stderr and in --json; without one, n-gram drafting."""
    args = ["run", "-m", str(models["target"]), "-p", "the cat the cat the cat", "-n", "12", "-c", "256", "-t", "1",
            "--json"]
    found = CliRunner().invoke(main, args + ["--draft-dir", str(models["draft"].parent)])
    assert found.exit_code == 0, found.output
    assert found.stderr.startswith("ggufspec: draft: draft model ")
    payload = json.loads(found.stdout)
    assert payload["draft_choice"]["kind"] == "model" and payload["draft_choice"]["path"] == str(models["draft"])
    assert payload["stats"]["drafter"] == "model+auto"
    alone = CliRunner().invoke(main, args)
    assert alone.exit_code == 0, alone.output
    payload = json.loads(alone.stdout)
    assert payload["draft_choice"]["kind"] == "ngram" and payload["stats"]["drafter"] == "lookup+auto"
    none = json.loads(CliRunner().invoke(main, args + ["--no-draft"]).stdout)
    assert none["draft_choice"] == {"kind": "none", "path": None, "why": "--no-draft"}


def test_serve_with_m_alone(models, tmp_path):
    draft_dir = ["--draft-dir", str(models["draft"].parent)]
    for name, extra, said in (("found", draft_dir, "draft model"), ("none", [], "n-gram drafting")):
        (tmp_path / name).mkdir()
        with serving(tmp_path / name, "-m", str(models["target"]), "-c", "256", *extra) as running:
            assert f"ggufspec: draft: {said}" in running.log.read_text()
            answer = running.client().completions.create(model="target", prompt="the cat the cat", max_tokens=8,
                                                         temperature=0)
            assert answer.usage.completion_tokens >= 1
