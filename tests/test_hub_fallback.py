"""`OWNER/REPO[:QUANT]` and `hf://OWNER/REPO` once pulled: when the hub's listing fails (5xx, 429, a captive
portal's HTML page, a token refused), the store's copy is used with a one-line warning, as hf_hub_download
falls back to its cache; with nothing stored the hub's failure is the error."""
import os

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from hubhooks import hooked_hub, send

REPO, FILE = "org/model-GGUF", "model-Q4_K_M.gguf"
FAILURES = {
    "503": (503, [], b"<html>503</html>"),
    "429": (429, [("Retry-After", "1")], b"slow down"),
    "captive portal": (200, [("Content-Type", "text/html")], b"<html>captive portal</html>"),
    "401": (401, [("X-Error-Code", "RepoNotFound")], b"{}"),
}


@pytest.fixture
def hub(monkeypatch):
    mode = {"failure": None}

    def hook(handler):
        if mode["failure"] is None or not handler.path.startswith("/api/"):
            return False
        return send(handler, *FAILURES[mode["failure"]])

    with hooked_hub(monkeypatch, hook) as server:
        server.state.add(REPO, FILE, b"GGUF" + os.urandom(100_000))
        server.mode = mode
        yield server


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("ref", [f"{REPO}:Q4_K_M", f"hf://{REPO}"])
def test_a_failing_listing_falls_back_to_the_stored_file_with_a_warning(hub, failure, ref):
    assert CliRunner().invoke(main, ["pull", "-q", ref]).exit_code == 0
    hub.mode["failure"] = failure
    result = CliRunner().invoke(main, ["pull", "-q", ref])
    assert result.exit_code == 0, result.output
    assert FILE in result.stdout
    warning = result.stderr.strip()
    assert warning.startswith("ggufspec: warning:") and "\n" not in warning and "from the store" in warning, warning


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failing_listing_with_nothing_stored_is_the_error(hub, failure):
    hub.mode["failure"] = failure
    result = CliRunner().invoke(main, ["pull", "-q", f"{REPO}:Q4_K_M"])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert line.startswith("ggufspec: error:") and "\n" not in line, line
