"""A generation's arguments checked before anything runs: one line naming what is wrong, and nothing
computed (`SpeculativeDecoder.steps`, the server's jobs, and `generate_many` for every prompt at once)."""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
from typing import Sequence

from .errors import ContextFullError, GgufspecError


def check_generation_args(n_prompt: int, n_ctx: int, n_draft: int, n_predict: int) -> None:
    for name, value in (("n_draft", n_draft), ("n_predict", n_predict)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise GgufspecError(f"{name} must be a whole number" + (" or 'auto'" if name == "n_draft" else "")
                                + f", got {value!r}")
    if n_draft < 0:
        raise GgufspecError(f"--draft must be >= 0 (0: the target alone) or 'auto', got {n_draft}")
    if n_predict < -1:  # 0: the prompt alone, into the cache (llama-server's n_predict 0)
        raise GgufspecError(f"-n/--n-predict must be >= 0 (0: the prompt only; -1: no limit), got {n_predict}")
    if n_prompt == 0:
        raise GgufspecError("the prompt is empty")
    if n_prompt >= n_ctx:
        raise ContextFullError(f"the prompt is {n_prompt} tokens but the context holds {n_ctx}: "
                               f"raise -c/--ctx-size or shorten the prompt")


def check_token_ids(tokens: Sequence[int], n_vocab: int) -> None:
    """A prompt given as token ids holds only the target's ids (llama_decode would fail on others)."""
    bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < n_vocab),
               None)
    if bad is not None:
        raise GgufspecError(f"token ids must be whole numbers in [0, {n_vocab}), got {bad!r}")


def check_whole_numbers(**values) -> None:
    """A decoder's counts (n_ctx, n_threads...) whole numbers where given: a text or a float failed inside
    llama-cpp-python with a TypeError of its own."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise GgufspecError(f"{name} must be a whole number, got {value!r}")


def check_options(options: dict, fields_of, *calls) -> None:
    """Keyword options of a generation (beyond `calls`' own parameters) that `fields_of` (SamplingParams)
    takes: a typo named the dataclass's __init__ in a TypeError. The message suggests from all of them."""
    fields = [field.name for field in dataclasses.fields(fields_of)]
    for name in options:
        if name not in fields:
            parameters = {name for call in calls for name in inspect.signature(call).parameters}
            if name in parameters:  # another layer's (`stop` is stream()'s, not steps()'s)
                owner = next(call.__name__ for call in calls if name in inspect.signature(call).parameters)
                raise GgufspecError(f"{calls[0].__name__}() does not take {name!r}: {owner}() does")
            known = sorted(set(fields) | parameters - {"self", "filters", "prompt", "options"})
            close = difflib.get_close_matches(name, [k for k in known if k != name], n=1, cutoff=0.75)
            raise GgufspecError(f"unknown generation option {name!r}" + (f": did you mean {close[0]!r}?" if close else
                                                                          f" (options: {', '.join(known)})"))
