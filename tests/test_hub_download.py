"""Downloads from a fake hub that fails as the real one does: signed CDN links that expire between and
during a split model's shards, and the one-line errors for a refused, rate-limited or failing hub, a
revision it lacks, a redirect loop (no empty partial download left behind by a failed GET)."""
import os
import re
import textwrap

import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.errors import StoreError
from ggufspec.registry import ModelEntry, RegistryError, load_registry
from hubhooks import hooked_hub, send

REPO = "org/big-GGUF"
SHARDS = {f"big-Q4_K_M-0000{i}-of-00002.gguf": b"GGUF" + os.urandom(1_200_000) for i in (1, 2)}


class Cdn:
    """The hub's 302 to a CDN link that only the latest HEAD's link opens (each HEAD expires the ones before),
    as signed URLs that expired while other files downloaded; `refuse_all`: no link opens."""

    def __init__(self):
        self.generation, self.refuse_all, self.cut_once = 0, False, None

    def hook(self, handler):
        if m := re.match(rf"^/{REPO}/resolve/[^/]+/(.+)$", handler.path):
            self.generation += 1
            cdn = f"http://localhost:{handler.server.server_address[1]}"  # another host than the hub's 127.0.0.1
            return send(handler, 302, [("Location", f"{cdn}/cdn/{m[1]}?gen={self.generation}"),
                                       ("X-Repo-Commit", "0" * 40),
                                       ("X-Linked-Etag", f'"{store.hashlib.sha256(SHARDS[m[1]]).hexdigest()}"'),
                                       ("X-Linked-Size", str(len(SHARDS[m[1]])))])
        if m := re.match(r"^/cdn/([^?]+)\?gen=(\d+)$", handler.path):
            if self.refuse_all or int(m[2]) != self.generation:
                return send(handler, 403, [("Content-Type", "application/xml")], b"<Error>Request has expired</Error>")
            return self.serve(handler, SHARDS[m[1]])
        return False

    def serve(self, handler, data):
        start = int(re.match(r"bytes=(\d+)-", handler.headers.get("Range") or "bytes=0-")[1])
        handler.send_response(206 if start else 200)
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        stop = self.cut_once or len(data)
        handler.wfile.write(data[start:stop])
        if self.cut_once:  # the connection drops mid-file, and meanwhile the link expires
            self.cut_once, self.generation = None, self.generation + 1
            handler.close_connection = True
        return True


@pytest.fixture
def cdn(monkeypatch):
    cdn = Cdn()
    with hooked_hub(monkeypatch, cdn.hook) as server:
        for name, data in SHARDS.items():
            server.state.add(REPO, name, data)
        cdn.server = server
        yield cdn


def split_entry():
    return ModelEntry("big", REPO, tuple(SHARDS))


def test_each_shard_gets_a_fresh_link_though_the_first_ones_expired(cdn):
    paths = store.pull(split_entry(), progress=False)
    assert [p.read_bytes() for p in paths] == list(SHARDS.values())


def test_a_link_that_expires_mid_transfer_is_asked_again_and_the_download_resumed(cdn):
    cdn.cut_once = 1_100_000  # past the store's 1 MiB chunk: that much is on disk when the connection drops
    paths = store.pull(split_entry(), progress=False)
    assert [p.read_bytes() for p in paths] == list(SHARDS.values())
    gets = [(path, rng) for method, path, rng in cdn.server.state.requests if method == "HOOK GET"]
    first_link = gets[0][0]
    assert any(rng and rng != "bytes=0-" and path != first_link and "00001" in path for path, rng in gets), gets


def test_a_link_refused_twice_says_it_expired_and_that_pull_resumes(cdn):
    cdn.refuse_all = True
    result = CliRunner().invoke(main, ["pull", "-q", f"{REPO}:Q4_K_M"])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "expired" in line and "pull" in line and "HF_TOKEN" not in line, line


# ---------------------------------------------------------------- the hub's failures, one line each

FILE = "model-Q4_K_M.gguf"
RESOLVE = f"/org/model-GGUF/resolve/main/{FILE}"
ANY_REVISION = "/org/model-GGUF/resolve/"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no login of the machine's
    answer = {}
    with hooked_hub(monkeypatch, lambda h: bool(answer.get(h.command)) and h.path.startswith(ANY_REVISION)
                    and send(h, *answer[h.command])) as server:
        server.state.add("org/model-GGUF", FILE, b"GGUF" + os.urandom(100_000))
        server.answer = answer
        yield server


def pull_error(ref=f"hf://org/model-GGUF/{FILE}") -> str:
    result = CliRunner().invoke(main, ["pull", "-q", ref])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert line.startswith("ggufspec: error:") and "\n" not in line and "Traceback" not in result.output, line
    return line


def test_a_plain_403_says_access_was_refused_without_none(hub):
    hub.answer["HEAD"] = (403, [], b"")
    line = pull_error()
    assert "None" not in line and "403" in line and "HF_TOKEN" in line, line


def test_a_401_with_a_token_given_says_the_token_was_refused(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_bad")
    hub.answer["HEAD"] = (401, [("X-Error-Message", "Invalid credentials in Authorization header")], b"{}")
    line = pull_error()
    assert "refused" in line and "token" in line and "set HF_TOKEN" not in line, line


def test_a_429_says_the_hub_is_rate_limiting(hub):
    hub.answer["HEAD"] = (429, [("Retry-After", "30")], b"slow down")
    line = pull_error()
    assert "rate-limiting" in line and "30 s" in line and "failing" not in line, line


def test_a_get_answered_503_leaves_no_empty_partial_download(hub):
    hub.answer["GET"] = (503, [], b"<html>down</html>")
    line = pull_error()
    assert "failing" in line and "503" in line, line
    assert not [p for p in store.downloads_dir().rglob("*") if p.is_file()]
    listed = CliRunner().invoke(main, ["list"])
    assert "PARTIAL" not in listed.output, listed.output


def test_a_redirect_loop_is_named_as_one(hub):
    hub.answer["HEAD"] = (302, [("Location", RESOLVE)], b"")
    line = pull_error()
    assert "redirect" in line and "loop" in line and "cannot reach" not in line, line


def test_a_missing_revision_is_named_with_where_it_comes_from(hub, ggufspec_home):
    hub.answer["HEAD"] = (404, [("X-Error-Code", "RevisionNotFound"), ("X-Error-Message", "Invalid rev id: v9")], b"{}")
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    (ggufspec_home / "models.toml").write_text(textwrap.dedent(f'''
        [models.m]
        repo = "org/model-GGUF"
        file = "{FILE}"
        revision = "v9"
        '''))
    line = pull_error("m")
    assert "'v9'" in line and "models.toml" in line, line


def test_an_empty_revision_is_refused_when_models_toml_is_read(ggufspec_home):
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    (ggufspec_home / "models.toml").write_text('[models.m]\nrepo = "org/m-GGUF"\nfile = "m.gguf"\nrevision = ""\n')
    with pytest.raises(RegistryError, match=r"models\.toml:4: models\.m\.revision: empty"):
        load_registry()


def test_a_captive_portal_page_is_named_as_such(hub, monkeypatch):
    with pytest.raises(StoreError, match="not JSON") as exc:
        from ggufspec.hubrefs import repo_files
        hub.hook = lambda h: h.path.startswith("/api/") and send(h, 200, [("Content-Type", "text/html")], b"<html>")
        repo_files("org/model-GGUF")
    assert "JSONDecodeError: 0" not in str(exc.value)
