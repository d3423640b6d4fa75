"""llama.cpp's flags for what the target's logits go through (`ggufspec.processing.Constraints`):
logit bias, penalties, a grammar or a JSON schema. Shared by run, chat and serve (there: the defaults
of every request)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import click

from ..errors import GgufspecError
from ..processing import Constraints
from .app import not_utf8_file, utf8_text

_BIAS = re.compile(r"^(\d+)([+-].+)$")  # llama.cpp's TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 2-inf


def constraint_options():
    return [
        click.option("-l", "--logit-bias", "logit_bias", multiple=True, metavar="TOKEN_ID(+/-)BIAS",
                     help="Add BIAS to a token's logit, e.g. 15043+1 or 2-inf (repeatable)."),
        click.option("--repeat-penalty", default=Constraints.repeat_penalty,
                     help="Penalise repeated tokens (1: off)."),
        click.option("--repeat-last-n", default=Constraints.repeat_last_n,
                     help="Tokens the penalties look back over (0: off, -1: the whole sequence)."),
        click.option("--presence-penalty", default=Constraints.presence_penalty, help="Presence penalty (0: off)."),
        click.option("--frequency-penalty", default=Constraints.frequency_penalty, help="Frequency penalty (0: off)."),
        click.option("--dry-multiplier", type=float, default=Constraints.dry_multiplier,
                     help="DRY: multiplier * base^(length - allowed length) off a token's logit that would extend "
                          "a repeat (0: off)."),
        click.option("--dry-base", type=float, default=Constraints.dry_base, help="DRY: the base (>= 1)."),
        click.option("--dry-allowed-length", type=int, default=Constraints.dry_allowed_length,
                     help="DRY: repeats up to this long are not penalised."),
        click.option("--dry-penalty-last-n", type=int, default=Constraints.dry_penalty_last_n,
                     help="DRY: tokens it scans for repeats (0: off, -1: the whole context)."),
        click.option("--dry-sequence-breaker", "dry_sequence_breakers", multiple=True, metavar="TEXT",
                     help="DRY: a repeat across this text is none (repeatable; replaces the defaults \\n : \" *; "
                          "\"none\": no breakers)."),
        click.option("--ignore-eos", is_flag=True,
                     help="Never end at the model's end-of-generation tokens (a bias of -inf): -n tokens."),
        click.option("--grammar", default=None, help="A GBNF grammar the output must follow."),
        click.option("--grammar-file", default=None, type=click.Path(exists=True, dir_okay=False),
                     help="Read the GBNF grammar from a file."),
        click.option("-j", "--json-schema", "json_schema", default=None,
                     help="A JSON schema the output must follow (turned into a grammar; a constraint it "
                          "cannot enforce is an error)."),
        click.option("-jf", "--json-schema-file", "json_schema_file", default=None,
                     type=click.Path(exists=True, dir_okay=False), help="Read the JSON schema from a file."),
        click.option("--reasoning-budget", "reasoning_budget", type=int, default=-1, metavar="N",
                     help="Tokens a reasoning model may think (<think>...</think>) before </think> is forced: -1 "
                          "no limit; 0 no thinking (with a chat template, its enable_thinking false too)."),
        click.option("--reasoning-budget-message", "reasoning_budget_message", default="", metavar="TEXT", show_default=False,
                     help="Text put before the forced </think> when the budget runs out, e.g. \" Time to "
                          "answer.\"."),
    ]


def constraints_from(opts: dict) -> Constraints | None:
    """The Constraints the flags describe (consumed from `opts`); None when they ask for nothing."""
    grammar = _grammar(opts.pop("grammar"), opts.pop("grammar_file"), opts.pop("json_schema"),
                       opts.pop("json_schema_file"))
    constraints = Constraints(logit_bias=parse_logit_bias(opts.pop("logit_bias")),
                              repeat_penalty=opts.pop("repeat_penalty"), repeat_last_n=opts.pop("repeat_last_n"),
                              presence_penalty=opts.pop("presence_penalty"),
                              frequency_penalty=opts.pop("frequency_penalty"), grammar=grammar,
                              ignore_eos=opts.pop("ignore_eos"), **dry(opts), **reasoning_budget(opts))
    return constraints if constraints.active else None


def dry(opts: dict) -> dict:
    """The --dry-* flags as Constraints keywords (consumed from `opts`). --dry-sequence-breaker replaces
    llama.cpp's default breakers, "none" leaves none, as there."""
    breakers = tuple(opts.pop("dry_sequence_breakers"))
    if breakers == ("none",):
        breakers = ()
    elif not breakers:
        breakers = Constraints.dry_sequence_breakers
    elif "none" in breakers:
        raise GgufspecError('--dry-sequence-breaker none means no breakers: give it alone, or only texts')
    return {"dry_multiplier": opts.pop("dry_multiplier"), "dry_base": opts.pop("dry_base"),
            "dry_allowed_length": opts.pop("dry_allowed_length"), "dry_penalty_last_n": opts.pop("dry_penalty_last_n"),
            "dry_sequence_breakers": tuple(utf8_text("--dry-sequence-breaker", b) for b in breakers)}


def reasoning_budget(opts: dict) -> dict:
    """--reasoning-budget and --reasoning-budget-message as Constraints keywords (consumed from `opts`)."""
    budget, message = opts.pop("reasoning_budget"), opts.pop("reasoning_budget_message")
    if budget < -1:
        raise GgufspecError(f"--reasoning-budget must be >= -1 (-1: no limit, 0: no thinking), got {budget}")
    if message and budget < 0:
        raise GgufspecError("--reasoning-budget-message is put before the </think> a budget forces: give "
                            "--reasoning-budget N too")
    return {"reasoning_budget": budget, "reasoning_budget_message": utf8_text("--reasoning-budget-message", message)}


def parse_logit_bias(values) -> dict[int, float]:
    bias = {}
    for value in values:
        match = _BIAS.match(value.strip())
        try:
            bias[int(match.group(1))] = float(match.group(2))
        except (AttributeError, ValueError):
            raise GgufspecError(f"--logit-bias takes TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 2-inf, got {value!r}") from None
    return bias


def _grammar(grammar: str | None, grammar_file, json_schema: str | None, json_schema_file) -> str | None:
    given = [name for name, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                  ("--json-schema", json_schema), ("--json-schema-file", json_schema_file))
             if v is not None]
    if len(given) > 1:
        raise GgufspecError(f"choose one of {', '.join(given)}")
    if grammar_file is not None:
        return _file_text("--grammar-file", grammar_file)
    if json_schema_file is not None:  # llama.cpp's -jf
        return schema_grammar(_file_text("--json-schema-file", json_schema_file), "--json-schema-file")
    if json_schema is not None:
        return schema_grammar(utf8_text("--json-schema", json_schema), "--json-schema")
    return utf8_text("--grammar", grammar)


def _file_text(flag: str, path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8_file(flag, path, exc) from None


def schema_grammar(schema: str, where: str) -> str:
    """The GBNF for a JSON schema given as text (`tools.schema_grammar`), its errors naming `where`."""
    from ..tools import schema_grammar as grammar_for
    try:
        return grammar_for(json.loads(schema))
    except json.JSONDecodeError as exc:
        raise GgufspecError(f"{where} is not valid JSON: {exc}") from None
    except GgufspecError as exc:
        raise GgufspecError(f"{where}: {exc}") from None
