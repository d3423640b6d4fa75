"""The expected speed of speculative decoding, from its costs (Leviathan et al. 2023).

One step drafts k tokens (k * t_draft seconds) and has the target verify them in one batch of
k + 1 (t_verify seconds: T(k + 1), the target's time for that batch). With a per-token acceptance
a, independent from token to token, the step keeps the first i drafts with probability a^i and
always adds one token of the target's own, so it yields on average

    E(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)   (k + 1 when a = 1)

tokens, at a rate of E(a, k) / (k t_draft + t_verify) tokens per second. The target alone makes
1 / T(1): the speedup is that rate times T(1). k = 0 is the target alone (E = 1, t_verify = T(1)).

Shared by the adaptive K controller (drafting), the offload planner (plan) and `bench`'s
predictions; it imports nothing from the rest of ggufspec.
"""
from __future__ import annotations


def expected_tokens(acceptance: float, k: int) -> float:
    """E(a, k): tokens one step yields on average (see the module's note)."""
    a = acceptance
    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1


def tokens_per_second(k: int, acceptance: float, t_draft: float, t_verify: float) -> float:
    """The speculative rate for K = k: E(a, k) / (k t_draft + t_verify)."""
    return expected_tokens(acceptance, k) / (k * t_draft + t_verify)


def speedup(k: int, acceptance: float, t_draft: float, t_verify: float, t_target: float) -> float:
    """The rate for K = k against the target alone, t_target = T(1) seconds a token."""
    return expected_tokens(acceptance, k) * t_target / (k * t_draft + t_verify)


def acceptance_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance a with E(a, k) equal to a measured mean of tokens per step (E grows
    with a, so bisection on [0, 1] finds it to 2^-50)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2
