"""llama.cpp's log, routed through one callback: quiet unless GGUFSPEC_VERBOSE or the log flags
(cli.log_flags: -v, -lv N, --log-disable, --log-file...) say otherwise, with common/log.cpp's verbosity
threshold, prefix, timestamps and colours; and a Ctrl-C during a long native call (a model's load), kept
until the call returns."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

import llama_cpp

VERBOSE = os.environ.get("GGUFSPEC_VERBOSE", "") not in ("", "0")

# ggml.h's enum ggml_log_level, as the callback receives it
GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR, \
    GGML_LOG_LEVEL_CONT = range(6)
# common/log.h's verbosity numbers (-lv N shows what is at most N)...
LOG_LEVEL_OUTPUT, LOG_LEVEL_ERROR, LOG_LEVEL_WARN, LOG_LEVEL_INFO, LOG_LEVEL_TRACE, LOG_LEVEL_DEBUG = range(6)
EVERYTHING = 2**31 - 1  # -v: llama.cpp's INT_MAX
# ... and the one each ggml level has (common_log_get_verbosity): the library's info lines are "trace", 4,
# so that llama-server's default threshold (3) shows its own info lines and the library's warnings only
VERBOSITY = {GGML_LOG_LEVEL_NONE: LOG_LEVEL_OUTPUT, GGML_LOG_LEVEL_DEBUG: LOG_LEVEL_DEBUG,
             GGML_LOG_LEVEL_INFO: LOG_LEVEL_TRACE, GGML_LOG_LEVEL_WARN: LOG_LEVEL_WARN,
             GGML_LOG_LEVEL_ERROR: LOG_LEVEL_ERROR}
LETTERS = {GGML_LOG_LEVEL_DEBUG: "D", GGML_LOG_LEVEL_INFO: "I", GGML_LOG_LEVEL_WARN: "W", GGML_LOG_LEVEL_ERROR: "E"}
# common/log.cpp's colours: the timestamp blue, the info letter green, a warning, an error, a debug line whole
BLUE, RESET = "\033[34m", "\033[0m"
COLOURS = {GGML_LOG_LEVEL_DEBUG: "\033[33m", GGML_LOG_LEVEL_INFO: "\033[32m", GGML_LOG_LEVEL_WARN: "\033[35m",
           GGML_LOG_LEVEL_ERROR: "\033[31m"}
COLOURED_WHOLE = (GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR)
_T_START = time.time()  # timestamps count from here, as common_log's from its creation


@dataclass(frozen=True)
class LogSettings:
    """How llama.cpp's log is shown. `threshold`: llama.cpp's verbosity threshold (-lv), None for ggufspec's
    default (nothing shown); `stderr`: where its lines go (`FdWriter`), None for sys.stderr at the time;
    `file`: --log-file's, written the same lines, plain."""
    threshold: int | None = EVERYTHING if VERBOSE else None
    disabled: bool = False
    prefix: bool = False
    timestamps: bool = False
    colors: bool = False
    stderr: FdWriter | TextIO | None = None
    file: TextIO | None = None

    def shows(self, verbosity: int) -> bool:
        return not self.disabled and self.threshold is not None and verbosity <= self.threshold


class FdWriter:
    """Text to a stream that a model's load cannot silence: llama-cpp-python points fd 2 at /dev/null (and
    sys.stderr at a null file) while it loads, so a stream on a descriptor is written through a copy of it
    taken now; a stream on none (a test's capture) is written as it is."""

    def __init__(self, stream: TextIO):
        self.stream, self.encoding = stream, getattr(stream, "encoding", None) or "utf-8"
        try:
            self.fd: int | None = os.dup(stream.fileno())
        except (AttributeError, OSError, ValueError):
            self.fd = None

    def write(self, text: str) -> None:
        if self.fd is None:
            self.stream.write(text)
            return
        data = text.encode(self.encoding, errors="replace")
        while data:  # a pipe may take part of it
            data = data[os.write(self.fd, data):]

    def flush(self) -> None:
        if self.fd is None:
            self.stream.flush()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_settings = LogSettings()
_last_level = GGML_LOG_LEVEL_INFO  # what a GGML_LOG_LEVEL_CONT piece continues
_writing = threading.Lock()


def configure(settings: LogSettings) -> LogSettings:
    """Use `settings` from now on (before a model loads, for its load log); the previous ones, to restore."""
    global _settings
    previous, _settings = _settings, settings
    return previous


def log_settings() -> LogSettings:
    return _settings


# ggml-alloc's line when a buffer (weights, cache, compute) cannot be had: "failed to allocate CUDA0 buffer
# of size N", an RPC worker's named RPC0[HOST:PORT]. The load then fails saying only "Failed to load model
# from file": the log is the one place that says where the memory ran out (`allocation_failures`).
ALLOCATION_FAILED = re.compile(rb"failed to allocate (\S+) buffer of size (\d+)")
_allocation_failures: list[tuple[str, int]] = []
# the loader's warning for an --override-kv of another type than its key is read as: the file's value is then
# used, the override silently dropped (`ignored_overrides`)
OVERRIDE_IGNORED = re.compile(rb"Bad metadata override type for key '([^']*)', expected (\w+) but got (\w+)")
_ignored_overrides: list[tuple[str, str, str]] = []
# the grammar sampler's refusals after its parser's (which prints to fd 2: grammar.parser_said)
GRAMMAR_REFUSED = re.compile(rb"grammar does not contain a '[^']*' symbol|left recursion detected for nonterminal "
                             rb"at index \d+")
_grammar_refusals: list[str] = []
# held while fd 2 or ggml's log callback points elsewhere: a model's load (llama-cpp-python's
# suppress_stdout_stderr), a grammar's parse (`grammar.parser_said`), a GGUF header's read
# (`ggufheader.ggml_log_captured`); two at once would each restore what the other had swapped in
FD2_SWAP = threading.RLock()


@llama_cpp.llama_log_callback
def _log_to_stderr_if_verbose(level, text, user_data):
    # llama.cpp logs model loading at length; keep stderr for our own messages unless asked
    global _last_level
    if found := ALLOCATION_FAILED.search(text or b""):
        _allocation_failures.append((found[1].decode("utf-8", errors="replace"), int(found[2])))
    if found := OVERRIDE_IGNORED.search(text or b""):
        _ignored_overrides.append(tuple(part.decode("utf-8", errors="replace") for part in found.groups()))
    if found := GRAMMAR_REFUSED.search(text or b""):
        _grammar_refusals.append(found[0].decode("utf-8", errors="replace"))
    continued = level == GGML_LOG_LEVEL_CONT
    # a continuation (the load's "." progress dots) is shown or not with the line it continues: llama.cpp
    # gives every one verbosity 4: the same for those dots, but at -lv 2 or 3 it would cut a warning short
    if continued:
        level = _last_level
    else:
        _last_level = level
    settings = _settings
    if settings.shows(VERBOSITY.get(level, LOG_LEVEL_OUTPUT)):
        _write(settings, level, (text or b"").decode("utf-8", errors="replace"), continued)


log_callback = _log_to_stderr_if_verbose  # for a callback of the moment (one that keeps the lines) to pass them on


def _write(settings: LogSettings, level: int, message: str, continued: bool) -> None:
    stamp = _timestamp() if settings.timestamps else None  # one for the terminal's line and the file's
    try:  # an exception here would be printed by ctypes as a traceback, mid-load
        with _writing:
            stderr = settings.stderr or sys.stderr
            stderr.write(_formatted(settings, level, message, continued, stamp, settings.colors))
            stderr.flush()
            if settings.file is not None:
                settings.file.write(_formatted(settings, level, message, continued, stamp, colors=False))
                settings.file.flush()
    except (OSError, ValueError):  # a closed pipe or file: the log is lost, not the load
        pass


def _formatted(settings: LogSettings, level: int, message: str, continued: bool, stamp: str | None,
               colors: bool) -> str:
    """common_log_entry::print's line: [timestamp] [level letter] message; nothing before a continuation
    or an output line. A warning, an error or a debug line is coloured whole, its letter or not."""
    if continued or level not in LETTERS:
        return message
    colour, end = (COLOURS[level], RESET) if colors else ("", "")
    head = f"{BLUE if colors else ''}{stamp}{end} " if stamp is not None else ""
    if settings.prefix:
        head += f"{colour}{LETTERS[level]} {end if level == GGML_LOG_LEVEL_INFO else ''}"
    if level not in COLOURED_WHOLE or not colors:
        return head + message
    body = message.rstrip("\n")
    return f"{head}{'' if settings.prefix else colour}{body}{RESET}{message[len(body):]}"


def _timestamp() -> str:
    """common/log.cpp's M.SS.mmm.uuu since the start."""
    us = int((time.time() - _T_START) * 1e6)
    return f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"


def allocation_failures() -> list[tuple[str, int]]:
    """The (buffer, bytes) that llama.cpp failed to allocate since the last call."""
    failed = list(_allocation_failures)
    _allocation_failures.clear()
    return failed


def ignored_overrides() -> list[tuple[str, str, str]]:
    """The (key, type it is read as, type given) of the --override-kv's llama.cpp dropped since the last call."""
    ignored = list(_ignored_overrides)
    _ignored_overrides.clear()
    return ignored


def grammar_refusals() -> list[str]:
    """Why llama.cpp's grammar sampler refused grammars since the last call (a missing root, left recursion)."""
    refused = list(_grammar_refusals)
    _grammar_refusals.clear()
    return refused


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
