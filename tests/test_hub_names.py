"""Names that almost work get the one that does: a pair or model name with a typo (did you mean ...?), a hub
repository or file without hf://, a file's web page (/blob/) instead of its download link."""
import os

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from clierrors import one_line_error
from hubhooks import hooked_hub, send


@pytest.mark.parametrize("command", [["pull"], ["rm"], ["run", "-p", "hi", "-n", "1"]])
def test_a_typo_of_a_pair_name_says_which_was_meant(command):
    result = CliRunner().invoke(main, [command[0], "llama3-70b-q", *command[1:]])
    one_line_error(result, "'llama3-70b-q'", "did you mean 'llama3-70b-q3'?")


def test_a_name_like_no_other_lists_the_forms_that_work():
    one_line_error(CliRunner().invoke(main, ["pull", "zzzz"]), "ggufspec list", "OWNER/REPO:QUANT")


@pytest.mark.parametrize("name, fix", [
    ("org/model-GGUF", "give hf://org/model-GGUF (its Q4_K_M"),
    ("org/model-GGUF", "org/model-GGUF:Q4_K_M"),
    ("org/model-GGUF/model-Q4_K_M.gguf", "give hf://org/model-GGUF/model-Q4_K_M.gguf"),
    ("org/model-GGUF/blob/main/model-Q4_K_M.gguf", "give hf://org/model-GGUF/model-Q4_K_M.gguf"),
    ("hf://org/model-GGUF/blob/main/model-Q4_K_M.gguf", "give hf://org/model-GGUF/model-Q4_K_M.gguf"),
])
def test_a_hub_name_without_its_form_names_the_form_built_from_it(name, fix):
    one_line_error(CliRunner().invoke(main, ["pull", "--dry-run", name]), fix)


def test_the_hubs_web_page_url_of_a_file_downloads_the_file(monkeypatch):
    data = b"GGUF" + os.urandom(50_000)
    page = lambda h: "/blob/" in h.path and send(h, 200, [("Content-Type", "text/html")], b"<html>the page</html>")
    with hooked_hub(monkeypatch, page) as hub:
        hub.state.add("org/model-GGUF", "model-Q4_K_M.gguf", data)
        result = CliRunner().invoke(main, ["pull", "-q", f"{hub.url}/org/model-GGUF/blob/main/model-Q4_K_M.gguf"])
        assert result.exit_code == 0, result.output
        assert "/resolve/main/model-Q4_K_M.gguf" in result.stderr and result.stderr.count("\n") == 1, result.stderr
        entry = store.entry_from_reference(f"{hub.url}/org/model-GGUF/resolve/main/model-Q4_K_M.gguf")
        assert store.final_path(entry, "model-Q4_K_M.gguf").read_bytes() == data


def test_another_servers_blob_url_is_left_as_it_is():
    url = "https://github.com/org/repo/blob/main/model.gguf"
    assert store.entry_from_reference(url).name == url
