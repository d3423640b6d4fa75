"""What ggufspec prints to a terminal: tokens coloured by origin (`run --color`) and the chat REPL (`chat`)."""
from __future__ import annotations

import re
import signal
import sys
import threading

import click

from .errors import GgufspecError

ACCEPTED_COLOR = "\x1b[36m"  # accepted draft tokens, as llama.cpp's speculative example colours them
RESET_COLOR = "\x1b[0m"


def shown(piece, color: bool) -> str:
    """A piece's text as printed: accepted draft tokens coloured when asked."""
    return ACCEPTED_COLOR + piece.text + RESET_COLOR if color and piece.from_draft else piece.text


def chat_session(decoder, options: dict, system: str | None, color: bool, variables: dict | None = None) -> None:
    """The REPL; `variables`: the chat template's (--chat-template-kwargs)."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is no UTF-8 must not end the session (see below)
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        click.echo("ggufspec chat: /reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops an answer",
                   err=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("\n(/exit or Ctrl-D quits)", err=True)
            continue
        # bytes that are no UTF-8 (a piped file in another encoding) reach input() as lone surrogates,
        # which no tokenizer takes: shown as U+FFFD, as a terminal shows them
        line = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            history = list(start)
            click.echo("(conversation cleared)", err=True)
            continue
        if re.fullmatch(r"/[A-Za-z]+", line.rstrip()):  # a command that is not one: not sent to the model
            click.echo(f"unknown command {command}: /reset clears the conversation, /exit quits "
                       f"(start a message with a space to send it as text)", err=True)
            continue
        history.append({"role": "user", "content": line})
        try:
            text = chat_turn(decoder, history, options, color, variables or {})
        except GgufspecError as exc:  # the session goes on: the turn is dropped
            history.pop()
            hint = " (/reset starts a new conversation)" if "context" in str(exc) else ""
            click.echo(f"ggufspec: error: {exc}{hint}", err=True)
            continue
        history.append({"role": "assistant", "content": text})


def chat_turn(decoder, history: list[dict], options: dict, color: bool, variables: dict | None = None) -> str:
    """Stream one answer to stdout; Ctrl-C ends it at the next token (the caches stay consistent)."""
    stop = threading.Event()
    stream = decoder.stream(decoder.render_chat(history, **(variables or {})), **options)
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())  # never interrupt llama.cpp mid-call
    contexts = [ctx for ctx in (decoder.target, decoder.draft) if ctx is not None]
    for ctx in contexts:  # a long prompt (or the draft's catch-up) stops between its chunks too
        ctx.should_stop = stop.is_set
    texts = []
    try:
        for piece in stream:
            texts.append(piece.text)
            sys.stdout.write(shown(piece, color))
            sys.stdout.flush()
            if stop.is_set():
                break
    finally:
        stream.close()
        signal.signal(signal.SIGINT, previous)
        for ctx in contexts:
            ctx.should_stop = None
    click.echo()
    stats = decoder.last_stats
    click.echo(chat_stats_line(stats, stopped=stop.is_set()), err=True)
    return "".join(texts)


def chat_stats_line(stats, stopped: bool = False) -> str:
    drafted = f"accepted {stats.n_accept}/{stats.n_drafted} drafted" if stats.n_drafted else "no drafts"
    return (f"[{stats.n_predict} tokens, {stats.decode_tps:.1f} tok/s, {drafted}, prompt {stats.n_prompt} tokens "
            f"({stats.n_prompt_cached} cached){', stopped' if stopped else ''}]"
            + (" the context is full: /reset starts a new conversation (or raise -c)"
               if stats.stop_reason == "context" else ""))
