"""Turning logits into choices: greedy, the filtered sampling distribution, and the acceptance rule.

The filters run in llama.cpp's default chain order: top-k, top-p, min-p (on the untempered
distribution), then temperature over the survivors. Target and draft go through the same filters, so
p and q in the acceptance rule are the distributions each model would actually sample from.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import GgufspecError

GREEDY_TEMPERATURES = (0.0, -1.0)  # llama.cpp's convention: 0 (and -1) mean greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 and self.temperature not in GREEDY_TEMPERATURES:
            raise GgufspecError(f"--temp must be >= 0 (0 or -1 mean greedy), got {self.temperature}")
        if self.top_k < 0:
            raise GgufspecError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GgufspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise GgufspecError(f"--min-p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def greedy_token(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probability vector the sampler draws from (zeros for filtered-out tokens)."""
    logits = logits.astype(np.float64)
    n_vocab = logits.shape[0]
    if 0 < params.top_k < n_vocab:
        candidates = np.argpartition(-logits, params.top_k - 1)[:params.top_k]
    else:
        candidates = np.arange(n_vocab)
    order = np.argsort(-logits[candidates], kind="stable")
    candidates = candidates[order]
    kept = logits[candidates]
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    n_keep = len(candidates)
    if params.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (at least one token)
        n_keep = min(n_keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        n_keep = min(n_keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
    candidates, kept = candidates[:n_keep], kept[:n_keep]
    tempered = np.exp((kept - kept[0]) / params.temperature)
    result = np.zeros(n_vocab)
    result[candidates] = tempered / tempered.sum()
    return result


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    # inverse-CDF draw; searchsorted on the cumulative sum is exact for a dense vector
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(probs) - 1))


def accept_or_resample(token: int, p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> int | None:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for one drafted token.

    The draft proposed `token` ~ q. Keep it with probability min(1, p[token] / q[token]); otherwise
    return a replacement drawn from normalize(max(0, p - q)). Either way the token that comes out is
    distributed exactly as p. Returns None when the draft token is accepted.

    The vocabularies may differ in size: p is over the target's ids, q over the draft's. A token the
    target does not have has p = 0 (always rejected); q is 0 where the draft has no token; the
    residual is over the target's whole vocabulary.
    """
    p_token = p[token] if token < len(p) else 0.0
    if rng.random() * q[token] < p_token:  # u < p/q without dividing by a tiny q
        return None
    residual = np.maximum(p - _resized(q, len(p)), 0.0)
    if residual.sum() <= 0.0:  # p == q: the rejection above cannot happen, but stay total
        residual = p
    return sample(residual, rng)


def _resized(q: np.ndarray, n: int) -> np.ndarray:
    """q over the first n ids: cut, or padded with zeros for ids the draft does not have."""
    return q[:n] if len(q) >= n else np.concatenate([q, np.zeros(n - len(q))])
