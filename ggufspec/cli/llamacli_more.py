"""More of llama.cpp's flags of llama-completion (`run`) and llama-cli (`chat`), registered by
`llamacli_flags`: each does here what it does there, is taken at the value that does nothing, or is
refused in one line that says why and what to do instead (click's own answer would be a bare "No such
option"), before anything loads.

- -bf FNAME: the prompt (chat: the first message) as the file's bytes, exactly (UTF-8 text);
- chat: -f FNAME (the first message from a file, its last newline dropped, as llama.cpp's read_file),
  -e/--no-escape (escapes processed in -p/-f/-bf's first message and -r's stop strings, as llama.cpp's -e);
- --reasoning-preserve/--no-reasoning-preserve: the chat template's preserve_reasoning variable (chat: on
  unless given, as llama-cli's default; run --chat: only where given, a one-message prompt has no earlier
  thinking to keep); --chat-template-kwargs' own preserve_reasoning gives way to the flag, as serve's;
- --skip-chat-parsing/--no-skip-chat-parsing: taken either way: run and chat print the answer as the
  model writes it, thinking inline (llama.cpp's pure content parser, --reasoning-format none);
- taken at their "does nothing" value: --keep 0, -np 1, --spec-draft-p-split 0.1, chat's -cram 0, the
  negative forms --no-mmproj, --no-mmproj-auto, --no-mmproj-offload and run's --no-escape.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import GgufspecError
from .app import not_utf8_file, utf8_text
from .unsupported_flags import NO_MEDIA, OWN_CHECKPOINTS, refusal_options, refuse_given, serve_reason

NO_CONTEXT_SHIFT = ("it keeps prompt tokens through a context shift, which ggufspec does not do (an answer ends when "
                    "the context is full, stop: context); raise -c for longer answers (--keep 0 is taken)")
NO_RAM_CACHE = ("chat keeps its one conversation in the KV cache (each turn evaluates only what is new) and no RAM "
                "cache of other prompts beside it; leave it out (-cram 0 is taken)")
SERVER_BASE = ("chat loads the models itself and talks to no server: for a running `ggufspec serve` open its chat "
               "page (URL/) or point an OpenAI client at URL/v1")
ONE_ANSWER = {
    "run": "run generates one answer: `ggufspec serve -np N` answers N requests at once, and in Python "
           "SpeculativeDecoder(..., n_parallel=N).generate_many(prompts) runs a list of prompts N at a time",
    "chat": "chat holds one conversation: `ggufspec serve -np N` answers N conversations at once",
}


BOTH, CHAT = ("run", "chat"), ("chat",)
MEDIA_VALUES = ("-mm/--mmproj", "-mmu/--mmproj-url", "--image-min-tokens", "--image-max-tokens", "--video-fps",
                "--video-timestamp-interval", "--video-ffmpeg-dir", "--image/--audio/--video")
# (flags as written, takes a value, the value that does nothing (None: none does), why not, commands)
REFUSED = [
    ("--keep", True, "0", NO_CONTEXT_SHIFT, BOTH),
    ("-np/--parallel", True, "1", None, BOTH),  # why: ONE_ANSWER, by command
    *[(flags, True, None, NO_MEDIA, BOTH) for flags in MEDIA_VALUES],
    ("--mmproj-auto", False, None, NO_MEDIA, BOTH),
    ("--mmproj-offload", False, None, NO_MEDIA, BOTH),
    ("-cl/--cache-list", False, None, serve_reason("-cl"), BOTH),
    ("--completion-bash", False, None, serve_reason("--completion-bash"), BOTH),
    ("--spec-draft-p-split/--draft-p-split", True, "0.1", serve_reason("--spec-draft-p-split"), BOTH),
    ("--spec-synth-len", True, None, serve_reason("--spec-synth-len"), CHAT),
    ("--spec-synth-rates", True, None, serve_reason("--spec-synth-rates"), CHAT),
    ("-ctxcp/--ctx-checkpoints/--swa-checkpoints", True, None, OWN_CHECKPOINTS, CHAT),
    ("-cram/--cache-ram", True, "0", NO_RAM_CACHE, CHAT),
    ("--server-base", True, None, SERVER_BASE, CHAT),
]
TAKEN_NEGATIVES = ("--no-mmproj", "--no-mmproj-auto", "--no-mmproj-offload")


def refusals(command: str) -> list:
    """REFUSED's rows for `command`, in unsupported_flags' shape (flags, takes a value, harmless, why)."""
    return [(tuple(flags.split("/")), takes_value, harmless, why or ONE_ANSWER[command])
            for flags, takes_value, harmless, why, commands in REFUSED if command in commands]


def more_options(command: str) -> list:
    """The options of `command` ("run" or "chat"), in --help's order; the refused and taken ones hidden."""
    shown = [
        click.option("-bf", "--binary-file", "binary_file", default=None, metavar="FNAME",
                     help="Read the " + ("prompt" if command == "run" else "first message") + " from a file, its "
                          "bytes exactly (UTF-8 text; -f drops or converts line endings)."),
        click.option("--reasoning-preserve/--no-reasoning-preserve", "reasoning_preserve", default=None,
                     help="The chat template's preserve_reasoning variable (and preserve_thinking, clear_thinking... "
                          "derived from it): earlier turns' thinking kept in the prompt, by templates that read it "
                          + ("[default: on, as llama-cli's]." if command == "chat" else "(with --chat).")),
        click.option("--skip-chat-parsing/--no-skip-chat-parsing", "skip_chat_parsing", default=None, hidden=True),
    ]
    if command == "chat":
        shown[:0] = [
            click.option("-f", "--file", "first_message_file", default=None, metavar="FNAME",
                         help="Read the first message from a file (its last newline dropped, as llama.cpp's -f)."),
            click.option("-e", "--escape/--no-escape", "escape", default=False,
                         help="Process escapes (\\n, \\t, \\xHH...) in the first message (-p, -f, -bf) and in -r."),
        ]
    else:
        shown.append(click.option("--no-escape", "no_escape", is_flag=True, hidden=True))
    return shown + refusal_options(refusals(command), TAKEN_NEGATIVES, multiple=("--image",))


def take_more(command: str, kwargs: dict) -> None:
    """These flags (consumed from `kwargs`): a refused one raises GgufspecError; -bf (and chat's -f) become
    the prompt (chat: the first message); --reasoning-preserve goes into the template's variables."""
    refuse_given(refusals(command), kwargs, f" on {command}")
    kwargs.pop("skip_chat_parsing")  # what run and chat do either way (the module's docstring)
    _preserve_reasoning(command, kwargs)
    if command == "run":
        if kwargs.pop("no_escape") and kwargs["escape"]:
            raise GgufspecError("-e/--escape processes escapes, --no-escape leaves them: give one of them")
        binary = kwargs.pop("binary_file")
        if binary is not None:
            if kwargs["prompt"] is not None or kwargs["prompt_file"] is not None:
                raise GgufspecError("give the prompt with one of -p, -f and -bf")
            kwargs["prompt"] = read_binary(binary)
        return
    given = [(name, kwargs.pop(key)) for name, key in (("-f", "first_message_file"), ("-bf", "binary_file"))]
    given = [(name, path) for name, path in given if path is not None]
    if len(given) + (kwargs["first_message"] is not None) > 1:
        raise GgufspecError("give the first message with one of -p, -f and -bf")
    for name, path in given:
        kwargs["first_message"] = read_text_file("-f/--file", path) if name == "-f" else read_binary(path)


def _preserve_reasoning(command: str, kwargs: dict) -> None:
    """--reasoning-preserve into --chat-template-kwargs' JSON (the flag over its preserve_reasoning, as
    serve's ChatSettings.template_defaults). Text that is no JSON object is left for template_variables
    to refuse in its own words."""
    preserve = kwargs.pop("reasoning_preserve")
    if command == "run":
        if preserve is None:
            return
        if not kwargs["chat"]:
            raise GgufspecError("--reasoning-preserve is the chat template's preserve_reasoning: give --chat too")
    text = utf8_text("--chat-template-kwargs", kwargs["template_kwargs"])
    try:
        given = json.loads(text) if text is not None else {}
    except ValueError:
        return
    if not isinstance(given, dict):
        return
    if preserve is None:  # chat: on, as llama-cli's default, unless --chat-template-kwargs says otherwise
        given = {"preserve_reasoning": True, **given}
    else:
        given = {**given, "preserve_reasoning": preserve}
    kwargs["template_kwargs"] = json.dumps(given)


def read_text_file(option: str, path: str) -> str:
    """A file's UTF-8 text, its last newline dropped (llama.cpp's read_file for -f and -sysf)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError as exc:
        raise not_utf8_file(option, path, exc) from None
    except OSError as exc:
        raise GgufspecError(f"{option}: {path}: {exc.strerror or exc}") from None
    return text[:-1] if text.endswith("\n") else text


def read_binary(path: str) -> str:
    """-bf's file: its bytes as they are (no line ending converted or dropped), which must be UTF-8 text:
    ggufspec tokenizes text. llama.cpp's line on stderr says how many were read."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise GgufspecError(f"-bf/--binary-file: {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8_file("-bf/--binary-file", path, exc) from None
    click.echo(f"Read {len(data)} bytes from binary file {path}", err=True)
    return text
