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


def rows_to_rank(rng, n):
    """Rows of every kind a ranking meets: flat, peaked, with ties, mostly banned (a grammar), all banned but
    a few, the best in the last, ungrouped values (`top_k_ids`'s tail)."""
    flat = (rng.normal(size=n) * 3).astype(np.float32)
    peaked = flat.copy()
    peaked[rng.integers(0, n, 5)] += 15
    banned = flat.copy()
    banned[rng.random(n) < 0.999] = -np.inf
    few = np.full(n, -np.inf, dtype=np.float32)
    few[rng.integers(0, n, 3)] = 1.0
    last = flat.copy()
    last[-3:] = 100.0
    return [flat, peaked, np.round(flat), banned, few, last]


@pytest.mark.parametrize("n", [300, 5000, 151_936, 151_937])
@pytest.mark.parametrize("k", [1, 5, 40, 100, 300])
def test_top_k_ranks_as_a_stable_sort_of_the_whole_row(n, k):
    """`top_k_ids` (only the values above a bound sorted) gives a stable sort's first k, ties by the lower id."""
    rng = np.random.default_rng(n + k)
    for row in rows_to_rank(rng, n):
        assert np.array_equal(ggufspec.sampling.top_k_ids(row, k), np.argsort(-row, kind="stable")[:k])


@pytest.mark.parametrize("fields", [{"top_p": 0.95, "min_p": 0.0}, {"top_p": 0.9, "min_p": 0.05},
                                    {"top_p": 1.0, "min_p": 0.1}, {"top_p": 0.5, "min_p": 0.0, "min_keep": 300}])
def test_without_top_k_the_chain_keeps_what_the_whole_row_sorted_keeps(fields, monkeypatch):
    """`_head` (a prefix long enough for top-p or min-p, not the 151k-token row sorted) keeps the same
    tokens with the same probabilities as the whole row sorted."""
    params, rng = SamplingParams(temperature=0.8, top_k=0, **fields), np.random.default_rng(7)
    rows = [row * scale for row in rows_to_rank(rng, 151_936) for scale in (0.3, 1.0, 3.0)]
    fast = [ggufspec.sampling.chain(row, params) for row in rows]
    monkeypatch.setattr(ggufspec.sampling, "_head", lambda values, _: (np.argsort(-values, kind="stable"), None))
    for row, (ids, probs) in zip(rows, fast):
        whole_ids, whole_probs = ggufspec.sampling.chain(row, params)
        assert np.array_equal(ids, whole_ids)
        np.testing.assert_allclose(probs, whole_probs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("fields", [{}, {"dynatemp_range": 0.5}, {"temperature": 0.0}])
def test_temperature_alone_draws_as_the_whole_row_sorted_does(fields, monkeypatch):
    """Without a filter that reads the order, the chain leaves the row unsorted (a 151k-token sort was 30 ms a
    row): the same probability for each token, and the same token drawn at every position."""
    params = SamplingParams(**{"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **fields})
    rows = [row * scale for row in rows_to_rank(np.random.default_rng(3), 151_936) for scale in (0.3, 3.0)]
    draws = ggufspec.sampling.Draws(11)
    unsorted = [ggufspec.sampling.chain(row, params) for row in rows]
    picked = [ggufspec.sampling.sample(row, params, draws, i) for i, row in enumerate(rows)]
    monkeypatch.setattr(ggufspec.sampling.np, "arange", lambda n: np.argsort(-row, kind="stable"))
    for i, (row, (ids, probs)) in enumerate(zip(rows, unsorted)):
        sorted_ids, sorted_probs = ggufspec.sampling.chain(row, params)
        assert set(ids[probs > 0]) == set(sorted_ids[sorted_probs > 0])
        by_id = dict(zip(sorted_ids.tolist(), sorted_probs))
        np.testing.assert_allclose(probs, [by_id[t] for t in ids.tolist()], rtol=1e-12, atol=1e-300)
        assert ggufspec.sampling.sample(row, params, draws, i) == pytest.approx(picked[i], rel=1e-12)
