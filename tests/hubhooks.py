"""The tests' fake hub (hfserver) with a hook in front: a test answers some requests itself (a failing,
rate-limiting or captive-portal hub, an expiring CDN link) and leaves the rest to the fake hub."""
from __future__ import annotations

import contextlib
import threading
from http.server import ThreadingHTTPServer

import hfserver


class HookServer(hfserver.HubServer):
    """A HubServer whose handler first calls hook(handler): True when the hook answered the request."""

    def __init__(self, hook=None):
        self.state = hfserver.HubState()
        self.hook = hook
        base, outer = hfserver.make_handler(self.state), self

        class Handler(base):
            def _route(self):
                if outer.hook is not None and outer.hook(self):
                    outer.state.requests.append(("HOOK " + self.command, self.path, self.headers.get("Range")))
                    return None
                return base._route(self)
            do_GET = do_HEAD = _route

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


def send(handler, status: int, headers=(), body: bytes = b"") -> bool:
    """Answer `handler`'s request: status, headers, body (none to a HEAD). True, for a hook to return."""
    handler.send_response(status)
    for key, value in headers:
        handler.send_header(key, value)
    if not any(key.lower() == "content-length" for key, _ in headers):
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD" and body:
        handler.wfile.write(body)
    return True


@contextlib.contextmanager
def hooked_hub(monkeypatch, hook=None):
    """A HookServer that huggingface_hub talks to (HF_ENDPOINT), as hfserver.hub_for sets one up."""
    with HookServer(hook) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
        monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server
