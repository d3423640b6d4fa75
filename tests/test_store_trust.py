"""What a pull trusts: the user's token stays with the hub, two pulls of one file share it, bytes with
nothing to check them by must at least be a GGUF file, and a damaged models.toml or verified.json is
one line. Against the Hugging Face-compatible server on 127.0.0.1 (tests/hfserver.py)."""
import errno
import hashlib
import os
import threading
import textwrap

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.errors import StoreError
from ggufspec.huberrors import hub_errors
from ggufspec.registry import ModelEntry
from hfserver import HubServer, hub_for

REPO = "org/model-GGUF"
DATA = b"GGUF" + os.urandom(1_000_000)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def hub(monkeypatch, ggufspec_home):
    with hub_for(monkeypatch) as server:
        server.state.add(REPO, "model-Q4_K_M.gguf", DATA)
        yield server


def entry(file="model-Q4_K_M.gguf", name="m"):
    return ModelEntry(name, REPO, (file,))


def one_line_error(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and lines and lines[-1].startswith("ggufspec: error: "), result.output
    assert "Traceback" not in result.output
    return lines[-1]


def test_the_token_goes_to_the_hub_never_to_the_host_it_redirects_to(hub, monkeypatch):
    """As hf_hub_download: a CDN's signed URL needs no token, and the token is the user's."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_the_user")
    with HubServer() as cdn:
        cdn.state.add(REPO, "model-Q4_K_M.gguf", DATA)
        hub.state.redirect["model-Q4_K_M.gguf"] = f"{cdn.url}/{REPO}/resolve/main/model-Q4_K_M.gguf"
        assert store.pull(entry(), progress=False)[0].read_bytes() == DATA
        assert [r for r in cdn.state.requests if r[0] == "GET"]  # the bytes came from the other host
        assert cdn.state.authorizations and not any(cdn.state.authorizations)
    assert "Bearer hf_secret_of_the_user" in hub.state.authorizations


def at_once(work, n: int) -> tuple[list, list]:
    """`work()` in n threads started together: (their results, the exceptions raised)."""
    results, errors = [], []

    def one():
        try:
            results.append(work())
        except Exception as exc:  # noqa: BLE001  (the test reports it)
            errors.append(exc)
    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results, errors


def test_two_pulls_of_one_file_at_once_download_it_once_and_both_get_it(hub, capsys):
    """Both used to append to one partial file: the first was told the hub sent too much, or the file
    installed was longer than the one verified. The second now waits, then finds the file in place."""
    hub.state.seconds_per_chunk = 0.01
    results, errors = at_once(lambda: store.pull(entry(), progress=True)[0], 2)  # progress: the waiting line too
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == DATA
    assert hub.state.served[(REPO, "model-Q4_K_M.gguf")] == len(DATA)  # once
    assert "waiting for another pull" in capsys.readouterr().err


@pytest.mark.parametrize("data, says", [(b"<html>login</html>", "sent no GGUF file"),
                                        (b"", "a size of 0 bytes")])
def test_bytes_with_no_sha256_to_check_must_at_least_be_a_gguf_file(hub, data, says):
    hub.state.add(REPO, "page-Q4_K_M.gguf", data)
    hub.state.unhashed.add("page-Q4_K_M.gguf")
    with pytest.raises(StoreError, match=says):
        store.pull(entry("page-Q4_K_M.gguf"), progress=False)
    assert not store.final_path(entry("page-Q4_K_M.gguf"), "page-Q4_K_M.gguf").exists()
    hub.state.unhashed.add("model-Q4_K_M.gguf")  # a real GGUF from a plain web server still comes
    assert store.pull(entry(), progress=False)[0].read_bytes() == DATA


def test_a_file_that_is_not_gguf_is_refused_at_pull_even_with_the_right_sha256(hub):
    """The hub's sha256 vouched for it, so it was installed, and only `run` said (in the loader's words)
    that it is no model (audit)."""
    hub.state.add(REPO, "notes-Q4_K_M.gguf", b"hello world, not a gguf" * 100)
    with pytest.raises(StoreError, match=r"sent no GGUF file \(it begins b'hello.*sha256 is the one announced.*"
                                         r"not a model; the download was deleted"):
        store.pull(entry("notes-Q4_K_M.gguf"), progress=False)
    assert not store.final_path(entry("notes-Q4_K_M.gguf"), "notes-Q4_K_M.gguf").exists()


def test_a_login_wall_without_the_hubs_error_code_says_to_set_the_token(hub):
    hub.state.bare_401 = True
    with pytest.raises(StoreError, match="401.*set HF_TOKEN"):
        store.pull(entry(), progress=False)


def test_a_full_disk_says_so_and_that_the_pull_resumes():
    with pytest.raises(StoreError, match="the disk is full.*run pull again to resume"):
        with hub_errors("org/x/y.gguf", transfer=True):
            raise OSError(errno.ENOSPC, "No space left on device")


def write_registry(home, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "models.toml").write_text(textwrap.dedent(text))


def test_rm_keeps_a_file_that_another_pair_names_by_another_model(hub, ggufspec_home):
    """Two model names for one file: removing one pair must not take the other's draft."""
    hub.state.add(REPO, "model-Q8_0.gguf", b"GGUF" + DATA[:3:-1])
    hub.state.add(REPO, "small-Q2_K.gguf", b"GGUF" + DATA[::2])
    write_registry(ggufspec_home, f"""
        [models.t1]
        repo = "{REPO}"
        file = "model-Q4_K_M.gguf"
        [models.t2]
        repo = "{REPO}"
        file = "model-Q8_0.gguf"
        [models.d]
        repo = "{REPO}"
        file = "small-Q2_K.gguf"
        [models.d-alias]
        repo = "{REPO}"
        file = "small-Q2_K.gguf"
        [pairs.p1]
        target = "t1"
        draft = "d"
        [pairs.p2]
        target = "t2"
        draft = "d-alias"
        """)
    runner = CliRunner()
    for pair in ("p1", "p2"):
        assert runner.invoke(main, ["pull", "-q", pair]).exit_code == 0
    removed = runner.invoke(main, ["rm", "p1"])
    assert removed.exit_code == 0, removed.output
    assert "p2" in removed.output  # said why d stays
    assert store.final_path(entry("small-Q2_K.gguf"), "small-Q2_K.gguf").is_file()
    assert not store.final_path(entry("model-Q4_K_M.gguf"), "model-Q4_K_M.gguf").exists()
    notes = runner.invoke(main, ["rm", "d"]).output.splitlines()
    assert sum("p2 has no draft" in line for line in notes) == 1, notes  # once, though two names share the file


@pytest.mark.parametrize("text, says", [
    ('[models.m]\nrepo = "o/r"\nfiles = []\n', "models.m.files: expected a non-empty list"),
    ("models = 3\n", "models must be tables"),
    ("pairs = 3\n", "pairs must be tables"),
    ("default = 3\n", "default must be a pair's name"),
    ('[models.m]\nrepo = "o/r"\nfile = "a.gguf"\nsize = -5\n', "models.m.size: expected a number of bytes"),
    ('[models.m]\nrepo = "o/r"\nfile = "a.gguf"\nsha256 = {"b.gguf" = "' + "0" * 64 + '"}\n',
     "'b.gguf' is not one of the model's files"),
    ('[models.m]\nrepo = "o/r"\nfile = "a.gguf"\n[pairs.p]\ntarget = "m"\ndraft = "m"\ndraft_k = -3\n',
     "pairs.p.draft_k: expected 0 or more"),
    ('[models.m]\nrepo = "o__x/r"\nfile = "a.gguf"\n', "an owner name with '__'"),
    ('[models.m]\nrepo = "o_/r"\nfile = "a.gguf"\n', "ending in '_'"),  # o_/r and o/_r: one folder, o___r
    ('[models.m]\nrepo = "o/r"\nfile = "' + "a" * 300 + '.gguf"\n', "over 227 bytes"),
])
def test_a_damaged_models_toml_is_one_line_naming_the_file(ggufspec_home, text, says):
    write_registry(ggufspec_home, text)
    for command in (["list"], ["pull", "x"]):
        line = one_line_error(CliRunner().invoke(main, command))
        assert says in line and "models.toml" in line, line


def test_pull_of_an_empty_name_is_refused_not_the_default_pair(ggufspec_home):
    assert "an empty name" in one_line_error(CliRunner().invoke(main, ["pull", ""]))


@pytest.mark.parametrize("note", [{}, {"size": "big", "sha256": SHA}, {"size": None}, [1, 2]])
def test_a_damaged_verified_json_loses_a_note_not_the_list(hub, ggufspec_home, note):
    write_registry(ggufspec_home, f'[models.m]\nrepo = "{REPO}"\nfile = "model-Q4_K_M.gguf"\n')
    assert CliRunner().invoke(main, ["pull", "-q", "m"]).exit_code == 0
    key = f"{REPO}/model-Q4_K_M.gguf"
    store.verified_path().write_text(__import__("json").dumps({key: note}))
    result = CliRunner().invoke(main, ["list"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


def test_a_pull_of_another_revision_with_the_same_bytes_completes(hub):
    """Waiting for the lock, a pull skips a file already in place: only if it is this revision's,
    or `run` kept saying the model is not on disk, however often it was pulled."""
    store.pull(entry(), progress=False)
    other = ModelEntry("m", REPO, ("model-Q4_K_M.gguf",), revision="0123456789abcdef0123456789abcdef01234567")
    store.pull(other, progress=False)
    assert store.is_complete(other) and not store.stale_files(other)


def test_two_assemblies_from_pypi_parts_at_once_make_one_right_file(ggufspec_home, tmp_path, monkeypatch):
    chunks = []
    for i, part in enumerate((DATA[:400_000], DATA[400_000:])):
        chunks.append(tmp_path / f"part{i}.bin")
        chunks[-1].write_bytes(part)
    monkeypatch.setattr(store, "part_files", lambda e: chunks)
    parted = ModelEntry("p", REPO, ("model-Q4_K_M.gguf",), sha256={"model-Q4_K_M.gguf": SHA},
                        pypi_parts={"prefix": "x-part", "count": 2, "version": "1"})
    _, errors = at_once(lambda: store.assemble_from_parts(parted, progress=False), 3)
    assert not errors and store.final_path(parted, "model-Q4_K_M.gguf").read_bytes() == DATA


def test_plan_reads_a_remote_header_without_sending_the_token_to_the_cdn(hub, monkeypatch, tiny_pair):
    from ggufspec.plan.gguf_header import _read_remote_shape
    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_the_user")
    data = tiny_pair[0].read_bytes()
    with HubServer() as cdn:
        cdn.state.add(REPO, "tiny.gguf", data)
        shape = _read_remote_shape(f"{cdn.url}/{REPO}/resolve/main/tiny.gguf", len(data), "tiny.gguf", 1 << 16)
        assert shape is not None and cdn.state.authorizations and not any(cdn.state.authorizations)
