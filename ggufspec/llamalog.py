"""llama.cpp's log, routed through one callback (quiet unless GGUFSPEC_VERBOSE); and a Ctrl-C during a
long native call (a model's load), kept until the call returns."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import threading

import llama_cpp

VERBOSE = os.environ.get("GGUFSPEC_VERBOSE", "") not in ("", "0")


# ggml-alloc's line when a buffer (weights, cache, compute) cannot be had: "failed to allocate CUDA0 buffer
# of size N", an RPC worker's named RPC0[HOST:PORT]. The load then fails saying only "Failed to load model
# from file": the log is the one place that says where the memory ran out (`allocation_failures`).
ALLOCATION_FAILED = re.compile(rb"failed to allocate (\S+) buffer of size (\d+)")
_allocation_failures: list[tuple[str, int]] = []


@llama_cpp.llama_log_callback
def _log_to_stderr_if_verbose(level, text, user_data):
    # llama.cpp logs model loading at length; keep stderr for our own messages unless asked
    if VERBOSE:
        sys.stderr.write(text.decode("utf-8", errors="replace"))
    if found := ALLOCATION_FAILED.search(text or b""):
        _allocation_failures.append((found[1].decode("utf-8", errors="replace"), int(found[2])))


def allocation_failures() -> list[tuple[str, int]]:
    """The (buffer, bytes) that llama.cpp failed to allocate since the last call."""
    failed = list(_allocation_failures)
    _allocation_failures.clear()
    return failed


def quiet_llama_logs() -> None:
    """Route llama.cpp's log through our callback (call after llama-cpp-python installed its own)."""
    llama_cpp.llama_log_set(_log_to_stderr_if_verbose, ctypes.c_void_p(0))


@contextlib.contextmanager
def interrupt_after_native():
    """Ctrl-C (or a stop signal, SIGTERM) within, handled as the caller would once the block ends. Python
    runs a signal's handler at the next Python code, which during a model's load is llama.cpp's log
    callback: the KeyboardInterrupt (or a server's SystemExit) raised there, ctypes drops, and the load
    went on as if nothing was pressed."""
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, _: received.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for sig in dict.fromkeys(received):  # each once, in the order they came
        handler = previous[sig]
        if callable(handler):
            handler(sig, None)  # Python's default for SIGINT raises KeyboardInterrupt
        elif handler == signal.SIG_DFL and sig == signal.SIGINT:
            raise KeyboardInterrupt
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), sig)  # the default: the process ends, as it would have
