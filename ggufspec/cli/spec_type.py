"""llama.cpp's `--spec-type` (common/speculative.cpp: the kinds of speculative decoding, a comma-separated
list) mapped onto ggufspec's drafters, so that a pasted llama-server or llama-cli command line drafts the
way it asked: `none` the target alone, `draft-simple` a draft model (-md), `draft-mtp` the target's MTP
heads, any `ngram-*` ggufspec's n-gram lookup (one drafter for all of llama.cpp's n-gram kinds: the
prompt's and the output's n-grams, and the pool across requests), a draft model or MTP together with
n-grams `--hybrid` (a lookup match when there is one, else the model). The kinds ggufspec has no
drafter for, and the n-gram drafters' own sizes, are refused in one line."""
from __future__ import annotations

import click

from ..errors import GgufspecError

MODEL_KINDS = {"draft-simple": None, "draft-mtp": "mtp"}  # -> -md (None: the draft model given or found)
NGRAM_KINDS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
NOT_HAD = ("draft-eagle3", "draft-dflash", "draft-dspark")
# the n-gram drafters' tuning flags: ggufspec's lookup sizes its n-grams itself
NGRAM_SIZES = ("--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-match",
               "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m", "--spec-ngram-simple-min-hits",
               "--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m", "--spec-ngram-map-k-min-hits",
               "--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m", "--spec-ngram-map-k4v-min-hits",
               "--spec-ngram-size-n", "--spec-ngram-size-m", "--spec-ngram-min-hits")


def _param(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def spec_type_options() -> list:
    return [
        click.option("--spec-type", "spec_type", default=None, metavar="TYPE[,...]",
                     help="llama.cpp's kinds of speculative decoding: none (the target alone), draft-simple (a draft "
                          "model), draft-mtp (the target's MTP heads), ngram-simple/-mod/-map-k/-map-k4v/-cache (n-gram "
                          "lookup, as --lookup); a model kind with an n-gram one: --hybrid."),
        *(click.option(flag, _param(flag), default=None, hidden=True) for flag in NGRAM_SIZES),
    ]


def apply_spec_type(opts: dict) -> None:
    """--spec-type (consumed from `opts`) as ggufspec's own options: no_draft, model_draft, lookup, hybrid."""
    for flag in NGRAM_SIZES:
        if opts.pop(_param(flag)) is not None:
            raise GgufspecError(f"{flag} is not supported: ggufspec's n-gram lookup (--spec-type ngram-*, --lookup) "
                                f"sizes its n-grams itself; leave it out")
    value = opts.pop("spec_type")
    if value is None:
        return
    kinds = [kind.strip() for kind in value.split(",") if kind.strip()]
    for kind in kinds:
        if kind in NOT_HAD:
            raise GgufspecError(f"--spec-type {kind} is not supported: ggufspec drafts with a draft model "
                                f"(draft-simple), MTP heads (draft-mtp) or n-gram lookup (ngram-*)")
        if kind != "none" and kind not in MODEL_KINDS and kind not in NGRAM_KINDS:
            raise GgufspecError(f"--spec-type: unknown kind {kind!r} (none, draft-simple, draft-mtp, "
                                f"{', '.join(NGRAM_KINDS)})")
    if not kinds or "none" in kinds:
        if len(kinds) > 1:
            raise GgufspecError(f"--spec-type {value}: none drafts nothing; give it alone")
        opts["no_draft"] = True
        return
    models = [kind for kind in kinds if kind in MODEL_KINDS]
    if len(set(models)) > 1:
        raise GgufspecError(f"--spec-type {value}: one model drafts here, a draft model or MTP heads, not both")
    if models and MODEL_KINDS[models[0]] is not None:
        _set_draft_model(opts, MODEL_KINDS[models[0]], models[0])
    if any(kind in NGRAM_KINDS for kind in kinds):
        opts["hybrid" if models else "lookup"] = True


def _set_draft_model(opts: dict, draft: str, kind: str) -> None:
    given = opts.get("model_draft")
    if given not in (None, draft):
        raise GgufspecError(f"--spec-type {kind} and -md {given}: the {kind} drafts with -md {draft}; give one of them")
    opts["model_draft"] = draft
