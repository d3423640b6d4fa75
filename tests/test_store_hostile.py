"""The store against a broken or hostile hub (HF_ENDPOINT may name any mirror): names that climb out of
the store, sizes that lie, absurd listings, malformed references. Nothing may be written outside
$GGUFSPEC_HOME, each refusal is one line naming what was refused, and an honest pull still works after."""
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.errors import BadReferenceError, StoreError, UnsafeNameError
from ggufspec.hubnames import contained, unsafe_file_reason
from ggufspec.registry import ModelEntry, RegistryError, load_registry
from hfserver import HubServer, hub_for

DATA = b"GGUF" + os.urandom(200_000)
REPO = "owner/repo"


@pytest.fixture
def hub(monkeypatch):
    with hub_for(monkeypatch) as server:
        yield server


def pull_cli(ref):
    return CliRunner().invoke(main, ["pull", "-q", ref])


def one_line_error(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ggufspec: error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def test_a_listing_that_climbs_out_is_refused_and_an_honest_pull_works_after(hub, ggufspec_home, tmp_path):
    # from models/owner__repo/ this name climbs to tmp_path: the file must not appear there
    climb = os.path.relpath(tmp_path / "planted-q4_k_m.gguf", ggufspec_home / "models" / "owner__repo")
    assert climb.startswith("..")
    hub.state.add(REPO, climb, DATA)
    before = files_under(tmp_path) - files_under(ggufspec_home)
    result = pull_cli(f"{REPO}:q4_k_m")
    assert result.exit_code == 1
    line = one_line_error(result)
    assert climb in line and hub.url in line and "'..' segment" in line
    assert not (tmp_path / "planted-q4_k_m.gguf").exists()
    assert files_under(tmp_path) - files_under(ggufspec_home) == before  # nothing written outside the home
    assert not [r for r in hub.state.requests if "/resolve/" in r[1]]  # refused before any download

    del hub.state.repos[REPO][climb]
    hub.state.add(REPO, "model-Q4_K_M.gguf", DATA)
    result = pull_cli(f"{REPO}:q4_k_m")
    assert result.exit_code == 0, result.output
    assert (ggufspec_home / "models" / "owner__repo" / "model-Q4_K_M.gguf").read_bytes() == DATA


@pytest.mark.parametrize("name", ["/tmp/abs-q4_k_m.gguf", "sub\\..\\..\\x-q4_k_m.gguf", "C:x-q4_k_m.gguf",
                                  "a//b-q4_k_m.gguf", "./x-q4_k_m.gguf", "a/../../x-q4_k_m.gguf"])
def test_every_unsafe_shape_of_name_in_a_listing_is_refused(hub, ggufspec_home, name):
    hub.state.add(REPO, name, DATA)
    with pytest.raises(UnsafeNameError) as exc:
        store.entry_from_reference(f"{REPO}:q4_k_m")
    assert repr(name) in str(exc.value) and hub.url in str(exc.value)
    assert not files_under(ggufspec_home / "models") and not files_under(ggufspec_home / "downloads")


def test_subfolders_the_hub_really_uses_still_work(hub, ggufspec_home):
    hub.state.add(REPO, "Q4_K_M/model-Q4_K_M.gguf", DATA)
    result = pull_cli(f"{REPO}:q4_k_m")
    assert result.exit_code == 0, result.output
    assert (ggufspec_home / "models" / "owner__repo" / "Q4_K_M" / "model-Q4_K_M.gguf").read_bytes() == DATA


def test_a_path_is_refused_even_when_an_entry_is_built_by_hand(hub, ggufspec_home):
    """Defence in depth: the store checks the joined path, whatever made the entry."""
    entry = ModelEntry("m", REPO, ("../../escape.gguf",))
    with pytest.raises(UnsafeNameError, match="'..' segment"):
        store.pull(entry, progress=False)
    with pytest.raises(UnsafeNameError):
        store.final_path(ModelEntry("m", "../..", ("x.gguf",)), "x.gguf")
    assert not hub.state.requests and not files_under(ggufspec_home)


@pytest.mark.parametrize("ref, says", [
    ("hf://../../x/y.gguf", "repository id"),
    ("hf://a/b/", "hf://OWNER/REPO/FILE.gguf"),
    ("hf://owner/repo/../../../x.gguf", "'..' segment"),
    ("hf://owner/repo/a//x.gguf", "empty path segment"),
    ("hf://owner/repo//x.gguf", "absolute path"),
    ("hf://owner/repo/\\x.gguf", "backslash"),
    ("a/b:", "OWNER/REPO:QUANT"),
    ("bad..name/repo:Q4_K_M", "repository id"),
])
def test_malformed_references_are_one_line_and_exit_2(hub, ggufspec_home, ref, says):
    for args in (["pull", ref], ["run", "-m", ref, "--no-draft", "-p", "x"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert says in one_line_error(result)
    assert not hub.state.requests and not files_under(ggufspec_home)
    with pytest.raises(BadReferenceError):
        store.entry_from_reference(ref)


def test_a_size_that_lies_deletes_the_download_and_an_honest_pull_works_after(hub, ggufspec_home):
    hub.state.add(REPO, "model-Q4_K_M.gguf", DATA)
    hub.state.announced_size["model-Q4_K_M.gguf"] = len(DATA) - 1000
    result = pull_cli(f"hf://{REPO}/model-Q4_K_M.gguf")
    assert result.exit_code == 1
    line = one_line_error(result)
    assert f"announced {len(DATA) - 1000} bytes but sent {len(DATA)}" in line and hub.url in line
    assert not files_under(ggufspec_home / "models") and not files_under(ggufspec_home / "downloads")
    del hub.state.announced_size["model-Q4_K_M.gguf"]
    assert pull_cli(f"hf://{REPO}/model-Q4_K_M.gguf").exit_code == 0


@pytest.mark.parametrize("size", [-5, 1 << 60])
def test_an_absurd_size_writes_nothing(hub, ggufspec_home, size):
    hub.state.add(REPO, "model-Q4_K_M.gguf", DATA)
    hub.state.announced_size["model-Q4_K_M.gguf"] = size
    result = pull_cli(f"hf://{REPO}/model-Q4_K_M.gguf")
    assert result.exit_code == 1
    assert f"size of {size} bytes" in one_line_error(result)
    assert not files_under(ggufspec_home / "models") and not files_under(ggufspec_home / "downloads")
    assert not [r for r in hub.state.requests if r[0] == "GET"]


def test_a_listing_of_100000_files_is_refused(hub, ggufspec_home):
    hub.state.add(REPO, "model-Q4_K_M.gguf", DATA)
    hub.state.listing_padding = 100_000
    result = pull_cli(f"{REPO}:q4_k_m")
    assert result.exit_code == 1
    assert "lists 100001 files" in one_line_error(result)
    assert not files_under(ggufspec_home)


def test_a_redirect_to_another_host_still_lands_in_the_store(hub, ggufspec_home, tmp_path):
    with HubServer() as cdn:
        cdn.state.add(REPO, "model-Q4_K_M.gguf", DATA)
        hub.state.add(REPO, "model-Q4_K_M.gguf", DATA)
        hub.state.redirect["model-Q4_K_M.gguf"] = f"{cdn.url}/{REPO}/resolve/main/model-Q4_K_M.gguf"
        result = pull_cli(f"hf://{REPO}/model-Q4_K_M.gguf")
        assert result.exit_code == 0, result.output
        assert [r for r in cdn.state.requests if r[0] == "GET"]  # the bytes came from the other host
    assert {p.relative_to(ggufspec_home).as_posix() for p in files_under(ggufspec_home)} >= {
        "models/owner__repo/model-Q4_K_M.gguf"}
    assert all(p.is_relative_to(ggufspec_home) for p in files_under(ggufspec_home))


@pytest.mark.parametrize("key, value, says", [
    ("file", '"../../escape.gguf"', "'..' segment"),
    ("file", '"/etc/x.gguf"', "absolute path"),
    ("repo", '"../../x"', "not a repository id"),
])
def test_models_toml_names_are_checked_with_their_line(ggufspec_home, key, value, says):
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    fields = {"repo": '"owner/repo"', "file": '"x.gguf"', key: value}
    (ggufspec_home / "models.toml").write_text(
        "[models.bad]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()), encoding="utf-8")
    with pytest.raises(RegistryError) as exc:
        load_registry()
    line = {"repo": 2, "file": 3}[key]
    assert f"models.toml:{line}: models.bad.{key}: " in str(exc.value) and says in str(exc.value)


def test_name_rules():
    assert unsafe_file_reason("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf") is None
    assert unsafe_file_reason("model.Q4_K_M.gguf") is None
    for bad in ("", "..", "a/..", "/x", "\\x", "C:/x", "a//b", "a/", "a\x00b"):
        assert unsafe_file_reason(bad), bad
    assert contained(Path("/store"), "a", "b.gguf") == Path("/store/a/b.gguf")
    assert contained(Path("/store"), "a", "../../b.gguf") is None
    assert contained(Path("/store"), "..", "store2", "b") is None


def test_store_errors_are_store_errors():
    assert issubclass(UnsafeNameError, StoreError)
