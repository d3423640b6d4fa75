"""A QA pass over `ggufspec pull` and the store, against Hugging Face-compatible servers on 127.0.0.1:
shard names that no split has, answers no hub sends, a file re-uploaded between two cut pulls where
the hub gives no sha256, a file system that refuses the download. Each one line, nothing lost."""
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from hfserver import hub_for

REPO = "org/model-GGUF"
DATA = b"GGUF" + os.urandom(3_000_000)


@pytest.fixture
def hub(monkeypatch, ggufspec_home):
    with hub_for(monkeypatch) as server:
        server.state.add(REPO, "model-Q4_K_M.gguf", DATA)
        yield server


def one_line_error(result, code: int = 1) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert isinstance(result.exception, SystemExit) and lines[0].startswith("ggufspec: error: "), result.output
    return lines[0]


class Answering:
    """A server that answers every request with one status and body (a mirror gone wrong)."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json"):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def answer(self):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
            do_GET = do_HEAD = answer
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------- split shard names

@pytest.mark.parametrize("file", ["x-Q4_K_M-00001-of-00000.gguf", "x-Q4_K_M-00003-of-00002.gguf",
                                  "x-Q4_K_M-00000-of-00002.gguf"])
def test_a_shard_name_no_split_has_is_a_file_of_its_own(hub, file):
    """`-00001-of-00000` used to give a model of no files (IndexError), `-00003-of-00002` the shards of
    another model than the one named."""
    hub.state.add("org/s-GGUF", file, DATA)
    assert store.entry_from_reference(f"hf://org/s-GGUF/{file}").files == (file,)
    assert store.entry_from_reference("org/s-GGUF:Q4_K_M").files == (file,)
    result = CliRunner().invoke(main, ["pull", "-q", "org/s-GGUF:Q4_K_M"])
    assert result.exit_code == 0, result.output
    assert store.final_path(store.entry_from_reference(f"hf://org/s-GGUF/{file}"), file).read_bytes() == DATA


# ---------------------------------------------------------------- answers no hub sends

@pytest.mark.parametrize("body", [b"<html>proxy login</html>", b"null", b"[]", b'{"siblings": 3}',
                                  b'{"id": "org/x", "siblings": [7]}'])
def test_a_listing_no_hub_sends_is_one_line(ggufspec_home, monkeypatch, body):
    """A proxy's page or another JSON where the hub's listing should be was a traceback."""
    with Answering(200, body) as mirror:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        line = one_line_error(CliRunner().invoke(main, ["pull", "-q", f"{REPO}:Q4_K_M"]))
    assert "answered with something no hub sends" in line and mirror.url in line and "HF_ENDPOINT" in line, line


def test_a_draft_search_survives_an_owner_listing_no_hub_sends(ggufspec_home, monkeypatch):
    from ggufspec import hubdraft
    from ggufspec.registry import load_registry
    with Answering(200, b"<html>not json</html>") as mirror:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        assert hubdraft._family_repos(REPO, load_registry()) == [REPO]  # no listing: the repository alone


# ---------------------------------------------------------------- a re-upload with no sha256

def test_a_file_with_no_sha256_reuploaded_between_two_cut_pulls_starts_again(hub):
    """The hub gives no sha256 (a plain web server): the partial of the old upload was resumed with the
    new upload's bytes, and the mix installed as verified."""
    hub.state.unhashed.add("model-Q4_K_M.gguf")
    hub.state.cut_at["model-Q4_K_M.gguf"] = 2_500_000
    ref = f"hf://{REPO}/model-Q4_K_M.gguf"
    assert CliRunner().invoke(main, ["pull", "-q", ref]).exit_code == 1
    assert [p for p in store.downloads_dir().rglob("*") if p.is_file() and p.stat().st_size]  # a prefix kept
    new = b"GGUF" + os.urandom(len(DATA) - 4)  # the same size: only the hub's ETag tells the uploads apart
    hub.state.add(REPO, "model-Q4_K_M.gguf", new)
    del hub.state.cut_at["model-Q4_K_M.gguf"]
    result = CliRunner().invoke(main, ["pull", "-q", ref])
    assert result.exit_code == 0, result.output
    assert store.final_path(store.entry_from_reference(ref), "model-Q4_K_M.gguf").read_bytes() == new


def test_a_file_with_no_sha256_cut_then_resumed_is_still_resumed(hub):
    hub.state.unhashed.add("model-Q4_K_M.gguf")
    hub.state.cut_at["model-Q4_K_M.gguf"] = 2_500_000
    ref = f"hf://{REPO}/model-Q4_K_M.gguf"
    assert CliRunner().invoke(main, ["pull", "-q", ref]).exit_code == 1
    del hub.state.cut_at["model-Q4_K_M.gguf"]
    hub.state.requests.clear()
    assert CliRunner().invoke(main, ["pull", "-q", ref]).exit_code == 0
    assert [r for m, _, r in hub.state.requests if m == "GET" and r and r != "bytes=0-"]


# ---------------------------------------------------------------- a file system that refuses the file

def test_a_file_system_that_takes_no_file_this_large_is_not_called_an_interrupted_transfer(hub, ggufspec_home):
    """EFBIG (a FAT32 disk, a file size limit) said `download interrupted ... run pull again to resume`,
    which fails the same way for ever."""
    script = textwrap.dedent("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, resource.RLIM_INFINITY))
        from ggufspec.cli import main
        main(["pull", "-q", sys.argv[1]])
    """)
    done = subprocess.run([sys.executable, "-c", script, f"hf://{REPO}/model-Q4_K_M.gguf"], env={**os.environ},
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "cannot be written" in lines[0] and "GGUFSPEC_HOME" in lines[0] and "resume" not in lines[0], lines[0]
    assert not done.stdout
    partial = [p for p in store.downloads_dir().rglob("*.incomplete")]
    assert partial and partial[0].stat().st_size > 0  # what arrived is kept for a pull into a bigger disk


def test_a_listing_of_firsts_of_20000_shards_is_answered_at_once(hub, ggufspec_home):
    """Each name expanded to its whole shard list: 1,000 names claiming 20,000 shards each took minutes
    and gigabytes (a hostile mirror's listing stays under the 20,000 names allowed)."""
    import time
    from ggufspec import hubdraft
    from ggufspec.errors import BadReferenceError
    from ggufspec.registry import ModelEntry, load_registry
    for i in range(1000):
        hub.state.add(REPO, f"m{i}-Q2_K-00001-of-20000.gguf", b"")
    started = time.monotonic()
    with pytest.raises(BadReferenceError, match="ambiguous, 1000 models"):
        store.entry_from_reference(f"{REPO}:Q2_K")
    assert store.entry_from_reference(f"{REPO}:Q4_K_M").files == ("model-Q4_K_M.gguf",)
    candidates = hubdraft._candidates(ModelEntry("t", REPO, ("model-Q4_K_M.gguf",)), load_registry())
    assert len(candidates) == 1000 and all(size is None for _, _, size in candidates)  # none whole
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_a_failing_or_busy_hub_says_to_try_again_later(ggufspec_home, monkeypatch, status):
    """A 5xx or 429 was the hub's status line alone, with nothing to do about it."""
    with Answering(status, b"busy") as mirror:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        for ref in (f"hf://{REPO}/model-Q4_K_M.gguf", f"{REPO}:Q4_K_M"):
            line = one_line_error(CliRunner().invoke(main, ["pull", "-q", ref]))
            assert str(status) in line and "run pull again later" in line, line
