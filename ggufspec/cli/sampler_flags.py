"""llama.cpp's sampler flags that ggufspec has no sampler for (common/arg.cpp: --adaptive-*)
and its chain's order (--samplers, --sampling-seq), on run, chat and serve. Their "off" values are what
ggufspec does and are taken (a pasted command line often spells them out); a value that would turn one
on is refused in one line, as the answer would come from another distribution than the one asked for. A
setting that acts only inside a sampler (--adaptive-decay) is taken: with its sampler off it changes
nothing, in llama.cpp too. With --mirostat the chain is llama.cpp's temperature then Mirostat, whatever
--samplers says (there too)."""
from __future__ import annotations

import functools

import click

from ..errors import GgufspecError
from ..sampling import CHAIN, FILTERS_OFF, SAMPLER_LETTERS, SAMPLER_NAMES, SamplingParams
from .options import options

HAD = ("ggufspec's samplers are the penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC and "
       "temperature (dynamic too), or Mirostat")
# (flags, the param, whether a value leaves the sampler off, what it is)
SWITCHES = [
    (("--adaptive-target",), "adaptive_target", lambda v: v < 0, "adaptive-p"),
]
INNER = [("--adaptive-decay",)]
# llama.cpp's default chain (common.h), by --samplers' names
DEFAULT_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
FIXED = CHAIN


def _param(flags: tuple[str, ...]) -> str:
    return "sampler_" + max(flags, key=len).lstrip("-").replace("-", "_")


def sampler_flags(command):
    """The flags on `command` (hidden: refused or taken), checked before it runs. Put it below
    @friendly_errors, so that a refusal is its one line."""
    @functools.wraps(command)
    def checked(*args, **kwargs):
        check_sampler_flags(kwargs)
        return command(*args, **kwargs)
    made = [click.option(*flags, _param(flags), type=float, default=None, hidden=True) for flags, *_ in SWITCHES]
    made += [click.option(*flags, _param(flags), default=None, hidden=True) for flags in INNER]
    made += [click.option("--samplers", "sampler_names", default=None, hidden=True),
             click.option("--sampler-seq", "--sampling-seq", "sampler_letters", default=None, hidden=True)]
    return options(*made)(checked)


def check_sampler_flags(opts: dict) -> None:
    """The flags (consumed from `opts`): one that would turn on a sampler ggufspec lacks, or a chain in
    another order than its own, raises GgufspecError."""
    for flags, _, is_off, what in SWITCHES:
        value = opts.pop(_param(flags))
        if value is not None and not is_off(value):
            raise GgufspecError(f"{flags[0]} {value:g} is not supported: ggufspec has no {what} ({HAD}); leave it "
                                f"out or give its off value")
    for flags in INNER:
        opts.pop(_param(flags))  # a setting of a sampler that is off: nothing to do, here as there
    names, letters = opts.pop("sampler_names"), opts.pop("sampler_letters")
    if opts.get("mirostat"):
        return
    # llama.cpp's samplers ggufspec took on later may be left out of a chain where they are off
    optional = {kind for kind, (name, is_off) in FILTERS_OFF.items() if is_off(opts.get(name, getattr(SamplingParams, name)))}
    if not opts.get("dry_multiplier"):
        optional.add("dry")
    if names is not None:
        _check_chain("--samplers", [SAMPLER_NAMES.get(n.strip().lower(), n.strip().lower()) for n in names.split(";")
                                    if n.strip()], optional)
    if letters is not None:
        _check_chain("--sampling-seq", [SAMPLER_LETTERS.get(letter, letter) for letter in letters], optional)


def _check_chain(flag: str, chain: list[str], optional: set[str]) -> None:
    """A chain is taken where it applies ggufspec's samplers all, in ggufspec's order (llama.cpp's default
    is one); the others it lists are off unless their own flags turned them on (refused above)."""
    unknown = [kind for kind in chain if kind not in DEFAULT_NAMES and kind not in ("infill", "adaptive_p")]
    if unknown:
        raise GgufspecError(f"{flag}: unknown sampler {unknown[0]!r} (llama.cpp's: {';'.join(DEFAULT_NAMES)})")
    if "infill" in chain:
        raise GgufspecError(f"{flag}: the infill sampler is not supported ({HAD}); leave it out")
    ours = [kind for kind in chain if kind in FIXED]
    if ours != [kind for kind in FIXED if kind in ours or kind not in optional]:
        raise GgufspecError(f"{flag} {'; '.join(chain)}: ggufspec applies {', '.join(FIXED)}, all and in that order "
                            f"(top-k 0, top-p 1, min-p 0, --typical 1, --top-nsigma -1, --xtc-probability 0, --dry-multiplier 0 "
                            f"or --temp 1 turn one off); leave {flag} out "
                            f"(serve: a request's `samplers` is followed as far as it maps)")
