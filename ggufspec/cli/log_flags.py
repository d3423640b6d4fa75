"""llama.cpp's log flags (common/arg.cpp: --log-disable, --log-file, --log-colors, -v, -lv, --log-prefix,
--log-timestamps) on the commands that load models, set before anything loads: they govern llama.cpp's
log (`ggufspec.llamalog`), ggufspec's own lines on stderr (progress, statistics, warnings) and, on
`serve`, uvicorn's (`server.listen.uvicorn_logging`). --log-jsonl and --log-prompts-dir have no
counterpart here and are refused in one line."""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import click

from .. import llamalog
from .app import fail
from .options import options

VERBOSITY = "ggufspec.log_verbosity"  # ctx.meta's key: the threshold -v or -lv set last
ERROR_LINE = "ggufspec: error"  # what --log-disable still lets through: the one-line errors
COLOR_WORDS = {"on": True, "enabled": True, "true": True, "1": True,  # common_arg_utils::is_truthy ...
               "off": False, "disabled": False, "false": False, "0": False,  # ... is_falsey ...
               "auto": None, "-1": None}  # ... and is_autoy
PARAMS = ("log_disable", "log_file", "log_colors", "log_verbose", "log_verbosity", "log_prefix", "log_timestamps",
          "log_jsonl", "log_prompts_dir")


class ColorsChoice(click.ParamType):
    """on, off or auto, and the other words llama.cpp takes for them (true/false/1/0/enabled/disabled/-1);
    auto (None): colours when stderr is a terminal."""
    name = "on|off|auto"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, bool):
            return value
        if value not in COLOR_WORDS:
            self.fail(f"{value!r}: give on, off or auto", param, ctx)
        return COLOR_WORDS[value]


def _remember_verbosity(ctx: click.Context, param: click.Parameter, value):
    """-v and -lv set one threshold, as llama.cpp's: the last one given wins (click processes the
    options in the order of the command line)."""
    if value is not None and value is not False:
        ctx.meta[VERBOSITY] = llamalog.EVERYTHING if value is True else value
    return value


def log_options():
    """The options, in the order --help lists them; --log-jsonl and --log-prompts-dir hidden (refused)."""
    return [
        click.option("--log-disable", "log_disable", is_flag=True,
                     help="No log: neither llama.cpp's nor ggufspec's progress and statistics on stderr (nor "
                          "uvicorn's on serve); results on stdout and one-line errors still print."),
        click.option("--log-file", "log_file", default=None, metavar="FNAME",
                     help="Also write the log to FNAME (truncated first): llama.cpp's lines shown by -v/-lv, and "
                          "what ggufspec writes on stderr."),
        click.option("--log-colors", "log_colors", type=ColorsChoice(), default="auto", metavar="[on|off|auto]",
                     help="Colour llama.cpp's log lines by level on stderr (auto: when it is a terminal and "
                          "NO_COLOR is unset; the --log-file copy stays plain)."),
        click.option("-v", "--verbose", "--log-verbose", "log_verbose", is_flag=True, callback=_remember_verbosity,
                     help="Print llama.cpp's whole log (as GGUFSPEC_VERBOSE=1); on serve, uvicorn's debug log and "
                          "each request too."),
        click.option("-lv", "--verbosity", "--log-verbosity", "log_verbosity", type=int, default=None, metavar="N",
                     callback=_remember_verbosity,
                     help="Print llama.cpp's log messages of verbosity up to N: 0 output, 1 error, 2 warning, 3 "
                          "info, 4 trace (the library's info: the load log), 5 debug [default: none]. On serve, "
                          "uvicorn's log follows (3: info, 4: each request too, 5: debug)."),
        click.option("--log-prefix/--no-log-prefix", "log_prefix", default=False, show_default=False,
                     help="Start llama.cpp's log lines with their level letter (I, W, E, D)."),
        click.option("--log-timestamps/--no-log-timestamps", "log_timestamps", default=False, show_default=False,
                     help="Start llama.cpp's log lines with the time since the start (minutes.seconds.ms.us)."),
        click.option("--log-jsonl/--no-log-jsonl", "log_jsonl", default=False, hidden=True),
        click.option("--log-prompts-dir", "log_prompts_dir", default=None, hidden=True),
    ]


def log_flags(command):
    """The log options on `command`, which then runs under them. Put it above @friendly_errors, so that
    the one-line error of a failed command is written (and copied to --log-file) while they hold."""
    @functools.wraps(command)
    def logged(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in PARAMS}
        _refuse_unmapped(given)
        # `serve --rpc`'s model process: its stderr passes through its supervisor's, which copies and filters it
        behind_supervisor = kwargs.get("serve_fd") is not None
        with logging_as(given, behind_supervisor):
            return command(*args, **kwargs)
    return options(*log_options())(logged)


def _refuse_unmapped(given: dict) -> None:
    if given["log_jsonl"]:
        fail("--log-jsonl is not supported: llama.cpp writes its log as JSON lines on stdout, which ggufspec keeps "
             "for results; the log stays text on stderr (--log-file FNAME keeps a copy; --json gives run's, "
             "bench's and eval's results as JSON)")
    if given["log_prompts_dir"] is not None:
        fail("--log-prompts-dir is not supported: ggufspec writes no prompt files; a request's prompt is the "
             "client's to keep (run and chat print nothing but the answer; -v logs serve's requests)")


@contextlib.contextmanager
def logging_as(given: dict, behind_supervisor: bool = False):
    """llama.cpp's log set as `given`, and sys.stderr copied to --log-file or filtered by --log-disable;
    all restored after (a command run in-process, as tests do)."""
    log_file = None if behind_supervisor else _open_log_file(given["log_file"])
    stderr = sys.stderr
    to_stderr = llamalog.FdWriter(stderr)
    previous = llamalog.configure(llamalog.LogSettings(
        threshold=click.get_current_context().meta.get(VERBOSITY, llamalog.LogSettings.threshold),
        disabled=given["log_disable"], prefix=given["log_prefix"], timestamps=given["log_timestamps"],
        colors=_colours(given["log_colors"], stderr), stderr=to_stderr, file=log_file))
    copy = None
    if not behind_supervisor and (given["log_disable"] or log_file is not None):
        sys.stderr = copy = StderrLog(stderr, log_file, given["log_disable"])
    try:
        yield
    finally:
        sys.stderr = stderr
        llamalog.configure(previous)
        to_stderr.close()
        if log_file is not None:
            _close_log_file(log_file, given["log_file"], copy and copy.failed)


def _close_log_file(log_file, path: str, failed: OSError | None) -> None:
    """Close --log-file; a write to it that failed (a full disk) is one line and exit code 1 once the
    command is done, unless it failed anyway (its own error said)."""
    try:
        log_file.close()
    except OSError as exc:
        failed = failed or exc
    if failed is not None and sys.exc_info()[0] is None:
        fail(f"--log-file {path}: could not write the log: {failed.strerror or failed}", 1)


def _open_log_file(path: str | None):
    if path is None:
        return None
    try:  # line-buffered: a server stopped by its deadline (os._exit) leaves the file whole
        return open(path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115  (closed by logging_as)
    except OSError as exc:
        fail(f"--log-file {path}: {exc.strerror or exc}")


def _colours(setting: bool | None, stderr) -> bool:
    """--log-colors; auto as llama.cpp's tty_can_use_colors, for stderr alone (the colours go nowhere else)."""
    if setting is not None:
        return setting
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return bool(getattr(stderr, "isatty", lambda: False)())


class StderrLog:
    """sys.stderr while --log-file or --log-disable holds: what ggufspec, uvicorn and (under `serve --rpc`)
    the model process write there, copied to the file; with --log-disable, dropped but the error lines."""

    def __init__(self, stream, log_file, disabled: bool):
        self.stream, self.log_file, self.disabled = stream, log_file, disabled
        self.failed: OSError | None = None  # a write to the log file that failed: said at the end (logging_as)

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # a binary write fails, as on a text stream (click probes with b"")
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self.disabled and not text.lstrip("\n").startswith(ERROR_LINE):
            return len(text)
        self.stream.write(text)
        self._to_log_file(lambda file: file.write(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self._to_log_file(lambda file: file.flush())

    def _to_log_file(self, act) -> None:
        """Not raised here: the one-line error that would say it is written through this very copy."""
        if self.log_file is not None and self.failed is None:
            try:
                act(self.log_file)
            except OSError as exc:
                self.failed = exc

    def __getattr__(self, name):
        if name == "buffer":  # bytes written there would pass by the copy and the filter
            raise AttributeError(name)
        return getattr(self.stream, name)
