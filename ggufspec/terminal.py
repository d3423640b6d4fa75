"""What ggufspec prints to a terminal: tokens coloured by origin (`run --color`), the pieces and prompt
tokens as llama.cpp's tools print them (-sp, --verbose-prompt), and the chat REPL (`chat`)."""
from __future__ import annotations

import codecs
import dataclasses
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TextIO

import click

from .errors import GgufspecError
from .generation import Piece
from .native import token_piece
from .stops import StopFilter

ACCEPTED_COLOR = "\x1b[36m"  # accepted draft tokens, as llama.cpp's speculative example colours them
RESET_COLOR = "\x1b[0m"
COMMAND = re.compile(r"/[A-Za-z]+")  # a line that is a chat command (or meant to be one)


def shown(piece, color: bool) -> str:
    """A piece's text as printed: accepted draft tokens coloured when asked."""
    return ACCEPTED_COLOR + piece.text + RESET_COLOR if color and piece.from_draft else piece.text


def generated_pieces(decoder, prompt, options: dict, special: bool = False):
    """decoder.stream(prompt, **options); with `special` (llama.cpp's -sp) control tokens print as their
    text (<|im_start|>...) where the stream prints nothing for them. The tokens are the same either way."""
    if not special:
        return decoder.stream(prompt, **options)
    return _special_pieces(decoder.target.vocab, decoder.steps(prompt, **options))


def _special_pieces(vocab, steps):
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across tokens: once
    try:
        for step in steps:
            yield Piece(utf8.decode(token_piece(vocab, step.token, special=True)), *step)
    finally:
        steps.close()  # stopped early (a stop string, Ctrl-C): the step generator's statistics say so


def tokens_text(vocab, tokens, special: bool) -> str:
    """The tokens as llama.cpp's tools print them, piece after piece (control tokens only with `special`)."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return "".join(utf8.decode(token_piece(vocab, token, special)) for token in tokens) + utf8.decode(b"", final=True)


def prompt_token_lines(vocab, tokens) -> list[str]:
    """--verbose-prompt's lines, as llama.cpp's: the count, then each token id and its text."""
    return [f"number of tokens in prompt = {len(tokens)}"] + [
        f"{token:6d} -> '{token_piece(vocab, token, True).decode('utf-8', 'replace')}'" for token in tokens]


@dataclass
class ChatFlags:
    """llama-cli's flags that `chat` takes (`cli.llamacli_flags`); the defaults are chat's own behaviour."""
    stops: tuple[str, ...] = ()          # -r: the answer ends before the first of them (not shown, not kept)
    special: bool = False                # -sp: control tokens shown as their text
    single_turn: bool = False            # -st: one answer, then exit
    show_timings: bool = True            # --no-show-timings: no statistics line
    multiline: bool = False              # -mli: a message goes on until a line ending in \ or /
    simple_io: bool = False              # --simple-io: plain input(), no readline line editing
    verbose_prompt: bool = False         # each turn's prompt tokens on stderr
    first_message: str | None = None     # -p: sent before anything is read
    output: TextIO | None = None         # -o: the conversation, as llama-cli writes it


def chat_session(decoder, options: dict, system: str | None, color: bool, variables: dict | None = None,
                 flags: ChatFlags | None = None) -> None:
    """The REPL; `variables`: the chat template's (--chat-template-kwargs)."""
    flags = flags or ChatFlags()
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is no UTF-8 must not end the session (see below)
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        if not flags.simple_io:
            import readline  # noqa: F401  (line editing and history for input())
        click.echo("ggufspec chat: /reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops an answer",
                   err=True)
    queued = [flags.first_message] if flags.first_message is not None else []
    while True:
        try:
            if queued:
                line = queued.pop()
                if interactive:  # shown where a typed message would be, as llama-cli echoes its -p
                    click.echo(f"> {line}")
            else:
                line = read_message(interactive, flags.multiline)
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
        if COMMAND.fullmatch(line.rstrip()):  # a command that is not one: not sent to the model
            click.echo(f"unknown command {command}: /reset clears the conversation, /exit quits "
                       f"(start a message with a space to send it as text)", err=True)
            continue
        history.append({"role": "user", "content": line})
        _write_output(flags.output, f"User:\n{line}\n\n")
        try:
            text = chat_turn(decoder, history, options, color, variables or {}, flags)
        except GgufspecError as exc:  # the session goes on: the turn is dropped
            if flags.single_turn:  # -st's one answer failed: the command fails (one line, its exit code)
                raise
            history.pop()
            hint = " (/reset starts a new conversation)" if "context" in str(exc) else ""
            click.echo(f"ggufspec: error: {exc}{hint}", err=True)
            continue
        history.append({"role": "assistant", "content": text})
        _write_output(flags.output, "Assistant:\n" + text + ("" if text.endswith("\n") else "\n") + "\n")
        if flags.single_turn:
            break


def read_message(interactive: bool, multiline: bool) -> str:
    """One message: a line; with -mli (llama.cpp's multiline input) the lines up to one that ends in \\ or /
    (that character dropped), or to the end of the input. A command typed first acts at once. EOFError:
    the input ended with nothing read."""
    lines: list[str] = []
    while True:
        try:
            line = input(("> " if not lines else "") if interactive else "")
        except EOFError:
            if lines:
                return "\n".join(lines)
            raise
        if not multiline or (not lines and COMMAND.fullmatch(line.strip())):
            return line
        if line.endswith(("\\", "/")):
            return "\n".join(lines + [line[:-1]])
        lines.append(line)


def _write_output(file: TextIO | None, text: str) -> None:
    if file is not None:
        file.write(text)
        file.flush()  # the conversation so far is on disk whatever ends the session


def chat_turn(decoder, history: list[dict], options: dict, color: bool, variables: dict | None = None,
              flags: ChatFlags | None = None) -> str:
    """Stream one answer to stdout; Ctrl-C ends it at the next token (the caches stay consistent). A stop
    string (-r) ends it too: the text before it is the answer (held back while it may be starting)."""
    flags = flags or ChatFlags()
    prompt = decoder.render_chat(history, **(variables or {}))
    if flags.verbose_prompt:
        click.echo("\n".join(prompt_token_lines(decoder.target.vocab, decoder.tokenize(prompt))), err=True)
    stop = threading.Event()
    stream = generated_pieces(decoder, prompt, options, flags.special)
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())  # never interrupt llama.cpp mid-call
    contexts = [ctx for ctx in (decoder.target, decoder.draft) if ctx is not None]
    for ctx in contexts:  # a long prompt (or the draft's catch-up) stops between its chunks too
        ctx.should_stop = stop.is_set
    stops, texts = StopFilter(flags.stops), []

    def write(released: list[dict]) -> None:
        for item in released:
            texts.append(item["text"])
            sys.stdout.write(shown(dataclasses.replace(item["piece"], text=item["text"]), color))
        sys.stdout.flush()
    try:
        for piece in stream:
            write(stops.push({"text": piece.text, "piece": piece}))
            if stops.stopped or stop.is_set():
                break
        if not stops.stopped:  # text held back as the possible start of a stop string that never came
            write(stops.flush())
    finally:
        stream.close()
        signal.signal(signal.SIGINT, previous)
        for ctx in contexts:
            ctx.should_stop = None
    click.echo()
    stats = decoder.last_stats
    if stops.stopped:
        stats.stop_reason = "stop"
    if flags.show_timings:
        click.echo(chat_stats_line(stats, stopped=stop.is_set()), err=True)
    return "".join(texts)


def chat_stats_line(stats, stopped: bool = False) -> str:
    drafted = f"accepted {stats.n_accept}/{stats.n_drafted} drafted" if stats.n_drafted else "no drafts"
    return (f"[{stats.n_predict} tokens, {stats.decode_tps:.1f} tok/s, {drafted}, prompt {stats.n_prompt} tokens "
            f"({stats.n_prompt_cached} cached){', stopped' if stopped else ''}]"
            + (" the context is full: /reset starts a new conversation (or raise -c)"
               if stats.stop_reason == "context" else ""))
