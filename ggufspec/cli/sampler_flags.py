"""llama.cpp's sampler chain's order on run, chat and serve (--samplers, --sampling-seq): taken where it
applies ggufspec's samplers in ggufspec's order (llama.cpp's default does), a sampler that is off may be
left out, and adaptive-p (--adaptive-target) acts only where the chain lists adaptive_p, as in llama.cpp;
another order is refused in one line, as the answer would come from another distribution than the one
asked for. With --mirostat the chain is llama.cpp's temperature then Mirostat, whatever --samplers says
(there too)."""
from __future__ import annotations

import functools

import click

from ..errors import GgufspecError
from ..sampling import CHAIN, FILTERS_OFF, SAMPLER_LETTERS, SAMPLER_NAMES, SamplingParams
from .options import options

HAD = ("ggufspec's samplers are the penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC and "
       "temperature (dynamic too), then adaptive-p; or Mirostat")
# llama.cpp's default chain (common.h), by --samplers' names
DEFAULT_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
FIXED = CHAIN


def sampler_flags(command):
    """The chain's flags on `command` (hidden), checked before it runs. Put it below @friendly_errors, so
    that a refusal is its one line."""
    @functools.wraps(command)
    def checked(*args, **kwargs):
        check_sampler_flags(kwargs)
        return command(*args, **kwargs)
    return options(click.option("--samplers", "sampler_names", default=None, hidden=True),
                   click.option("--sampler-seq", "--sampling-seq", "sampler_letters", default=None, hidden=True))(checked)


def check_sampler_flags(opts: dict) -> None:
    """The chain's flags (consumed from `opts`): a chain in another order than ggufspec's raises
    GgufspecError; adaptive-p is turned off (adaptive_target -1 in `opts`) unless the chain lists it."""
    names, letters = opts.pop("sampler_names"), opts.pop("sampler_letters")
    chain = [SAMPLER_NAMES.get(n.strip().lower(), n.strip().lower()) for n in names.split(";") if n.strip()] \
        if names is not None else [SAMPLER_LETTERS.get(letter, letter) for letter in letters] \
        if letters is not None else list(DEFAULT_NAMES)
    if "adaptive_p" not in chain and "adaptive_target" in opts:
        opts["adaptive_target"] = -1.0  # llama.cpp's default chain has no adaptive-p
    if opts.get("mirostat") or (names is None and letters is None):
        return
    # llama.cpp's samplers ggufspec took on later may be left out of a chain where they are off
    optional = {kind for kind, (name, is_off) in FILTERS_OFF.items() if is_off(opts.get(name, getattr(SamplingParams, name)))}
    if not opts.get("dry_multiplier"):
        optional.add("dry")
    _check_chain("--samplers" if names is not None else "--sampling-seq", chain, optional)


def _check_chain(flag: str, chain: list[str], optional: set[str]) -> None:
    """A chain is taken where it applies ggufspec's samplers all, in ggufspec's order (llama.cpp's default
    is one); adaptive_p may stand anywhere (llama.cpp runs it last), infill is refused."""
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
