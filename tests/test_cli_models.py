"""list, rm and plan about what the store holds: a draft two pairs share, files pulled by hub reference,
partial downloads, and plan -m/-md with hub references (headers read by range request, nothing pulled)."""
import json
import os
import textwrap

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.errors import StoreError
from ggufspec.registry import load_registry
from hfserver import hub_for

SHARED = """
    [models.t1]
    repo = "org/t1-GGUF"
    file = "t1.gguf"
    [models.t2]
    repo = "org/t2-GGUF"
    file = "t2.gguf"
    [models.t3]
    repo = "org/t3-GGUF"
    file = "t3.gguf"
    [models.d]
    repo = "org/d-GGUF"
    file = "d.gguf"
    [pairs.p1]
    target = "t1"
    draft = "d"
    [pairs.p2]
    target = "t2"
    draft = "d"
    [pairs.p3]
    target = "t3"
    draft = "d"
"""


@pytest.fixture
def hub(monkeypatch):
    with hub_for(monkeypatch) as server:
        yield server


def shared_draft_home(home, *models):
    """The registry above, with `models` on disk (their bytes do not matter to rm)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "models.toml").write_text(textwrap.dedent(SHARED))
    registry = load_registry()
    for name in models:
        entry = registry.model(name)
        path = store.final_path(entry, entry.first_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF" + name.encode() * 1000)
    return registry


def on_disk(registry, name):
    return store.is_complete(registry.model(name))


def test_rm_a_pair_never_pulled_keeps_the_draft_another_pair_uses(ggufspec_home):
    registry = shared_draft_home(ggufspec_home, "t1", "d")  # only p1 on disk, as the demo pair alone
    result = CliRunner().invoke(main, ["rm", "p3"])
    assert result.exit_code == 2, result.output
    assert "kept d: also the draft of p1 (rm p1 too, or rm d by name)" in result.stderr
    assert "nothing of it is on disk but what other pairs use" in result.stderr and "removed" not in result.stdout
    assert on_disk(registry, "d") and on_disk(registry, "t1")


def test_rm_a_pair_removes_its_own_target_and_keeps_the_shared_draft(ggufspec_home):
    registry = shared_draft_home(ggufspec_home, "t1", "t2", "d")
    result = CliRunner().invoke(main, ["rm", "p2"])
    assert result.exit_code == 0, result.output
    assert "t2: removed" in result.stdout and "d: removed" not in result.stdout
    assert "kept d: also the draft of p1" in result.stderr
    assert not on_disk(registry, "t2") and on_disk(registry, "d") and on_disk(registry, "t1")
    last = CliRunner().invoke(main, ["rm", "p1"])  # no other pair on disk uses d now: it goes with p1
    assert last.exit_code == 0, last.output
    assert "t1: removed" in last.stdout and "d: removed" in last.stdout and "kept" not in last.stderr


@pytest.mark.parametrize("name, removed", [("d", "d: removed"), ("hf://org/d-GGUF/d.gguf", "removed")],
                         ids=["by-name", "by-hub-reference"])
def test_rm_the_shared_model_removes_it_and_says_which_pair_it_breaks(ggufspec_home, name, removed):
    """By its registry name, or its file's hub reference."""
    registry = shared_draft_home(ggufspec_home, "t1", "d")
    result = CliRunner().invoke(main, ["rm", name])
    assert result.exit_code == 0, result.output
    assert removed in result.stdout and "p1 has no draft on disk now" in result.stderr
    assert not on_disk(registry, "d")


def test_list_shows_models_pulled_by_hub_reference_and_partial_downloads(hub, ggufspec_home, tiny_pair, tmp_path):
    data = tiny_pair[0].read_bytes()
    hub.state.add("org/tiny-GGUF", "tiny-F32.gguf", data)
    hub.state.add("org/cut-GGUF", "cut-Q4_K_M.gguf", b"GGUF" + os.urandom(3_000_000))
    hub.state.cut_at["cut-Q4_K_M.gguf"] = 1_500_000
    runner = CliRunner()
    assert runner.invoke(main, ["pull", "-q", "org/tiny-GGUF:F32"]).exit_code == 0
    with pytest.raises(StoreError):
        store.pull(store.entry_from_reference("hf://org/cut-GGUF/cut-Q4_K_M.gguf"), progress=False)
    by_hand = store.models_dir() / "mine.gguf"
    by_hand.write_bytes(data)

    listing = json.loads(runner.invoke(main, ["list", "--json"]).stdout)
    pulled = listing["other_models"]["hf://org/tiny-GGUF/tiny-F32.gguf"]
    assert pulled["size"] == len(data) and len(pulled["files"]) == 1
    assert listing["other_models"][str(by_hand)]["size"] == len(data)
    partial = listing["partial_downloads"]
    assert 0 < partial["bytes"] <= 1_500_000
    assert [p["name"] for p in partial["files"]] == ["hf://org/cut-GGUF/cut-Q4_K_M.gguf"]
    text = runner.invoke(main, ["list"]).stdout
    assert "hf://org/tiny-GGUF/tiny-F32.gguf" in text and "PARTIAL DOWNLOADS" in text

    for shown in ("hf://org/tiny-GGUF/tiny-F32.gguf", "hf://org/cut-GGUF/cut-Q4_K_M.gguf", str(by_hand)):
        removed = runner.invoke(main, ["rm", shown])  # rm takes what list shows
        assert removed.exit_code == 0 and "removed" in removed.stdout, (shown, removed.output)
    listing = json.loads(runner.invoke(main, ["list", "--json"]).stdout)
    assert listing["other_models"] == {} and listing["partial_downloads"] == {"bytes": 0, "files": []}
    assert not list(store.models_dir().rglob("*.gguf"))


def test_plan_reads_hub_references_by_range_request(hub, tiny_pair):
    hub.state.add("org/tiny-GGUF", "tiny-F32.gguf", tiny_pair[0].read_bytes())
    hub.state.add("org/tinydraft-GGUF", "tinydraft-Q8_0.gguf", tiny_pair[1].read_bytes())
    result = CliRunner().invoke(main, ["plan", "-m", "hf://org/tiny-GGUF/tiny-F32.gguf", "-md",
                                       "org/tinydraft-GGUF:Q8_0", "--vram", "0", "--ram", "8GiB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ngl"] == 0
    gets = [r for r in hub.state.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert gets and all(r[2] and r[2].startswith("bytes=0-") for r in gets)  # headers only
    assert not store.models_dir().exists() or not list(store.models_dir().rglob("*.gguf"))  # nothing pulled


def test_plan_a_hub_reference_on_disk_reads_the_local_file(hub, tiny_pair):
    hub.state.add("org/tiny-GGUF", "tiny-F32.gguf", tiny_pair[0].read_bytes())
    assert CliRunner().invoke(main, ["pull", "-q", "hf://org/tiny-GGUF/tiny-F32.gguf"]).exit_code == 0
    before = len(hub.state.requests)
    result = CliRunner().invoke(main, ["plan", "-m", "hf://org/tiny-GGUF/tiny-F32.gguf", "-md", str(tiny_pair[1]),
                                       "--vram", "0", "--ram", "8GiB", "--json"])
    assert result.exit_code == 0, result.output
    assert len(hub.state.requests) == before  # the hub is not asked


@pytest.mark.parametrize("args, words", [
    (["-md", "draft.gguf"], "-md needs -m"),
    (["qwen2.5-coder-1.5b", "-m", "target.gguf"], "not both"),
])
def test_plan_refuses_the_model_flags_run_refuses(args, words):
    result = CliRunner().invoke(main, ["plan", *args, "--vram", "0", "--ram", "8GiB"])
    assert result.exit_code == 2, result.output
    assert words in result.stderr and result.stderr.strip().count("\n") == 0


def test_plan_reads_every_shard_of_a_split_hub_model(hub, tmp_path):
    """A split GGUF on the hub, planned before it is pulled: every shard's header is read (by range
    request), not the first one's alone, which holds a third of the tensors here."""
    from test_plan import _write_llama
    _write_llama(tmp_path / "whole.gguf")
    _write_llama(tmp_path / "split.gguf", split_max_tensors=2)
    for shard in sorted(tmp_path.glob("split-*.gguf")):
        hub.state.add("org/split-GGUF", shard.name, shard.read_bytes())
    hub.state.add("org/whole-GGUF", "whole.gguf", (tmp_path / "whole.gguf").read_bytes())
    plans = [CliRunner().invoke(main, ["plan", "-m", ref, "--vram", "0", "--ram", "8GiB", "--json"])
             for ref in ("hf://org/split-GGUF/split-00001-of-00003.gguf", "hf://org/whole-GGUF/whole.gguf")]
    assert all(p.exit_code == 0 for p in plans), [p.output for p in plans]
    split, whole = (json.loads(p.stdout) for p in plans)
    assert split["plan"]["target"]["cpu_bytes"] == whole["plan"]["target"]["cpu_bytes"]
    gets = [r for r in hub.state.requests if r[0] == "GET" and "split-0000" in r[1]]
    assert len({r[1] for r in gets}) == 3 and all(r[2].startswith("bytes=0-") for r in gets)
