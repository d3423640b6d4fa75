"""llama.cpp's DRY ("don't repeat yourself") penalty, run by llama.cpp's own sampler through the bindings.

DRY looks for the longest stretch ending at the last token that also appears earlier in the window (the
last `dry_penalty_last_n` tokens, prompt included); each token that would extend such a repeat past
`dry_allowed_length` tokens loses multiplier * base^(length - allowed) from its logit, unless a sequence
breaker ("\\n", ":"...) lies inside the stretch. The sampler is llama.cpp's (llama_sampler_init_dry:
the breakers matched against every token's text, the Z-algorithm over the window), so the penalty is
exactly llama-server's.

Lossless as the penalties are: the penalty at a position is a function of the tokens before it, and
`Dry.apply` is given them (`history`) for each row; the sampler holds the last window of what it was
fed, and is caught up, or reset and fed the window again, until it holds the window of that history.
Only tokens in the window can be penalised, so only their logits go through the sampler.
"""
from __future__ import annotations

import ctypes
import weakref
from collections import Counter, deque
from typing import Sequence

import llama_cpp
import numpy as np

from .errors import GgufspecError

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's (common.h)
MAX_BREAKER_CHARS = 40  # llama.cpp cuts a longer breaker to this (and warns)
# llama_token_data as numpy lays it out: {int32 id; float logit; float p}
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
# one sampler per model and setting, whose breakers are matched already (83 ms over a 151k vocabulary):
# each generation gets a clone (0.5 ms). Keyed by the Llama, so a freed model takes its samplers along.
_PROTOTYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Dry:
    """One sequence's DRY sampler: `apply(logits, history)` penalises the row that follows `history`."""

    def __init__(self, sampler: int, window: int):
        self._sampler, self.window = sampler, window
        self._fed: deque[int] = deque(maxlen=window)  # the last `window` tokens fed since the last reset
        self._n_fed = 0  # how many were fed since the last reset
        self._counts: Counter[int] = Counter()  # of the tokens in `_fed`: the only ones DRY can penalise
        self._ids: np.ndarray | None = None     # their ids, kept until a token enters or leaves the set
        self._free = weakref.finalize(self, llama_cpp.llama_sampler_free, sampler)

    @classmethod
    def for_model(cls, llm, vocab, multiplier: float, base: float, allowed_length: int, window: int,
                  breakers: Sequence[str]) -> Dry:
        """A fresh sampler for a generation on `llm`'s model (a clone of the one kept for these settings)."""
        key = (multiplier, base, allowed_length, window, tuple(breakers))
        kept = _PROTOTYPES.setdefault(llm, {})
        if key not in kept:
            kept[key] = Dry(_new_sampler(vocab, *key), window)
        return kept[key].clone()

    def clone(self) -> Dry:
        """Another sampler in the same state (a draft's walk ahead of the target's sequence)."""
        copy = Dry(llama_cpp.llama_sampler_clone(self._sampler), self.window)
        copy._fed, copy._n_fed, copy._counts, copy._ids = deque(self._fed, self.window), self._n_fed, \
            Counter(self._counts), self._ids
        return copy

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> None:
        """DRY's penalties on `logits` (in place) for the position after `history`."""
        self._catch_up(history)
        if self._ids is None:
            self._ids = np.fromiter(self._counts, dtype=np.int32, count=len(self._counts))
        ids = self._ids[self._ids < len(logits)]  # a draft's row may be shorter than the target's vocabulary
        if len(ids) == 0:
            return
        data = np.zeros(len(ids), dtype=TOKEN_DATA)
        data["id"], data["logit"] = ids, logits[ids]
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(ids), selected=-1,
            sorted=False)
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        logits[data["id"]] = data["logit"]

    def _catch_up(self, history: Sequence[int]) -> None:
        """The sampler fed until it holds the last window of `history`: the tokens after those fed, where
        what it holds is where `history` has it; else (a rewound or other sequence) reset and the window."""
        start = self._n_fed - len(self._fed)  # where the tokens it holds sit in the sequence fed
        if not (len(history) >= self._n_fed and list(history[start:self._n_fed]) == list(self._fed)):
            llama_cpp.llama_sampler_reset(self._sampler)
            self._fed.clear()
            self._counts.clear()
            self._ids, self._n_fed = None, max(0, len(history) - self.window)
        for token in history[self._n_fed:]:
            self._feed(int(token))

    def _feed(self, token: int) -> None:
        llama_cpp.llama_sampler_accept(self._sampler, token)
        if len(self._fed) == self.window:  # the oldest leaves the window
            old = self._fed[0]
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
                self._ids = None
        if token not in self._counts:
            self._ids = None
        self._counts[token] += 1
        self._fed.append(token)
        self._n_fed += 1

    def close(self) -> None:
        self._free()


def _new_sampler(vocab, multiplier: float, base: float, allowed_length: int, window: int,
                 breakers: tuple[str, ...]) -> int:
    encoded = [breaker.encode()[:MAX_BREAKER_CHARS] for breaker in breakers]
    array = (ctypes.c_char_p * len(encoded))(*encoded)
    sampler = llama_cpp.llama_sampler_init_dry(vocab, multiplier, base, allowed_length, window, array, len(encoded))
    if not sampler:
        raise GgufspecError("llama.cpp could not make its DRY sampler")
    return sampler
