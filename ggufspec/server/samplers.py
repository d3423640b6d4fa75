"""llama.cpp's sampler chain as a request sets it: `samplers` (the chain's order, llama-server's names
or letters), and adaptive-p (adaptive_target), which acts only where that chain lists adaptive_p.

ggufspec's chain is fixed: logit_bias, penalties, DRY and the grammar over the logits, then top_n_sigma, top_k,
typical, top_p and min_p on the untempered distribution, XTC, then temperature over what is left (`sampling.distribution`,
`processing`). A request's chain is done as llama.cpp does it where it maps onto that: a sampler
ggufspec has that the list leaves out is not applied (its setting made neutral; temperature left out
samples the untempered distribution, as llama.cpp's final `dist` does), an order that gives the same
distribution as ggufspec's passes, and what would give another one is a 400 saying what to do instead."""
from __future__ import annotations

import dataclasses

from ..processing import Constraints
from ..sampling import CHAIN, FILTERS_OFF, SAMPLER_LETTERS, SAMPLER_NAMES, SamplingParams, is_greedy
from .errors import APIError

HAD = CHAIN  # ggufspec's samplers, in the order it applies them
# a sampler's setting that changes nothing, by the sampler's name (`SETTING`: its option's, where another)
NEUTRAL = {"top_n_sigma": -1.0, "top_k": 0, "typ_p": 1.0, "top_p": 1.0, "min_p": 0.0, "xtc": 0.0, "temperature": 1.0}
SETTING = {kind: name for kind, (name, _) in FILTERS_OFF.items()}
NEUTRAL_PENALTIES = {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
PENALTY_FIELDS = ("repeat_penalty", "frequency_penalty", "presence_penalty", "repeat_last_n")


def sampler_kinds(samplers: str | list[str]) -> list[str]:
    """The chain a request names, as canonical names: a string of letters ("edkypmxt", the llama.cpp
    web UI's) or a list of names in any of their spellings (llama.cpp skips one it does not know;
    here it is a 400, as a typo would otherwise leave a sampler out unseen)."""
    if isinstance(samplers, str):
        unknown = [letter for letter in samplers if letter not in SAMPLER_LETTERS]
        if unknown:
            raise APIError(400, f"samplers: unknown sampler letter {unknown[0]!r} (llama.cpp's: "
                                f"{''.join(SAMPLER_LETTERS)})", code="invalid_value", param="samplers")
        return [SAMPLER_LETTERS[letter] for letter in samplers]
    unknown = [name for name in samplers if name.lower() not in SAMPLER_NAMES]
    if unknown:
        raise APIError(400, f"samplers: unknown sampler {unknown[0]!r} (llama.cpp's: "
                            f"{', '.join(SAMPLER_LETTERS.values())})", code="invalid_value", param="samplers")
    return [SAMPLER_NAMES[name.lower()] for name in samplers]


def sampler_chain(body, options: dict, shape, default_constraints: Constraints | None = None,
                  default_adapts: bool = False):
    """The decoder's options and the request's Shaping with the request's chain applied (`samplers`,
    `adaptive_target`); `default_constraints`: the server's (its penalties); `default_adapts`: whether
    the server's own chain (serve --samplers) lists adaptive_p."""
    if options.get("mirostat"):  # llama.cpp's chain is temperature, then Mirostat: `samplers` is not read
        return options, shape
    kinds = sampler_kinds(body.samplers) if body.samplers is not None else list(HAD)
    if not ("adaptive_p" in kinds if body.samplers is not None else default_adapts):
        options = {**options, "adaptive_target": -1.0}  # adaptive-p acts only where the chain lists it
    options = {**options, **{SETTING.get(name, name): value for name, value in NEUTRAL.items() if name not in kinds}}
    if "temperature" not in kinds:  # the dynamic temperature is the temperature sampler's (temp_ext)
        options["dynatemp_range"] = 0.0
    if "penalties" not in kinds:  # the server's penalties off too: theirs is the same sampler
        shape = dataclasses.replace(shape, constraints={**shape.constraints, **NEUTRAL_PENALTIES})
    if "dry" not in kinds:  # and the server's DRY
        shape = dataclasses.replace(shape, constraints={**shape.constraints, "dry_multiplier": 0.0})
    settings = {name: options.get(SETTING.get(name, name), getattr(SamplingParams, SETTING.get(name, name)))
                for name in (*NEUTRAL, "dynatemp_range")}
    active = [kind for kind in kinds if kind in HAD and is_active(kind, settings, shape, default_constraints)]
    greedy = is_greedy(settings["temperature"], settings["dynatemp_range"])
    check_order(active, greedy, dynamic=settings["dynatemp_range"] > 0)
    check_no_infill(kinds)
    return options, shape


def is_active(kind: str, settings: dict, shape, default_constraints: Constraints | None) -> bool:
    """Whether a sampler ggufspec has changes the distribution with these settings (temperature 1 does
    not; 0 and below, greedy, does)."""
    if kind in ("penalties", "dry"):
        base = default_constraints or Constraints()
        fields = PENALTY_FIELDS if kind == "penalties" else ("dry_multiplier", "dry_penalty_last_n")
        given = Constraints(**{name: shape.constraints.get(name, getattr(base, name)) for name in fields})
        return given.penalises if kind == "penalties" else given.drys
    if kind == "temperature" and settings["dynatemp_range"] > 0:
        return True
    is_off = FILTERS_OFF[kind][1] if kind in FILTERS_OFF else lambda value: value == NEUTRAL[kind]
    return not is_off(settings[kind])


def commute(first: str, then: str, greedy: bool, dynamic: bool = False) -> bool:
    """Whether two of ggufspec's samplers give the same distribution in either order. The penalties and
    DRY change the logits all the others read (and each other's); greedy picks the best token, which every filter keeps, in
    any order. Else top_k and min_p both cut at a logit below the best one's, whatever was cut before,
    and temperature keeps the ranking (top_k's), unless it is dynamic (its entropy is over the tokens
    left); top_p renormalises over what is left, so it differs after top_k and before min_p, and it and
    min_p read the tempered probabilities after temperature."""
    pair = {first, then}
    if pair & {"penalties", "dry"}:
        return False
    return greedy or pair == {"top_k", "min_p"} or (pair == {"top_k", "temperature"} and not dynamic)


def check_order(active: list[str], greedy: bool, dynamic: bool = False) -> None:
    """A 400 where the active samplers' order (or one listed twice) gives another distribution than
    ggufspec's fixed order does."""
    for i, first in enumerate(active):
        for then in active[i + 1:]:
            if first == then and first not in ("penalties", "dry") and (first in ("top_k", "min_p") or greedy):
                continue  # the same cut again, or any filter twice before a greedy choice: nothing changes
            if first == then:
                raise APIError(400, f"samplers lists {first} twice, which applies it twice: ggufspec applies each "
                                    "once, so list it once", code="unsupported_parameter", param="samplers")
            if HAD.index(first) > HAD.index(then) and not commute(first, then, greedy, dynamic):
                raise APIError(400, f"samplers puts {first} before {then}, which gives another distribution than "
                                    f"ggufspec's fixed order ({', '.join(HAD)}): put {then} first, or leave one "
                                    "of them out", code="unsupported_parameter", param="samplers")


def check_no_infill(kinds: list[str]) -> None:
    """llama.cpp's infill sampler, which has no off, is refused where the list has it."""
    if "infill" in kinds:
        raise APIError(400, "samplers: infill is not supported (llama.cpp's infill sampler, always on where "
                            "listed): leave it out", code="unsupported_parameter", param="samplers")


