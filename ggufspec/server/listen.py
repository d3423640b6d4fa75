"""Serving an app on a socket: bound before the models load (a port in use fails at once, port 0
works and the real URL is printed), run by uvicorn, stopped cleanly by Ctrl-C or SIGTERM."""
from __future__ import annotations

import signal
import socket
import sys

import uvicorn

from ..errors import GgufspecError
from ..netaddr import is_loopback


def listen(host: str, port: int):
    """A listening socket (uvicorn serves it), so that port 0 works and the real URL can be printed."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise GgufspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def exit_quietly_on_signals() -> None:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: end quietly
    then (SystemExit), so the caller's `with` closes the decoder and saves its measured step costs."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))


def serve_forever(app, sock: socket.socket, *, name: str, host: str, api_key: str | None,
                  shown_port: int | None = None) -> None:
    """Serve until Ctrl-C or SIGTERM. `shown_port`: the port clients use, when `sock` is not it (the
    Unix socket of `serve --rpc`'s model process, behind its supervisor on host:shown_port)."""
    if not is_loopback(host) and not api_key:
        sys.stderr.write(f"ggufspec: warning: listening on {host} without --api-key: anyone who can reach this "
                         f"machine can use the model\n")
    bound_host, bound_port = (host, shown_port) if shown_port is not None else sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    sys.stderr.write(f"ggufspec: serving {name} at http://{shown}:{bound_port}/v1 (OpenAI and Anthropic APIs; Ctrl-C stops)\n")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.engine.stop()  # a long answer must not hold up the shutdown
            super().handle_exit(sig, frame)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])
