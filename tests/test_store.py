"""The model store against a Hugging Face-compatible server on 127.0.0.1 (HF_ENDPOINT)."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.errors import StoreError
from ggufspec.registry import ModelEntry, load_registry
from hfserver import hub_for

DATA = b"GGUF" + os.urandom(3_000_000)
REVERSED = b"GGUF" + DATA[:3:-1]  # another GGUF file of the same size
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def hub(monkeypatch):
    with hub_for(monkeypatch) as server:
        server.state.add("org/model-GGUF", "model-Q4_K_M.gguf", DATA)
        server.state.add("org/model-GGUF", "model-Q8_0.gguf", REVERSED)
        yield server


def write_registry(home, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "models.toml").write_text(textwrap.dedent(text))


def entry(file="model-Q4_K_M.gguf", sha=None, repo="org/model-GGUF", files=None):
    return ModelEntry("m", repo, tuple(files or [file]), sha256={file: sha} if sha else {})


def test_pull_verifies_against_the_lfs_sha256(hub):
    path = store.pull(entry(), progress=False)[0]
    assert path.read_bytes() == DATA
    assert store.is_complete(entry())


def test_registry_sha256_wins_and_mismatch_deletes(hub):
    with pytest.raises(StoreError) as exc:
        store.pull(entry(sha="0" * 64), progress=False)
    assert "sha256 mismatch" in str(exc.value) and "0" * 64 in str(exc.value) and SHA in str(exc.value)
    assert not store.final_path(entry(), "model-Q4_K_M.gguf").exists()
    assert not store.is_complete(entry())


def test_corrupted_transfer_is_rejected_and_removed(hub):
    hub.state.served_sha[("org/model-GGUF", "model-Q4_K_M.gguf")] = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(StoreError, match="sha256 mismatch"):
        store.pull(entry(), progress=False)
    assert not store.is_complete(entry())
    assert not list(store.downloads_dir().rglob("model-Q4_K_M.gguf*"))


def test_cut_connection_leaves_nothing_complete_and_next_pull_resumes(hub):
    hub.state.cut_at["model-Q4_K_M.gguf"] = 2_500_000
    with pytest.raises(StoreError, match="run pull again"):
        store.pull(entry(), progress=False)
    assert not store.is_complete(entry())
    assert not store.final_path(entry(), "model-Q4_K_M.gguf").exists()
    del hub.state.cut_at["model-Q4_K_M.gguf"]
    path = store.pull(entry(), progress=False)[0]
    assert path.read_bytes() == DATA
    ranges = [r for method, p, r in hub.state.requests if method == "GET" and r]
    resumed_at = [int(r[len("bytes="):].rstrip("-")) for r in ranges]
    assert resumed_at and 0 < max(resumed_at) <= 2_500_000, ranges  # resumed, not started again


def test_a_partial_of_an_older_upload_is_not_resumed_against_a_new_one(hub):
    """The repo re-uploads a file between two cut pulls: the old prefix is dropped, the new one resumed."""
    hub.state.cut_at["model-Q4_K_M.gguf"] = 2_500_000
    with pytest.raises(StoreError, match="run pull again"):
        store.pull(entry(), progress=False)
    new = b"GGUF" + os.urandom(3_000_000)
    hub.state.add("org/model-GGUF", "model-Q4_K_M.gguf", new)
    hub.state.cut_at["model-Q4_K_M.gguf"] = 2_200_000
    with pytest.raises(StoreError, match="run pull again"):
        store.pull(entry(), progress=False)
    partials = [p for p in store.downloads_dir().rglob("*") if p.is_file()]
    assert len(partials) == 1, partials  # the old upload's partial is gone
    kept = partials[0].read_bytes()
    assert kept and kept == new[:len(kept)] and hashlib.sha256(new).hexdigest()[:16] in partials[0].name
    del hub.state.cut_at["model-Q4_K_M.gguf"]
    hub.state.requests.clear()
    assert store.pull(entry(), progress=False)[0].read_bytes() == new
    assert ("GET", "/org/model-GGUF/resolve/main/model-Q4_K_M.gguf", f"bytes={len(kept)}-") in hub.state.requests
    assert not [p for p in store.downloads_dir().rglob("*") if p.is_file()]


def test_a_cached_file_cut_short_on_disk_is_pulled_again(hub, ggufspec_home):
    path = store.pull(entry(), progress=False)[0]
    with path.open("r+b") as f:
        f.truncate(1000)
    assert not store.is_complete(entry())
    assert store.damaged_files(entry()) == {"model-Q4_K_M.gguf": (1000, len(DATA))}
    result = CliRunner().invoke(main, ["pull", "-q", "hf://org/model-GGUF/model-Q4_K_M.gguf"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if "downloading it again" in line]
    assert len(said) == 1 and "1000 bytes on disk" in said[0] and str(len(DATA)) in said[0], result.stderr
    assert path.read_bytes() == DATA and store.is_complete(entry())


def test_killed_pull_leaves_nothing_complete(hub, ggufspec_home):
    """A pull killed mid-transfer (SIGKILL) leaves no file that run/list take for complete."""
    hub.state.cut_at["model-Q4_K_M.gguf"] = 1_500_000  # the transfer stalls there: kill it meanwhile
    script = textwrap.dedent("""
        from ggufspec import store
        from ggufspec.registry import ModelEntry
        store.pull(ModelEntry("m", "org/model-GGUF", ("model-Q4_K_M.gguf",)), progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ})
    try:
        proc.wait(timeout=1.5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert not store.is_complete(entry())
    del hub.state.cut_at["model-Q4_K_M.gguf"]
    assert store.pull(entry(), progress=False)[0].read_bytes() == DATA


def test_split_gguf_arrives_whole(hub):
    shards = [f"big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, name in enumerate(shards):
        hub.state.add("org/big-GGUF", name, b"GGUF" + DATA[i::3])
    ref = store.entry_from_reference("org/big-GGUF:Q4_K_M")
    assert ref.files == tuple(shards)
    paths = store.pull(ref, progress=False)
    assert [p.read_bytes() for p in paths] == [b"GGUF" + DATA[i::3] for i in range(3)]
    assert store.entry_from_reference("hf://org/big-GGUF/" + shards[1]).files == tuple(shards)


def test_missing_repo_file_and_gated_repo_messages(hub):
    with pytest.raises(StoreError, match="repository not found"):
        store.pull(entry(repo="org/nothing"), progress=False)
    with pytest.raises(StoreError, match="file not found"):
        store.pull(entry(file="absent.gguf"), progress=False)
    hub.state.gated.add("org/model-GGUF")
    with pytest.raises(StoreError, match="gated.*HF_TOKEN"):
        store.pull(entry(), progress=False)


def test_refuses_early_when_the_disk_is_too_small(hub, monkeypatch):
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(StoreError, match="not enough disk space.*need 2.9 MiB, 1000 B free"):
        store.pull(entry(), progress=False)
    assert not [r for r in hub.state.requests if r[0] == "GET"]


def test_cli_pull_dry_run_json_list_and_rm(hub, ggufspec_home):
    write_registry(ggufspec_home, """
        [models.mine]
        repo = "org/model-GGUF"
        file = "model-Q8_0.gguf"
        [pairs.minepair]
        target = "mine"
        draft = "mine"
    """)
    runner = CliRunner()
    dry = runner.invoke(main, ["pull", "mine", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)[0]["bytes"] == len(DATA)
    assert not [r for r in hub.state.requests if r[0] == "GET"]
    done = runner.invoke(main, ["pull", "mine", "--json"])
    assert done.exit_code == 0, done.output
    listing = json.loads(runner.invoke(main, ["list", "--json"]).output)
    assert listing["models"]["mine"]["on_disk"] and listing["pairs"]["minepair"]["on_disk"]
    assert "llama3-70b-q3" in listing["pairs"]
    removed = runner.invoke(main, ["rm", "mine"])
    assert removed.exit_code == 0 and "removed" in removed.output
    assert not json.loads(runner.invoke(main, ["list", "--json"]).output)["models"]["mine"]["on_disk"]
    again = runner.invoke(main, ["rm", "mine"])  # nothing left: said so, not "removed 0 B"
    assert again.exit_code == 2 and "nothing of it is on disk" in again.output


def test_cli_pull_errors_are_one_line(hub):
    result = CliRunner().invoke(main, ["pull", "org/nothing:Q4_K_M", "-q"])
    assert result.exit_code != 0
    assert result.output.strip().count("\n") == 0 and "repository not found" in result.output


def test_run_with_a_hub_reference(hub, tiny_pair):
    hub.state.add("org/tiny-GGUF", "tiny-F32.gguf", tiny_pair[0].read_bytes())
    hub.state.add("org/tiny-GGUF", "tiny-draft-F32.gguf", tiny_pair[1].read_bytes())
    result = CliRunner().invoke(main, ["run", "-m", "hf://org/tiny-GGUF/tiny-F32.gguf", "-md",
                                       "hf://org/tiny-GGUF/tiny-draft-F32.gguf", "-p", "the cat", "-n", "8",
                                       "-c", "128", "-t", "1", "--json"])
    assert result.exit_code == 0, result.output


def test_run_a_pair_that_is_not_on_disk_says_how_to_get_it():
    result = CliRunner().invoke(main, ["run", "llama3-70b-q3", "-p", "hi"])
    assert result.exit_code == 1
    assert "ggufspec pull llama3-70b-q3" in result.output and result.output.count("\n") == 1


# ---------------------------------------------------------------- a hub that cannot be reached

def closed_port() -> int:
    """A loopback port with nothing listening: connections to it are refused."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MINE = """
    [models.mine]
    repo = "org/model-GGUF"
    file = "model-Q8_0.gguf"
"""


@pytest.mark.parametrize("endpoint", [f"http://127.0.0.1:{closed_port()}", "http://ggufspec-no-such-host.invalid"],
                         ids=["refused", "dns"])
@pytest.mark.parametrize("args", [["pull", "mine", "--dry-run"], ["pull", "mine", "-q"], ["pull", "org/model-GGUF:Q8_0"]],
                         ids=["dry-run", "pull", "pull-reference"])
def test_unreachable_hub_says_so_in_one_line(ggufspec_home, monkeypatch, endpoint, args):
    write_registry(ggufspec_home, MINE)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    line = result.output.strip()
    assert "\n" not in line, result.output
    assert f"cannot reach the hub at {endpoint}" in line and "HF_ENDPOINT" in line and "network" in line, line
    assert "resume" not in line and "interrupted" not in line, line
    assert not store.downloads_dir().exists() or not list(store.downloads_dir().rglob("*"))


def test_unreachable_download_host_is_named_and_nothing_is_kept(hub):
    """The hub answers, but the host it sends the bytes to (its CDN) refuses: not an interrupted transfer."""
    cdn = f"http://127.0.0.1:{closed_port()}"
    hub.state.redirect["model-Q4_K_M.gguf"] = f"{cdn}/blobs/model-Q4_K_M.gguf"
    with pytest.raises(store.HubUnreachable) as exc:
        store.pull(entry(), progress=False)
    assert f"cannot reach the hub at {cdn}" in str(exc.value) and "run pull again" not in str(exc.value)
    assert not store.is_complete(entry())


# ---------------------------------------------------------------- sizes: registry, verified pulls, the hub

def test_size_label_unknown_until_pulled_then_recorded(hub):
    model = entry(file="model-Q8_0.gguf")
    assert store.size_label(model) == "unknown until pulled"
    assert store.known_size(model) is None
    assert store.size_label(model, remote=True) == store.human_size(len(DATA))  # asks the hub, pulls nothing
    assert not [r for r in hub.state.requests if r[0] == "GET"]
    store.pull(model, progress=False)
    recorded = json.loads(store.verified_path().read_text())["org/model-GGUF/model-Q8_0.gguf"]
    assert recorded["size"] == len(DATA) and recorded["sha256"] == hashlib.sha256(REVERSED).hexdigest()
    assert store.verified_files(model)["model-Q8_0.gguf"]["sha256"] == recorded["sha256"]
    store.remove(model)
    assert not store.is_complete(model)
    assert store.size_label(model) == store.human_size(len(DATA))  # still known offline after rm


def test_size_label_from_the_registry_and_offline_for_the_rest():
    registry = load_registry()
    demo = registry.model(registry.pair(None).target)
    assert store.size_label(demo) == store.human_size(demo.size) != "?"
    assert store.size_label(registry.model("codellama-7b-q4_k_m")) == "unknown until pulled"


def test_split_model_size_needs_every_shard_verified(hub):
    shards = [f"big-Q4_K_M-0000{i}-of-00002.gguf" for i in (1, 2)]
    for i, name in enumerate(shards):
        hub.state.add("org/big-GGUF", name, b"GGUF" + DATA[i::2])
    ref = ModelEntry("big", "org/big-GGUF", tuple(shards))
    first_only = ModelEntry("big", "org/big-GGUF", tuple(shards[:1]))
    store.pull(first_only, progress=False)
    assert store.known_size(ref) is None
    store.pull(ref, progress=False)
    assert store.known_size(ref) == len(DATA) + 8  # each shard with its header


def test_a_home_that_cannot_be_written_is_one_line_naming_it(hub, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setenv("GGUFSPEC_HOME", str(tmp_path / "afile" / "home"))
    result = CliRunner().invoke(main, ["pull", "hf://org/model-GGUF/model-Q8_0.gguf", "-q"])
    assert result.exit_code == 1 and result.output.strip().count("\n") == 0, result.output
    assert "afile" in result.output and "GGUFSPEC_HOME" in result.output


def test_a_file_the_registry_now_pins_at_another_hash_is_pulled_again(hub, ggufspec_home):
    """A registry update to a re-uploaded file: the copy verified earlier is not taken as complete."""
    old = entry("model-Q8_0.gguf")
    store.pull(old, progress=False)
    assert store.is_complete(old)
    hub.state.add("org/model-GGUF", "model-Q8_0.gguf", DATA + b"v2")
    pinned = entry("model-Q8_0.gguf", sha=hashlib.sha256(DATA + b"v2").hexdigest())
    assert store.stale_files(pinned) == ["model-Q8_0.gguf"] and not store.is_complete(pinned)
    path = store.pull(pinned, progress=False)[0]
    assert path.read_bytes() == DATA + b"v2" and store.is_complete(pinned)


def test_list_remote_lists_every_model_when_the_hub_lacks_one(hub, ggufspec_home):
    write_registry(ggufspec_home, """
        [models.there]
        repo = "org/model-GGUF"
        file = "model-Q8_0.gguf"
        [models.gone]
        repo = "org/nothing-GGUF"
        file = "x.gguf"
    """)
    result = CliRunner().invoke(main, ["list", "--remote"])
    assert result.exit_code == 0, result.output
    assert "there" in result.output and "gone" in result.output and "warning: gone:" in result.output
