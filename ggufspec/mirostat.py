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

from .sampling import tempered_row, top_k_ids

ZIPF_TOKENS = 100  # llama.cpp's m for v1 (common/sampling.cpp)


class Mirostat:
    """One generation's Mirostat: `cut(row)` at the next position, then `observe` the token drawn from it."""

    def __init__(self, version: int, tau: float, eta: float, temperature: float, n_vocab: int):
        self.version, self.tau, self.eta = version, tau, eta
        self.temperature, self.n_vocab = temperature, n_vocab
        self.mu = 2.0 * tau

    def cut(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens Mirostat keeps after these (processed) logits and their probabilities, tempered, cut
        and renormalised. Neither a sort nor a float64 vector over the whole vocabulary (30 ms and 2.5 ms
        over 151k tokens): v2's cut compares the float32 row with its softmax's normaliser, v1's reads only
        the m likeliest tokens (its estimate needs their ratios alone) and keeps the top k."""
        kept = self._v2_kept(logits) if self.version == 2 else self._v1_kept(logits)
        scaled = logits[kept].astype(np.float64) / self.temperature
        weights = np.exp(scaled - scaled.max())
        return kept, weights / weights.sum()

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """`cut` as a vector over the vocabulary (0 for the tokens cut)."""
        kept, probs = self.cut(logits)
        result = np.zeros(len(logits))
        result[kept] = probs
        return result

    def observe(self, token: int, p: float) -> None:
        """mu moved by the token's surprise under the distribution it was drawn from (p: its probability)."""
        self.mu -= self.eta * (-math.log2(p) - self.tau)

    def _v2_kept(self, logits: np.ndarray) -> np.ndarray:
        """Every token whose surprise -log2 p is at most mu (the likeliest at least): log p = s - log(sum
        exp s) >= -mu ln 2, with s = (l - max) / T. In the log domain, as a mu far from 0 (a large eta, a
        negative tau) would take 2^-mu past a float's range."""
        scaled = tempered_row(logits, self.temperature)
        log_total = math.log(float(np.exp(scaled).sum()))  # a pairwise sum: to 1e-7
        threshold = min(max(log_total - self.mu * math.log(2), -1e30), 1e30)
        kept = np.flatnonzero(scaled >= threshold)
        return kept if len(kept) else np.array([int(np.argmax(logits))])

    def _v1_kept(self, logits: np.ndarray) -> np.ndarray:
        best = top_k_ids(logits, min(ZIPF_TOKENS, len(logits)))
        with np.errstate(invalid="ignore"):  # a banned token's logit is -inf: its weight is 0
            weights = np.exp((logits[best].astype(np.float64) - float(logits[best[0]])) / self.temperature)
        k = self._v1_k(weights)
        return np.arange(len(logits)) if k >= len(logits) else top_k_ids(logits, k)

    def _v1_k(self, best: np.ndarray) -> int:
        """v1's k from the m likeliest tokens' weights, best first (their ratios are the probabilities')."""
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
