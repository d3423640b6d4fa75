"""Speculative sampling leaves the target's distribution unchanged (chi-square against the exact p)."""
import numpy as np
import pytest

import ggufspec.sampling
from ggufspec import SamplingParams
from reference import draw_samples, exact_first_and_next_two, sampling_pvalues

PROMPT = [1, 261, 262, 263]
DRAWS = 3000
TEMPERATURE = 1.5


def draw(decoder, params, k):
    return draw_samples(decoder, PROMPT, params, k, DRAWS)


@pytest.fixture(scope="module")
def unfiltered():
    return SamplingParams(temperature=TEMPERATURE, top_k=0, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_matches_target(tiny_pair, tiny_decoder, unfiltered, k):
    """The first token (the prompt's batch decides it) and, given it, the next two (a step's rows 0
    and 1, after k proposals of the draft model) are distributed as the target's."""
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], PROMPT, unfiltered)
    samples = draw(tiny_decoder, unfiltered, k)
    assert tiny_decoder.last_stats.n_drafted > 0
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


def test_filters_apply_to_both_models(tiny_pair, tiny_decoder):
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], PROMPT, params)
    assert min(sampling_pvalues(draw(tiny_decoder, params, 2), p1, x, joint)) > 1e-3


def test_a_wrong_draw_is_caught(tiny_pair, tiny_decoder, unfiltered, monkeypatch):
    """Negative control: one uniform per position for every token (instead of one per token) makes the
    race pick the likeliest token every time, and the test sees the wrong distribution."""
    monkeypatch.setattr(ggufspec.sampling.Draws, "uniforms",
                        lambda self, position, ids: np.full(len(ids), 0.5))
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], PROMPT, unfiltered)
    first, after_x = sampling_pvalues(draw(tiny_decoder, unfiltered, 1), p1, x, joint)
    assert first < 1e-3 and after_x < 1e-3


def test_seed_makes_a_run_reproducible(tiny_decoder):
    runs = [tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=1.0, seed=42).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    other = tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=1.0, seed=43).tokens
    assert other != runs[0]
