"""A Hugging Face-compatible file server on 127.0.0.1 for the store tests.

It answers what huggingface_hub asks: HEAD/GET `/{repo}/resolve/{revision}/{file}` with
X-Repo-Commit, X-Linked-Etag (the LFS sha256), X-Linked-Size, Range requests (206), the hub's
X-Error-Code for missing repos, files and gated repos, `/api/models/{repo}` (model_info, with file
sizes as the hub gives them for `blobs=True`), `/api/models/{repo}/tree/{revision}` and `/api/models`
(list_models: `author` and `search` filter the repos held). It counts the bytes it sends per file
(`served`), to tell a header read from a download.
It can cut a download at a byte offset, to test interrupted pulls, and send a file's download
elsewhere (the hub's redirect to its CDN), to test a CDN that cannot be reached. A hostile mirror's
answers too: file names that climb out of a folder (add them like any file), a size that is not
the file's (`announced_size`), a listing padded with thousands of names (`listing_padding`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubState:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.served_sha: dict[tuple[str, str], str] = {}  # lie about a file's hash (corruption tests)
        self.cut_at: dict[str, int] = {}                  # file -> byte offset where GETs stop
        self.redirect: dict[str, str] = {}                # file -> absolute URL of its bytes (a "CDN")
        self.announced_size: dict[str, int] = {}          # file -> the size HEAD claims (a lying mirror)
        self.listing_padding = 0                          # extra made-up names in model_info's listing
        self.requests: list[tuple[str, str, str | None]] = []
        self.served: dict[tuple[str, str], int] = {}       # (repo, file) -> bytes of it sent in GET answers
        self.authorizations: list[str | None] = []         # each request's Authorization header
        self.seconds_per_chunk = 0.0                       # a slow hub: a pause after each 64 KiB sent
        self.unhashed: set[str] = set()                    # files served without their sha256 (a plain web server)
        self.bare_401 = False                              # a mirror that wants a login: 401s with no X-Error-Code

    def add(self, repo: str, file: str, data: bytes) -> None:
        self.repos.setdefault(repo, {})[file] = data

    def sha(self, repo: str, file: str) -> str:
        return self.served_sha.get((repo, file)) or hashlib.sha256(self.repos[repo][file]).hexdigest()


def make_handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _error(self, status: int, code: str, message: str):
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _route(self):
            state.requests.append((self.command, self.path, self.headers.get("Range")))
            state.authorizations.append(self.headers.get("Authorization"))
            if state.bare_401:
                body = b"<html>login</html>"
                self.send_response(401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                return None if self.command == "HEAD" else self.wfile.write(body)
            path = self.path.split("?")[0]
            if path == "/api/models":
                return self._list_models()
            if m := re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                return self._tree(m[1])
            if m := re.match(r"^/api/models/([^/]+/[^/]+)(/revision/[^/]+)?$", path):
                return self._info(m[1])
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if not m:
                return self._error(404, "EntryNotFound", "no such route")
            repo, _revision, file = m.groups()
            if repo not in state.repos:
                return self._error(401, "RepoNotFound", "Repository not found")
            if repo in state.gated:
                return self._error(403, "GatedRepo", f"Access to model {repo} is restricted.")
            if file not in state.repos[repo]:
                return self._error(404, "EntryNotFound", "Entry not found")
            self._file(repo, file)

        def _info(self, repo):
            if repo not in state.repos:
                return self._error(401, "RepoNotFound", "Repository not found")
            padding = [f"padding/file-{i}.bin" for i in range(state.listing_padding)]
            self._json({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f, "size": len(d)} for f, d in state.repos[repo].items()]
                        + [{"rfilename": f} for f in padding]})

        def _list_models(self):
            from urllib.parse import parse_qs, urlsplit
            query = parse_qs(urlsplit(self.path).query)
            author, search = (query.get(k, [""])[0].lower() for k in ("author", "search"))
            self._json([{"id": r, "modelId": r, "sha": COMMIT} for r in state.repos
                        if (not author or r.split("/")[0].lower() == author) and search in r.lower()])

        def _json(self, value):
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _tree(self, repo):
            if repo not in state.repos:
                return self._error(401, "RepoNotFound", "Repository not found")
            self._json([{"type": "file", "path": f, "size": len(d), "oid": COMMIT}
                        for f, d in state.repos[repo].items()])

        def _redirect(self, repo, file):
            """What the hub answers for an LFS file stored on its CDN: 302, with the file's metadata."""
            self.send_response(302)
            self.send_header("Location", state.redirect[file])
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("X-Linked-Etag", f'"{state.sha(repo, file)}"')
            self.send_header("X-Linked-Size", str(len(state.repos[repo][file])))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _file(self, repo, file):
            if file in state.redirect:
                return self._redirect(repo, file)
            data = state.repos[repo][file]
            start, end = 0, len(data)
            if rng := re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or ""):
                start = int(rng[1])
                end = min(end, int(rng[2]) + 1) if rng[2] else end
            self.send_response(206 if start or end < len(data) else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            # the hub's ETag of a file outside LFS is its git blob id: it changes with the content
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            if file not in state.unhashed:
                self.send_header("X-Linked-Etag", f'"{state.sha(repo, file)}"')
                self.send_header("X-Linked-Size", str(state.announced_size.get(file, len(data))))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(max(0, end - start)))
            if start or end < len(data):
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            stop = min(end, state.cut_at.get(file, len(data)))
            for at in range(start, max(start, stop), 1 << 16):
                self.wfile.write(data[at:min(at + (1 << 16), stop)])
                time.sleep(state.seconds_per_chunk)
            state.served[(repo, file)] = state.served.get((repo, file), 0) + max(0, stop - start)
            if stop < end:
                self.wfile.flush()
                self.close_connection = True  # the connection drops mid-file

        do_GET = do_HEAD = _route

    return Handler


class HubServer:
    def __init__(self):
        self.state = HubState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def hub_for(monkeypatch):
    """A HubServer that huggingface_hub (and so the store) talks to: HF_ENDPOINT set to it, no
    telemetry, short timeouts (a test of an unreachable hub fails fast)."""
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
        monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
        yield server
