"""A URL's file in the store is keyed on its server and its path: two URLs ending in the same file name are
two files (neither downloads over the other, `rm` of one keeps the other); a file an older ggufspec kept
under web-HOST-PORT/ is still used by the URL it came from."""
import os
import shutil

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.verified import record_verified
from hfserver import hub_for

NAME = "ggml-model-Q4_K_M.gguf"
A, B = (b"GGUF" + os.urandom(200_000) for _ in range(2))


@pytest.fixture
def hub(monkeypatch):
    with hub_for(monkeypatch) as server:
        server.state.add("alice/m-GGUF", NAME, A)
        server.state.add("bob/m-GGUF", NAME, B)
        server.urls = [f"{server.url}/{owner}/m-GGUF/resolve/main/{NAME}" for owner in ("alice", "bob")]
        yield server


def pull(url):
    result = CliRunner().invoke(main, ["pull", "-q", url])
    assert result.exit_code == 0, result.output
    return store.final_path(store.entry_from_reference(url), NAME)


def test_two_urls_ending_in_one_file_name_are_two_files(hub):
    alice, bob = (pull(url) for url in hub.urls)
    assert alice != bob and alice.read_bytes() == A and bob.read_bytes() == B
    hub.state.requests.clear()
    assert pull(hub.urls[0]).read_bytes() == A
    assert not [r for r in hub.state.requests if r[0] == "GET"]  # already there: not downloaded again
    assert CliRunner().invoke(main, ["rm", hub.urls[0]]).exit_code == 0
    assert not alice.exists() and bob.read_bytes() == B


def test_a_split_models_shards_share_the_folder_of_the_url_named():
    entry = store.entry_from_reference("https://example.com/a/m-00001-of-00002.gguf")
    folders = {store.final_path(entry, file).parent for file in entry.files}
    assert len(entry.files) == 2 and len(folders) == 1


def test_a_file_of_the_old_layout_is_used_by_the_url_it_came_from(hub):
    alice = pull(hub.urls[0])
    entry = store.entry_from_reference(hub.urls[0])
    old_folder = alice.parent.name.rsplit("-", 1)[0]  # web-127.0.0.1-PORT, as an older ggufspec named it
    old = store.models_dir() / old_folder / NAME
    old.parent.mkdir()
    shutil.move(alice, old)
    old_entry = store.ModelEntry(entry.name, old_folder, entry.files, entry.revision)
    record_verified(old_entry, NAME, len(A), store.sha256_of(old))
    hub.state.requests.clear()
    assert pull(hub.urls[0]) == alice and alice.read_bytes() == A and not old.exists()
    assert not [r for r in hub.state.requests if r[0] == "GET"]
    assert pull(hub.urls[1]).read_bytes() == B  # another URL of that name: its own file
