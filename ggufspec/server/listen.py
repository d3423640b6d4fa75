"""Serving an app on a socket: bound before the models load (a port in use fails at once, port 0
works and the real URL is printed), run by uvicorn, stopped by Ctrl-C or SIGTERM within a few seconds
whatever a request is doing."""
from __future__ import annotations

import copy
import os
import signal
import socket
import ssl
import sys
import threading
from dataclasses import dataclass

import uvicorn
from sse_starlette.sse import AppStatus

from .. import llamalog
from ..errors import GgufspecError
from ..netaddr import is_loopback
from .guard import Exposure

STOP_GRACE_S = 2.0  # after Ctrl-C or SIGTERM, how long open connections may take to finish
STOP_DEADLINE_S = 4.0  # ... and how long the whole process may: then it exits without waiting
STREAMS_CUT_S = 1.0  # after the stop signal, when sse-starlette cuts the streams still open
# uvicorn's log level at llama.cpp's verbosity threshold (-lv N, -v): its startup lines are a server's info
# (llama-server's own, shown at its default 3); each request is llama-server's "done request" line, trace (4)
UVICORN_LEVELS = ((llamalog.LOG_LEVEL_DEBUG, "debug"), (llamalog.LOG_LEVEL_INFO, "info"),
                  (llamalog.LOG_LEVEL_WARN, "warning"), (llamalog.LOG_LEVEL_ERROR, "error"))


def listen(host: str, port: int, reuse_port: bool = False):
    """A listening socket (uvicorn serves it), so that port 0 works and the real URL can be printed.
    `reuse_port`: llama-server's --reuse-port (SO_REUSEPORT: several servers on one port, the kernel
    spreading the connections among them)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise GgufspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class Tls:
    """--ssl-key-file and --ssl-cert-file (llama-server's): the server speaks HTTPS, so that an API key
    and the conversations cross a network encrypted."""
    keyfile: str
    certfile: str

    def uvicorn_options(self) -> dict:
        return {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile}


def tls_from(keyfile: str | None, certfile: str | None) -> Tls | None:
    """The two files, checked now (a PEM certificate and its private key that load together), rather
    than by the first client after the models have loaded; None where neither is given."""
    if keyfile is None and certfile is None:
        return None
    if keyfile is None or certfile is None:
        raise GgufspecError("give both --ssl-key-file and --ssl-cert-file (a PEM private key and its certificate), "
                            "or neither")
    try:  # an encrypted key would make OpenSSL ask for its passphrase on the terminal: an empty one fails instead
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=lambda: b"")
    except ssl.SSLError as exc:
        raise GgufspecError(f"--ssl-cert-file {certfile} and --ssl-key-file {keyfile} are not a PEM certificate and "
                            f"its unencrypted private key ({exc.reason or exc}; an encrypted key: openssl pkey -in KEY "
                            f"-out PLAIN.pem)") from None
    except OSError as exc:
        raise GgufspecError(f"--ssl-key-file / --ssl-cert-file: {exc.filename or certfile}: "
                            f"{exc.strerror or exc}") from None
    return Tls(os.path.abspath(keyfile), os.path.abspath(certfile))


def exit_quietly_on_signals() -> None:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: end quietly
    then (SystemExit), so the caller's `with` closes the decoder and saves its measured step costs."""
    def leave(*_):
        # once: a second signal (a supervisor's terminate() after uvicorn's own) would raise SystemExit
        # again inside whatever Python runs next, such as llama.cpp's log callback while the model is
        # freed ("Exception ignored ... Traceback"); the stop deadline still bounds the exit
        for repeated in (signal.SIGINT, signal.SIGTERM):
            signal.signal(repeated, signal.SIG_IGN)
        sys.exit(0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)


def exit_by_deadline(seconds: float = STOP_DEADLINE_S) -> None:
    """From now on, the process has `seconds` to end: past them (a llama.cpp call that does not return,
    a request that does not finish) it exits at once, without closing the models."""
    def deadline():
        threading.Event().wait(seconds)
        sys.stderr.write(f"ggufspec: still busy {seconds:g} s after the stop signal: exiting without waiting\n")
        sys.stderr.flush()
        os._exit(0)
    threading.Thread(target=deadline, daemon=True, name="ggufspec-stop-deadline").start()


def uvicorn_logging() -> dict:
    """uvicorn.Config's log options as the log flags say (llamalog's settings): by default its warnings
    alone, no access log; --log-disable: nothing; -lv N / -v: at the level N means, each request from 4 up.
    Every line on stderr (uvicorn writes its access log on stdout, which ggufspec keeps for results),
    coloured as --log-colors says."""
    log = llamalog.log_settings()
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    options = {"log_config": config, "use_colors": log.colors}
    if log.disabled:
        return {**options, "log_level": "critical", "access_log": False}
    if log.threshold is None:
        return {**options, "log_level": "warning", "access_log": False}
    level = next((name for least, name in UVICORN_LEVELS if log.threshold >= least), "critical")
    return {**options, "log_level": level, "access_log": log.threshold >= llamalog.LOG_LEVEL_TRACE}


def warnings(host: str, exposure: Exposure) -> list[str]:
    """What the start should say about who can reach the model."""
    said = []
    if not is_loopback(host) and not exposure.api_key:
        said.append(f"listening on {host} without --api-key: anyone who can reach this machine can use the model")
    if exposure.any_origin and not exposure.api_key:
        said.append("--cors-origins * without --api-key: any web page open in a browser on a machine that "
                    "reaches this server can use the model")
    return said


def serve_forever(app, sock: socket.socket, *, name: str, host: str, exposure: Exposure,
                  shown_port: int | None = None, tls: Tls | None = None, api_prefix: str = "") -> None:
    """Serve until Ctrl-C or SIGTERM. `shown_port`: the port clients use, when `sock` is not it (the
    Unix socket of `serve --rpc`'s model process, behind its supervisor on host:shown_port, which
    speaks the `tls` then). `exposure`: the policy clients meet, said in the start line; `api_prefix`:
    where the routes are (--api-prefix), in the URL it shows."""
    for warning in warnings(host, exposure):
        sys.stderr.write(f"ggufspec: warning: {warning}\n")
    bound_host, bound_port = (host, shown_port) if shown_port is not None else sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    scheme = "https" if tls else "http"
    sys.stderr.write(f"ggufspec: serving {name} at {scheme}://{shown}:{bound_port}{api_prefix}/v1 (OpenAI and Anthropic APIs; "
                     f"{exposure.summary()}; Ctrl-C stops)\n")
    stopping = threading.Event()

    # sse-starlette cuts every open stream on the stop signal (within its 0.5 s poll), racing the
    # engine's stop: a stream then ended with no event saying the answer was cut short. The engine's
    # stop ends each running answer with an error event at its next token; the streams left open
    # after STREAMS_CUT_S (one still evaluating its prompt, one waiting for a slot) are cut then.
    AppStatus.disable_automatic_graceful_drain()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.engine.stop()  # a long answer must not hold up the shutdown
            if not stopping.is_set():
                stopping.set()
                exit_by_deadline()
                cut = threading.Timer(STREAMS_CUT_S, setattr, (AppStatus, "should_exit", True))
                cut.daemon = True
                cut.start()
            super().handle_exit(sig, frame)
    encrypted = tls.uvicorn_options() if tls and shown_port is None else {}  # behind a supervisor: it encrypts
    config = uvicorn.Config(app, timeout_graceful_shutdown=STOP_GRACE_S, **uvicorn_logging(), **encrypted)
    Server(config).run(sockets=[sock])
