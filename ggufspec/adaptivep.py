"""llama.cpp's adaptive-p sampler (`adaptive_p` in --samplers, --adaptive-target, --adaptive-decay), which
favours tokens whose probability is near a target, the target moved so that the average probability of
the tokens drawn approaches it.

After the chain (`sampling.chain`), each token left gets the logit 5 - 10 d^2 / (1 + d), d = |p -
t| / 0.3, with p its probability and t the adapted target, and the draw is from their softmax. t = 2
target - (an exponential moving average, decay `adaptive_decay`, of the chain's probabilities of the
tokens drawn), clamped to [0, 1]; the average starts at the target.

Lossless as Mirostat is: the state moves by each token the target's judge decides, and every token
decided is kept. XTC's cut is random in llama.cpp, and adaptive-p's average would read the
probability from the cut the draw came from, which the mixture drawn from here does not say: the two
together are refused (`SamplingParams`).
"""
from __future__ import annotations

import numpy as np

from .sampling import SamplingParams, chain

WIDTH, PEAK, SHARPNESS = 0.3, 5.0, 10.0  # llama.cpp's DISTRIBUTION_WIDTH, PEAK_LOGIT_VALUE, SHARPNESS


class AdaptiveP:
    """One generation's adaptive-p over `params`' chain: `cut(row)`, then `observe` the token drawn from it."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.target, self.decay = min(max(params.adaptive_target, 0.0), 1.0), params.adaptive_decay
        self.weighted_sum = params.adaptive_target / (1 - self.decay)
        self.total_weight = 1 / (1 - self.decay)
        self._chain = (np.zeros(0, dtype=np.intp), np.zeros(0))  # the last row's tokens left by the chain, their p

    def cut(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens the chain leaves and their transformed probabilities (no vector over the vocabulary)."""
        ids, chain_probs = chain(logits, self.params)
        left = chain_probs > 0
        ids, chain_probs = ids[left], chain_probs[left]
        self._chain = ids, chain_probs
        adapted = min(max(2 * self.target - self.weighted_sum / self.total_weight, 0.0), 1.0)
        d = np.abs(chain_probs - adapted) / WIDTH
        transformed = PEAK - SHARPNESS * d * d / (1 + d)
        weights = np.exp(transformed - transformed.max())
        return ids, weights / weights.sum()

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """`cut` as a vector over the vocabulary (0 for the tokens cut)."""
        ids, probs = self.cut(logits)
        result = np.zeros(len(logits))
        result[ids] = probs
        return result

    def observe(self, token: int, p: float) -> None:
        """The average moved by the chain's probability of the token drawn (p, its transformed one, unused)."""
        ids, chain_probs = self._chain
        self.weighted_sum = float(chain_probs[np.flatnonzero(ids == token)[0]]) + self.decay * self.weighted_sum
        self.total_weight = 1 + self.decay * self.total_weight
