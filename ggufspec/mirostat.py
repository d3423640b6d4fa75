"""llama.cpp's Mirostat sampling (--mirostat 1 or 2), which steers each token's surprise towards tau.

llama.cpp's chain with Mirostat is temperature, then Mirostat (common/sampling.cpp: the penalties, DRY
and the other filters are left out, `samplers` too). Mirostat keeps a state, mu (2 tau at first), that
decides how much of the tempered distribution is kept at a position, and moves after each token by its
surprise: mu -= eta (-log2 p(token) - tau), p the distribution it was drawn from.
- v2 keeps the likeliest tokens while their surprise -log2 p is at most mu (one at least);
- v1 estimates the distribution's Zipf exponent s from its m = 100 likeliest tokens and keeps the top k,
  k = (e 2^mu / (1 - n^-e))^(1/s), e = s - 1, n the vocabulary's size.

Lossless as any state the sequence carries: the target's judge moves mu by each token it decides, and
every token decided is kept (a verification stops at the first that differs from the draft, and keeps
it), so each position's distribution is the one the target alone would have drawn from there.
"""
from __future__ import annotations

import math

import numpy as np

ZIPF_TOKENS = 100  # llama.cpp's m for v1 (common/sampling.cpp)


class Mirostat:
    """One generation's Mirostat: `distribution(row)` at the next position, then `observe` its token."""

    def __init__(self, version: int, tau: float, eta: float, temperature: float, n_vocab: int):
        self.version, self.tau, self.eta = version, tau, eta
        self.temperature, self.n_vocab = temperature, n_vocab
        self.mu = 2.0 * tau

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The probabilities Mirostat draws from after these (processed) logits: tempered, cut, renormalised.
        No sort of the whole vocabulary (30 ms over 151k tokens): v2's cut is every token whose surprise is
        at most mu, v1's the top k, and only v1's estimate reads the m likeliest in order."""
        scaled = logits.astype(np.float64) / self.temperature
        weights = np.exp(scaled - scaled.max())
        probs = weights / weights.sum()
        kept = self._v2_kept(probs) if self.version == 2 else self._v1_kept(probs)
        result = np.zeros(len(logits))
        result[kept] = weights[kept] / weights[kept].sum()
        return result

    def observe(self, probs: np.ndarray, token: int) -> None:
        """mu moved by the token's surprise under the distribution it was drawn from."""
        self.mu -= self.eta * (-math.log2(probs[token]) - self.tau)

    def _v2_kept(self, probs: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            kept = np.flatnonzero(-np.log2(probs) <= self.mu)
        return kept if len(kept) else np.array([int(np.argmax(probs))])

    def _v1_kept(self, probs: np.ndarray) -> np.ndarray:
        k = self._v1_k(probs[_best(probs, min(ZIPF_TOKENS, len(probs)))])
        return np.arange(len(probs)) if k >= len(probs) else _best(probs, k)

    def _v1_k(self, best: np.ndarray) -> int:
        """v1's k from the m likeliest probabilities, best first."""
        n = len(best) - 1
        if n < 1:
            return 1
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a banned token's p is 0
            t = np.log(np.arange(2, n + 2) / np.arange(1, n + 1))
            b = np.log(best[:n] / best[1:n + 1])
            s_hat = np.sum(t * b) / np.sum(t * t)
            epsilon = s_hat - 1
            k = float(np.power(epsilon * np.exp2(self.mu) / (1 - np.power(float(self.n_vocab), -epsilon)), 1 / s_hat))
        return 1 if math.isnan(k) or k < 1 else int(min(k, self.n_vocab))


def _best(probs: np.ndarray, n: int) -> np.ndarray:
    """The ids of the n likeliest tokens, likeliest first (ties: the lower id first)."""
    ids = np.argpartition(-probs, n - 1)[:n] if n < len(probs) else np.arange(len(probs))
    return ids[np.lexsort((ids, -probs[ids]))]


