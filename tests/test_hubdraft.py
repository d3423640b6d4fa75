"""`pull hf://... --with-draft`: a draft found on a loopback hub from GGUF headers read with Range requests."""
import json
import textwrap

import pytest
from click.testing import CliRunner

from ggufspec import hubdraft, store
from ggufspec.cli import main
from ggufspec.registry import ModelEntry
from ggufspec.tinymodels import CHAT_TEMPLATE, Shape, make_pair, make_weights, write_model
from hfserver import hub_for

TARGET = "hf://org/Tiny-7B-GGUF/tiny-7b-F32.gguf"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A big target, a small draft with its vocabulary, a small one with another (bigger than the draft)."""
    folder = tmp_path_factory.mktemp("hubdraft")
    big = Shape(n_layer=4, n_embd=256, n_ff=512)
    target = write_model(folder / "big.gguf", big, make_weights(big, 0), CHAT_TEMPLATE)
    _, draft = make_pair(folder, seed=1)
    other_folder = folder / "other"
    other_folder.mkdir()
    _, other = make_pair(other_folder, seed=2, shape=Shape(extra_words=400))
    data = {name: path.read_bytes() for name, path in (("target", target), ("draft", draft), ("other", other))}
    assert len(data["draft"]) * 5 <= len(data["target"]) and len(data["other"]) * 5 <= len(data["target"])
    assert len(data["other"]) > len(data["draft"])
    return data


@pytest.fixture
def hub(monkeypatch, ggufspec_home):
    with hub_for(monkeypatch) as server:
        monkeypatch.setattr(hubdraft, "FIRST_BYTES", 4096)  # small prefixes: the reads grow past them
        yield server


def pull(*args):
    return CliRunner().invoke(main, ["pull", *args])


def pull_with_draft(hub, files, candidates: dict, *flags):
    """`pull TARGET --with-draft FLAGS` (exit code 0) from a hub holding the big target, then `candidates`
    ({(repo, file name): bytes})."""
    hub.state.add("org/Tiny-7B-GGUF", "tiny-7b-F32.gguf", files["target"])
    for (repo, name), data in candidates.items():
        hub.state.add(repo, name, data)
    result = pull(TARGET, "--with-draft", *flags)
    assert result.exit_code == 0, result.output
    return result


def on_disk(repo, file):
    return store.final_path(ModelEntry("x", repo, (file,)), file).is_file()


def test_a_family_draft_is_found_from_headers_and_pulled(hub, files):
    result = pull_with_draft(hub, files, {
        ("org/Tiny-7B-GGUF", "tiny-7b-Q8_0.gguf"): files["target"],        # not 5x smaller
        ("org/Tiny-1B-GGUF", "tiny-1b-F32.gguf"): files["other"],          # another vocabulary
        ("org/Tiny-0.5B-GGUF", "tiny-0.5b-F32.gguf"): files["draft"],      # the draft
        ("org/Other-0.5B-GGUF", "other-0.5b-F32.gguf"): files["draft"],    # another family
    }, "--json")
    out = json.loads(result.output)
    assert [r["model"] for r in out] == [TARGET, "hf://org/Tiny-0.5B-GGUF/tiny-0.5b-F32.gguf"]
    search = out[0]["draft_search"]
    assert search["chosen"] == "hf://org/Tiny-0.5B-GGUF/tiny-0.5b-F32.gguf"
    assert "tokenizer matches" in search["why"] and "smaller" in search["why"]
    assert [s["model"] for s in search["skipped"]] == ["hf://org/Tiny-1B-GGUF/tiny-1b-F32.gguf"]
    assert "tokenizer differs" in search["skipped"][0]["reason"] and "vocabulary" in search["skipped"][0]["reason"]
    assert on_disk("org/Tiny-7B-GGUF", "tiny-7b-F32.gguf") and on_disk("org/Tiny-0.5B-GGUF", "tiny-0.5b-F32.gguf")
    # the skipped candidate: its header only (a prefix, grown from 4 KiB), never the whole file
    served = hub.state.served
    assert not on_disk("org/Tiny-1B-GGUF", "tiny-1b-F32.gguf")
    assert 0 < served[("org/Tiny-1B-GGUF", "tiny-1b-F32.gguf")] < len(files["other"]) // 4
    assert ("org/Tiny-7B-GGUF", "tiny-7b-Q8_0.gguf") not in served     # too big: not even its header
    assert ("org/Other-0.5B-GGUF", "other-0.5b-F32.gguf") not in served
    header_reads = [r for m, p, r in hub.state.requests if m == "GET" and r and r.startswith("bytes=0-")]
    assert header_reads and all(int(r.split("-")[1]) < 1 << 20 for r in header_reads), header_reads


def test_a_draft_in_the_same_repository_is_said_in_words(hub, files):
    result = pull_with_draft(hub, files, {("org/Tiny-7B-GGUF", "tiny-other-F32.gguf"): files["other"],
                                          ("org/Tiny-7B-GGUF", "tiny-draft-F32.gguf"): files["draft"]}, "-q")
    assert f"draft for {TARGET}: hf://org/Tiny-7B-GGUF/tiny-draft-F32.gguf: its tokenizer matches" in result.output
    assert "skipped hf://org/Tiny-7B-GGUF/tiny-other-F32.gguf: tokenizer differs" in result.output
    assert on_disk("org/Tiny-7B-GGUF", "tiny-draft-F32.gguf") and not on_disk("org/Tiny-7B-GGUF", "tiny-other-F32.gguf")


def test_only_another_tokenizer_pulls_the_target_and_says_no_draft(hub, files):
    result = pull_with_draft(hub, files, {("org/Tiny-1B-GGUF", "tiny-1b-F32.gguf"): files["other"]}, "-q")
    assert f"no draft on the hub for {TARGET}: 1 with another tokenizer" in result.output
    assert "skipped hf://org/Tiny-1B-GGUF/tiny-1b-F32.gguf: tokenizer differs" in result.output
    assert on_disk("org/Tiny-7B-GGUF", "tiny-7b-F32.gguf")


def test_no_candidate_says_so_in_one_line(hub, files):
    result = pull_with_draft(hub, files, {}, "--json")
    search = json.loads(result.output)[0]["draft_search"]
    assert search["chosen"] is None and "no other .gguf file" in search["why"]
    text = pull(TARGET, "--with-draft", "-q")
    assert text.exit_code == 0 and text.output.count("no draft on the hub") == 1


def test_a_registry_family_repository_is_searched(hub, files, ggufspec_home):
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    (ggufspec_home / "models.toml").write_text(textwrap.dedent("""
        [models.tiny-small]
        repo = "elsewhere/Tiny-0.5B-GGUF"
        file = "tiny-0.5b-F32.gguf"
    """))
    another_owner = ("elsewhere/Tiny-0.5B-GGUF", "tiny-0.5b-F32.gguf")  # another owner: not listed
    result = pull_with_draft(hub, files, {another_owner: files["draft"]}, "--dry-run", "--json")
    out = json.loads(result.output)
    assert out[0]["draft_search"]["chosen"] == "hf://elsewhere/Tiny-0.5B-GGUF/tiny-0.5b-F32.gguf"
    assert out[1]["files"] == ["tiny-0.5b-F32.gguf"] and not on_disk("elsewhere/Tiny-0.5B-GGUF", "tiny-0.5b-F32.gguf")


def test_bad_input(hub, files, ggufspec_home):
    result = pull("org/Tiny-7B-GGUF:F32", "--with-draft")
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "--with-draft needs a hub file reference hf://" in result.output
    hub.state.add("org/Tiny-7B-GGUF", "tiny-7b-F32.gguf", files["target"])
    hub.state.add("org/Tiny-7B-GGUF", "tiny-draft-F32.gguf", files["draft"])
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    (ggufspec_home / "models.toml").write_text(textwrap.dedent("""
        [models.t]
        repo = "org/Tiny-7B-GGUF"
        file = "tiny-7b-F32.gguf"
        [models.d]
        repo = "org/Tiny-7B-GGUF"
        file = "tiny-draft-F32.gguf"
        [pairs.tiny]
        target = "t"
        draft = "d"
    """))
    result = pull("tiny", "--with-draft", "-q")
    assert result.exit_code == 0, result.output
    assert "tiny is a pair: its draft d was pulled with it" in result.output
    assert on_disk("org/Tiny-7B-GGUF", "tiny-draft-F32.gguf")


def test_a_prefix_fingerprint_is_the_file_fingerprint(files, tmp_path, ggufspec_home):
    from ggufspec.fingerprint import HeaderCutShort, fingerprint_of_bytes, read_fingerprint
    path = tmp_path / "draft.gguf"
    path.write_bytes(files["draft"])
    assert fingerprint_of_bytes(files["draft"][:64 << 10], "draft") == read_fingerprint(path)
    with pytest.raises(HeaderCutShort):
        fingerprint_of_bytes(files["draft"][:1000], "draft")


def test_a_candidate_that_is_not_gguf_is_skipped_with_the_reason(hub, files):
    result = pull_with_draft(hub, files, {("org/Tiny-7B-GGUF", "broken-F32.gguf"): b"GGUF" + b"\xff" * 50_000},
                             "--dry-run", "-q")
    assert "skipped hf://org/Tiny-7B-GGUF/broken-F32.gguf: header not read" in result.output
    assert "no draft on the hub" in result.output


def test_a_draft_whose_vocabulary_is_a_few_ids_longer_is_found_when_the_ids_both_have_agree(hub, files, tmp_path):
    """llama.cpp pairs vocabularies up to 128 ids apart (Qwen2.5's 0.5B has 151,936 ids, its 32B
    152,064) when the texts of the ids both have agree. The hub search compared those texts only with
    the two files on disk, so every such draft was "tokenizer differs": it reads them from the headers."""
    from ggufspec.tinymodels import vocabulary
    padded = Shape(n_layer=1, extra_words=16)
    weights = make_weights(padded, 3)
    tokens = vocabulary(16)[0]
    tokens[270] = "\u2581zebra"
    good = write_model(tmp_path / "good.gguf", padded, weights).read_bytes()
    bad = write_model(tmp_path / "bad.gguf", padded, weights, tokens=tokens).read_bytes()
    assert len(good) * 5 <= len(files["target"])
    result = pull_with_draft(hub, files, {("org/Tiny-0.5B-GGUF", "tiny-0.5b-F32.gguf"): good}, "--json")
    assert json.loads(result.output)[0]["draft_search"]["chosen"] == "hf://org/Tiny-0.5B-GGUF/tiny-0.5b-F32.gguf"
    hub.state.add("org/Tiny-0.5B-GGUF", "tiny-0.5b-F32.gguf", bad)  # one shared id's text differs
    search = hubdraft.find_draft(ModelEntry(TARGET, "org/Tiny-7B-GGUF", ("tiny-7b-F32.gguf",)))
    assert search.draft is None and "token texts (of the" in search.skipped[0]["reason"]
