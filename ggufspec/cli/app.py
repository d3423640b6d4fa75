"""The `ggufspec` command group, its --version, and how errors become one line and an exit code."""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys

import click

from .. import __version__
from ..errors import GgufspecError


def fail(message: str, exit_code: int = 2):
    click.echo(f"ggufspec: error: {message}", err=True)
    sys.exit(exit_code)


def friendly_errors(command):
    """Turn GgufspecError into a one-line message and its exit code; a file system refusal (a folder
    that cannot be written, a file where a folder should be) into one line naming the path; and output
    that cannot be written (stdout on a full disk, or /dev/full) into one line too, exit code 1."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GgufspecError as exc:
            fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:  # Ctrl-C before a command's own handling (loading the models...)
            click.echo("ggufspec: interrupted", err=True)
            sys.exit(130)  # the shell's code for it
        except OSError as exc:
            if exc.filename is not None:
                fail(os_error_line(exc), 1)
            if exc.errno in FULL:  # a write to stdout (or a file already open): no path to name
                _drop_unwritten_output()
                fail(f"could not write the output: {exc.strerror}", 1)
            raise  # a broken pipe (click exits quietly), a socket's or a device's: the traceback says more
    return wrapper


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # what writing (and only writing) fails with


def _drop_unwritten_output() -> None:
    """Point stdout at /dev/null: what its buffer still holds would fail again, as a traceback, when
    Python flushes it at exit (click does the like for a broken pipe)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's stream): nothing flushes it later
        pass


def utf8_text(option: str, text: str | None) -> str | None:
    """`text` as given, refused in one line when it is no UTF-8: argv bytes that are not UTF-8 reach
    Python as lone surrogates (surrogateescape), which would fail later, as a traceback, at tokenizing."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GgufspecError(f"{option} is not UTF-8 text ({_bad_byte(text[exc.start])}); give it in UTF-8 (iconv "
                            f"-f latin1 -t utf-8 converts Latin-1)") from None
    return text


def not_utf8_file(option: str, name: str, exc: UnicodeDecodeError) -> GgufspecError:
    """The one-line error for a file that is no UTF-8 text."""
    return GgufspecError(f"{option}: {name} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save it as "
                         f"UTF-8 (iconv -f latin1 -t utf-8 FILE converts Latin-1)")


def _bad_byte(char: str) -> str:
    try:
        return f"byte 0x{char.encode('utf-8', 'surrogateescape').hex()}"
    except UnicodeEncodeError:  # a lone surrogate that no byte stands for
        return f"character U+{ord(char):04X}"


def os_error_line(exc: OSError) -> str:
    from ..home import home
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    line = f"{paths}: {exc.strerror or exc}"
    if str(exc.filename).startswith(str(home())):
        line += f" (ggufspec keeps its files in {home()}: set GGUFSPEC_HOME to a folder that can be written)"
    return line


class OneLineUsageError(click.UsageError):
    """A usage error (an unknown option, a missing file) in the one line every other error takes."""

    def show(self, file=None) -> None:
        command = self.ctx.command_path if self.ctx else "ggufspec"
        click.echo(f"ggufspec: error: {self.format_message().rstrip('.')} (see '{command} --help')", err=True)


class OneLineErrorsGroup(click.Group):
    """Click writes a usage error as four lines (usage, a hint, a blank, the error): written as one
    here, as ggufspec's own errors are, with the same exit code 2. Help asked for by running a group
    with no command (NoArgsIsHelpError) is still shown whole. The commands that stand for llama.cpp's
    tools take --version, as those tools do (`VERSIONED`)."""

    def add_command(self, cmd, name=None):
        if (name or cmd.name) in VERSIONED and not any(p.name == "version" for p in cmd.params):
            cmd.params.append(version_option())
        super().add_command(cmd, name)

    def make_context(self, *args, **kwargs):
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line_usage_errors():
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.UsageError as exc:
        if isinstance(exc, OneLineUsageError):
            raise
        raise OneLineUsageError(exc.format_message(), exc.ctx) from exc


# llama-completion, llama-cli, llama-server and llama-bench print their version on --version and exit
VERSIONED = ("run", "chat", "serve", "bench")


def version_option() -> click.Option:
    """--version: ggufspec's, llama-cpp-python's and its backends', then exit 0 (before anything else is read)."""
    return click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                        help="Show the version and the backends of the installed llama-cpp-python build, and exit.",
                        callback=lambda ctx, _, value: _print_version(ctx, value))


@click.group(cls=OneLineErrorsGroup, context_settings={"help_option_names": ["-h", "--help"]},
             params=[version_option()])
def main():
    """Lossless speculative decoding for GGUF models."""
    # A shell starts background jobs with SIGINT ignored, and the ignore is inherited: put Python's
    # handler back so that Ctrl-C and `kill -INT` always stop a run (KeyboardInterrupt, handled per command).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _usable_standard_streams()


def _usable_standard_streams() -> None:
    """A closed stdout is one line, a closed stdin reads as empty, and text the terminal's encoding
    cannot show (LC_ALL=C with PYTHONUTF8=0) is replaced there, not a UnicodeEncodeError mid-answer."""
    if sys.stdout is None:
        fail("standard output is closed (>&-): ggufspec writes its results there; redirect it to a file or "
             "/dev/null instead")
    if sys.stdin is None:
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115  (for the process's life)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure") and (stream.encoding or "").lower() not in ("utf-8", "utf8"):
            stream.reconfigure(errors="replace")


def _print_version(ctx, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    import llama_cpp
    from ..backends import build_backends
    click.echo(f"ggufspec {__version__} (llama-cpp-python {llama_cpp.__version__}, "
               f"backends: {', '.join(build_backends())})")
    ctx.exit()
