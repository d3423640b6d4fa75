"""llama.cpp's flags of llama-completion (`run`) and llama-cli (`chat`) that users paste onto them
(common/arg.cpp; what they do: tools/completion/completion.cpp, tools/cli/cli-context.cpp). Each does
here what it does there, is taken where it asks for what ggufspec does anyway, or is refused in one
line that says what to do instead. None is taken and ignored.

- -sysf FNAME: the system message from a file (its last newline dropped, as llama.cpp's read_file);
- -r PROMPT: on run, generation stops once the text holds it, the token that completes it printed (as
  llama-completion, which prints a token before it checks; a reverse prompt that is one token, a special
  one included, stops at that token); on chat, a stop string as llama-server's (the answer ends before
  it). Either way the tokens before it are those generated without it: speculation stays lossless;
- -sp: control tokens printed as their text; --verbose-prompt: the prompt's tokens on stderr;
- run: --display-prompt (the prompt before the answer; run's default stays the answer alone), -ptc N;
- chat: -p (the first message), -st, -mli, --show-timings/--no-show-timings, -o FNAME, --simple-io.
More of them (-bf, chat's -f and -e, --reasoning-preserve, the media, cache and parallel flags...): llamacli_more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import click

from ..errors import GgufspecError
from ..stops import first_stop
from ..terminal import ChatFlags, generated_pieces, prompt_token_lines, tokens_text
from .app import utf8_text
from .llamacli_more import more_options, read_text_file, take_more
from .options import options, process_escapes

INTERACTIVE = "run generates one answer and exits: `ggufspec chat` is the interactive mode (llama-cli's)"
NO_PROMPT_CACHE = ("run keeps no prompt state between runs: `ggufspec chat` keeps its conversation in the KV cache "
                   "(each turn evaluates only what is new), `ggufspec serve` reuses a cached prefix across requests "
                   "(--slot-save-path saves it to disk)")
AFFIXES = ("they wrap interactive input, and run takes one prompt: write them into -p/-f; `ggufspec chat` formats each "
           "message with the chat template")

# (param, the value given that is refused, flag as written, why): hidden options; any other value is taken
REFUSED_EVERYWHERE = [
    ("jinja", False, "--no-jinja", "ggufspec renders every chat template with Jinja (the model's own, or "
     "--chat-template/--chat-template-file); leave it out"),
    ("context_shift", True, "--context-shift", "ggufspec ends an answer when the context is full (stop: context), "
     "as llama.cpp without it; raise -c for longer ones"),
    ("warmup", True, "--warmup", "ggufspec does no warmup run before generating (its statistics include the first "
     "decode); leave it out (--no-warmup is what it does)"),
]
REFUSED_ON = {
    "run": [
        ("interactive", True, "-i/--interactive", INTERACTIVE),
        ("interactive_first", True, "-if/--interactive-first", INTERACTIVE),
        ("multiline_input", True, "-mli/--multiline-input", "multiline input is interactive: `ggufspec chat -mli`"),
        ("in_prefix_bos", True, "--in-prefix-bos", AFFIXES),
        ("prompt_cache_all", True, "--prompt-cache-all", NO_PROMPT_CACHE),
        ("prompt_cache_ro", True, "--prompt-cache-ro", NO_PROMPT_CACHE),
    ],
    "chat": [
        ("display_prompt", True, "--display-prompt", "chat prints the answers alone; --verbose-prompt lists each "
         "turn's prompt tokens on stderr"),
    ],
}
# (param, flag, why): hidden options that take a value, refused whatever it is
REFUSED_VALUES = [
    ("in_prefix", "--in-prefix", AFFIXES),
    ("in_suffix", "--in-suffix", AFFIXES),
    ("prompt_cache", "--prompt-cache", NO_PROMPT_CACHE),
]


def _hidden_switch(decls: str, name: str):
    """A hidden --flag/--no-flag whose value is None when neither is given."""
    return click.option(decls, name, default=None, hidden=True)


def _hidden_flag(*decls: str):
    return click.option(*decls, is_flag=True, default=False, hidden=True)


def _shared_options(command: str) -> list:
    return [
        click.option("-sysf", "--system-prompt-file", "system_file", default=None, metavar="FNAME",
                     help="Read the system message from a file (its last newline dropped)"
                          + (", for --chat." if command == "run" else ".")),
        click.option("-r", "--reverse-prompt", "reverse_prompts", multiple=True, metavar="PROMPT",
                     help=("Stop once the output holds PROMPT, printed (repeatable; with -e, escapes processed)."
                           if command == "run" else
                           "End an answer where PROMPT appears, before it (repeatable): a stop string.")),
        click.option("-sp", "--special", "special", is_flag=True,
                     help="Print control tokens as their text (<|im_start|>...) instead of nothing."),
        click.option("--verbose-prompt", "verbose_prompt", is_flag=True,
                     help="Print the prompt's tokens (id and text) on stderr" + (" before each answer."
                                                                               if command == "chat" else ".")),
        click.option("--simple-io", "simple_io", is_flag=True, hidden=command == "run",
                     help="Read messages with plain input(), without line editing (for pipes and limited consoles)."),
        _hidden_switch("--jinja/--no-jinja", "jinja"),
        click.option("--reasoning-format", "reasoning_format", default=None, hidden=True,
                     type=click.Choice(["auto", "deepseek", "deepseek-legacy", "none"])),
        _hidden_switch("--warmup/--no-warmup", "warmup"),
        _hidden_switch("--context-shift/--no-context-shift", "context_shift"),
    ]


def _run_options() -> list:
    return [
        click.option("--display-prompt/--no-display-prompt", "display_prompt", default=False,
                     help="Print the prompt (its tokens' text) before the answer, as llama-completion does by "
                          "default; run prints the answer alone."),
        click.option("-ptc", "--print-token-count", "print_token_count", type=int, default=-1, metavar="N",
                     help="Print the tokens so far (prompt and output) against -c on stderr every N tokens "
                          "(-1: never)."),
        click.option("-cnv/-no-cnv", "--conversation/--no-conversation", "conversation", default=None,
                     hidden=True),
        _hidden_flag("-st", "--single-turn"),
        _hidden_flag("-i", "--interactive"),
        _hidden_flag("-if", "--interactive-first"),
        _hidden_flag("-mli", "--multiline-input"),
        click.option("--in-prefix", "in_prefix", default=None, hidden=True),
        click.option("--in-suffix", "in_suffix", default=None, hidden=True),
        _hidden_flag("--in-prefix-bos"),
        click.option("--prompt-cache", "prompt_cache", default=None, hidden=True),
        _hidden_flag("--prompt-cache-all"),
        _hidden_flag("--prompt-cache-ro"),
        click.option("-gan", "--grp-attn-n", "grp_attn_n", type=int, default=None, hidden=True),
        click.option("-gaw", "--grp-attn-w", "grp_attn_w", type=int, default=None, hidden=True),
    ]


def _chat_options() -> list:
    return [
        click.option("-p", "--prompt", "first_message", default=None, metavar="TEXT",
                     help="The first message, answered before anything is read (llama-cli's -p)."),
        click.option("-st", "--single-turn", "single_turn", is_flag=True,
                     help="Answer one message (-p's, else the first one read), then exit."),
        click.option("-mli", "--multiline-input", "multiline_input", is_flag=True,
                     help="A message goes on over lines until one ends in \\ or / (that character dropped)."),
        click.option("--show-timings/--no-show-timings", "show_timings", default=True,
                     help="The statistics line on stderr after each answer."),
        click.option("-o", "--output", "--output-file", "output_file", default=None, metavar="FNAME",
                     help="Write the conversation to FNAME (User: and Assistant: blocks, as llama-cli)."),
        _hidden_switch("--display-prompt/--no-display-prompt", "display_prompt"),
    ]


def llamacli_flags(command: str):
    """llama.cpp's flags for `run` ("run") or `chat` ("chat"): the options, and the command called with them
    read into `llamacli` (a RunFlags or a ChatFlags; -sysf into `system`). Put it right above the command's
    function, under @friendly_errors: a refusal is a GgufspecError, one line."""
    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            _refuse(command, kwargs)
            take_more(command, kwargs)
            kwargs["system"] = system_message(kwargs["system"], kwargs.pop("system_file"),
                                              kwargs.get("chat", True))
            if command == "run":
                kwargs["llamacli"] = _run_flags(kwargs)
                return function(*args, **kwargs)
            with OutputFile(kwargs.pop("output_file")) as output:
                kwargs["llamacli"] = _chat_flags(kwargs, output)
                return function(*args, **kwargs)
        more = _run_options() if command == "run" else _chat_options()
        return options(*_shared_options(command), *more, *more_options(command))(wrapper)
    return decorate


def _refuse(command: str, kwargs: dict) -> None:
    """The refused flags and values (consumed from `kwargs`), and those taken for what ggufspec does anyway."""
    for name, refused, flag, why in REFUSED_EVERYWHERE + REFUSED_ON[command]:
        if kwargs.pop(name) is refused:
            raise GgufspecError(f"{flag} is not supported on {command}: {why}")
    form = kwargs.pop("reasoning_format")
    if form not in (None, "none"):
        raise GgufspecError(f"--reasoning-format {form} is not supported on {command}: it prints a reasoning "
                            f"model's thinking inline, as generated (--reasoning-format none); -rea off turns "
                            f"thinking off, and `ggufspec serve --reasoning-format {form}` puts it in "
                            f"reasoning_content")
    if command == "run":
        _refuse_on_run(kwargs)


def _refuse_on_run(kwargs: dict) -> None:
    """llama-completion's flags for what run is not (interactive, conversation mode, prompt files, self-extend)."""
    for name, flag, why in REFUSED_VALUES:
        if kwargs.pop(name) is not None:
            raise GgufspecError(f"{flag} is not supported on run: {why}")
    groups = kwargs.pop("grp_attn_n")
    kwargs.pop("grp_attn_w")  # the group's width: it does nothing unless -gan groups (llama.cpp's too)
    if groups not in (None, 1):
        raise GgufspecError(f"-gan/--grp-attn-n {groups} is not supported: group attention (self-extend) is not "
                            f"in ggufspec; stay within the model's trained context, or use a model trained for "
                            f"a longer one")
    if kwargs.pop("single_turn") and not kwargs["chat"]:
        raise GgufspecError("-st/--single-turn is conversation mode's single answer: give --chat for one answer "
                            "through the chat template (or use `ggufspec chat -st`)")
    conversation = kwargs.pop("conversation")  # -no-cnv: the prompt as it is, which run without --chat does
    if conversation:
        raise GgufspecError("-cnv/--conversation is not supported on run: run generates one answer; `ggufspec chat` "
                            "is the conversation mode, and run --chat gives one answer through the chat template")
    if conversation is False and kwargs["chat"]:
        raise GgufspecError("-no-cnv/--no-conversation gives the prompt as it is, --chat through the chat "
                            "template: give one of them")


def system_message(system: str | None, path: str | None, chat: bool) -> str | None:
    """-sys's text, or -sysf's file (UTF-8, its last newline dropped as llama.cpp's read_file drops it)."""
    if path is None:
        return system
    if system is not None:
        raise GgufspecError("give the system message with -sys or -sysf, not both")
    if not chat:
        raise GgufspecError("-sysf/--system-prompt-file is the chat template's system message: give --chat too")
    return read_text_file("-sysf/--system-prompt-file", path)


def reverse_prompts(texts: tuple[str, ...], escape: bool = False) -> tuple[str, ...]:
    """-r's texts: UTF-8, not empty (an empty one would stop before the first token); -e processes their
    escapes, as llama.cpp's -e does."""
    for text in texts:
        utf8_text("-r/--reverse-prompt", text)
        if not text:
            raise GgufspecError("-r/--reverse-prompt takes a text to stop at, got an empty one")
    return tuple(process_escapes(t) for t in texts) if escape else tuple(texts)


class OutputFile:
    """-o's file, opened before the models load (a path that cannot be written fails first), closed after."""

    def __init__(self, path: str | None):
        self.path, self.file = path, None

    def __enter__(self):
        if self.path is not None:
            try:
                self.file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115  (closed in __exit__)
            except OSError as exc:
                raise GgufspecError(f"-o/--output {self.path}: {exc.strerror or exc}") from None
        return self.file

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()


def _chat_flags(kwargs: dict, output) -> ChatFlags:
    escape = kwargs.pop("escape")  # -e: as llama.cpp's, the first message's escapes and -r's
    first = utf8_text("-p/--prompt", kwargs.pop("first_message"))
    return ChatFlags(stops=reverse_prompts(kwargs.pop("reverse_prompts"), escape), special=kwargs.pop("special"),
                     single_turn=kwargs.pop("single_turn"), show_timings=kwargs.pop("show_timings"),
                     multiline=kwargs.pop("multiline_input"), simple_io=kwargs.pop("simple_io"),
                     verbose_prompt=kwargs.pop("verbose_prompt"),
                     first_message=process_escapes(first) if escape and first is not None else first, output=output)


def _run_flags(kwargs: dict) -> RunFlags:
    if kwargs["display_prompt"] and kwargs["as_json"]:
        raise GgufspecError("--display-prompt prints the prompt before the answer, --json one JSON object: give "
                            "one of them")
    kwargs.pop("simple_io")  # run reads no input and writes plain text: what --simple-io asks
    return RunFlags(stops=reverse_prompts(kwargs.pop("reverse_prompts"), kwargs["escape"]),
                    special=kwargs.pop("special"), display_prompt=kwargs.pop("display_prompt"),
                    verbose_prompt=kwargs.pop("verbose_prompt"), print_token_count=kwargs.pop("print_token_count"))


@dataclass
class RunFlags:
    """llama-completion's flags that `run` takes; the defaults are run's own behaviour."""
    stops: tuple[str, ...] = ()
    special: bool = False
    display_prompt: bool = False
    verbose_prompt: bool = False
    print_token_count: int = -1

    def stream(self, decoder, text: str, **options):
        """decoder.stream(text, **options) as these flags want it: the prompt shown first where asked, the
        pieces with control tokens where asked, ended at a reverse prompt, counted on stderr."""
        if self.display_prompt or self.verbose_prompt:
            self._show_prompt(decoder, text, options.get("chat", False), options.get("system"))
        pieces = generated_pieces(decoder, text, options, self.special)
        if self.stops or self.print_token_count > 0:
            return self._watched(decoder, pieces)
        return pieces

    def _show_prompt(self, decoder, text: str, chat: bool, system: str | None) -> None:
        tokens = decoder.tokenize(text, chat=chat, system=system)
        if self.verbose_prompt:  # llama-completion's LOG_INF lines: the prompt as given, then its tokens
            click.echo("\n".join([f"prompt: '{text}'", *prompt_token_lines(decoder.target.vocab, tokens), ""]),
                       err=True)
        if self.display_prompt:
            click.echo(tokens_text(decoder.target.vocab, tokens, self.special), nl=False)

    def _watched(self, decoder, pieces):
        """The pieces up to the one that completes a reverse prompt (llama-completion prints a token, then
        checks the output's end), with -ptc's count. Stopping only ends the stream: the tokens before are
        those the generation without -r gives."""
        stop_tokens = self._single_token_stops(decoder)
        longest = max((len(s) for s in self.stops), default=0)
        text, n_generated = "", 0
        try:
            for piece in pieces:
                searched_from = max(0, len(text) - longest + 1)  # a stop ending in this piece starts here or later
                text += piece.text
                n_generated += 1
                yield piece
                self._count(decoder, n_generated)
                if piece.token in stop_tokens or first_stop(text, self.stops, searched_from) is not None:
                    decoder.last_stats.stop_reason = "stop"
                    return
        finally:
            pieces.close()

    def _single_token_stops(self, decoder) -> set[int]:
        """The reverse prompts that are one token (llama.cpp's check by token: a control token prints
        nothing without -sp, so the text alone would never hold it)."""
        ids = [decoder.target_llm.tokenize(s.encode("utf-8"), add_bos=False, special=True) for s in self.stops]
        return {tokens[0] for tokens in ids if len(tokens) == 1}

    def _count(self, decoder, n_generated: int) -> None:
        n_past = decoder.last_stats.n_prompt + n_generated
        if self.print_token_count > 0 and n_past % self.print_token_count == 0:
            click.echo(f"\nTokens consumed so far = {n_past} / {decoder.n_ctx}", err=True)
