"""llama.cpp's locally typical, top-n-sigma, XTC and dynamic temperature samplers (--typical, --top-nsigma,
--xtc-*, --dynatemp-*).

The distribution is llama.cpp's own: its sampler chain run through llama-cpp-python's bindings
(top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature (temp_ext), as common/sampling.cpp orders them) keeps
the same tokens with the same probabilities; XTC, random there, acting with probability 1 (the mixture
it makes with probability P is (1 - P) p + P p_cut by construction). Speculative sampling with them is
distributed as the target's (chi-square against the exact p), and greedy is untouched by them."""
import ctypes
import dataclasses

import llama_cpp
import numpy as np
import pytest

from ggufspec import SamplingParams
from ggufspec.errors import GgufspecError
from ggufspec.sampling import distribution
from reference import draw_samples, exact_first_and_next_two, sampling_pvalues


def llamacpp_distribution(logits: np.ndarray, params: SamplingParams, xtc: bool) -> np.ndarray:
    """What llama.cpp's chain leaves, softmaxed (its final `dist` draws from that)."""
    least = params.min_keep
    chain = [llama_cpp.llama_sampler_init_top_n_sigma(params.top_n_sigma),
             llama_cpp.llama_sampler_init_top_k(params.top_k),
             llama_cpp.llama_sampler_init_typical(params.typical_p, least),
             llama_cpp.llama_sampler_init_top_p(params.top_p, least),
             llama_cpp.llama_sampler_init_min_p(params.min_p, least),
             *([llama_cpp.llama_sampler_init_xtc(1.0, params.xtc_threshold, least, 1)] if xtc else []),
             llama_cpp.llama_sampler_init_temp_ext(params.temperature, params.dynatemp_range, params.dynatemp_exponent)]
    data = (llama_cpp.llama_token_data * len(logits))(
        *(llama_cpp.llama_token_data(id=i, logit=float(value), p=0.0) for i, value in enumerate(logits)))
    array = llama_cpp.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
    for sampler in chain:
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        llama_cpp.llama_sampler_free(sampler)
    ids = np.array([array.data[i].id for i in range(array.size)])
    values = np.array([array.data[i].logit for i in range(array.size)], dtype=np.float64)
    ids, values = ids[np.isfinite(values)], values[np.isfinite(values)]
    result = np.zeros(len(logits))
    result[ids] = np.exp(values - values.max()) / np.exp(values - values.max()).sum()
    return result


CHAINS = [dict(typical_p=0.5), dict(typical_p=0.9, top_k=0, top_p=1.0, min_p=0.0), dict(top_n_sigma=1.0),
          dict(top_n_sigma=2.0, top_k=0, min_p=0.0), dict(xtc_probability=1.0, xtc_threshold=0.05),
          dict(xtc_probability=1.0, xtc_threshold=0.1, top_k=0, top_p=1.0, min_p=0.0),
          dict(top_n_sigma=1.5, xtc_probability=1.0, xtc_threshold=0.08, top_p=0.9),
          dict(typical_p=0.8, xtc_probability=1.0, xtc_threshold=0.08, top_p=0.9),
          dict(dynatemp_range=0.5), dict(dynatemp_range=1.0, dynatemp_exponent=2.0, top_k=0, top_p=1.0, min_p=0.0),
          dict(dynatemp_range=2.0, dynatemp_exponent=0.5, top_k=100, min_p=0.0),
          dict(dynatemp_range=0.7, xtc_probability=1.0, xtc_threshold=0.05, top_n_sigma=2.0),
          dict(min_keep=5, top_p=0.3), dict(min_keep=8, min_p=0.5), dict(min_keep=4, typical_p=0.2, top_k=0),
          dict(min_keep=30, xtc_probability=1.0, xtc_threshold=0.02, top_k=60, top_p=1.0, min_p=0.0),
          dict(min_keep=3, xtc_probability=1.0, xtc_threshold=0.05, top_p=0.5)]
# not typical after top-n-sigma: llama.cpp's top-k then keeps the -inf logits top-n-sigma set where fewer
# than k are left, and its typical's entropy over them is NaN (here they are gone: p 0 is never typical)


@pytest.mark.parametrize("chain", CHAINS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CHAINS])
def test_the_distribution_is_llamacpps_chains(chain):
    rng = np.random.default_rng(7)
    for trial in range(20):
        logits = (rng.normal(size=300) * rng.uniform(0.5, 3.0)).astype(np.float32)
        if trial % 4 == 0 and (chain.get("typical_p", 1.0) >= 1 or chain.get("top_k", 40) > 0):
            # banned tokens (a logit bias); not among typical's candidates, where llama.cpp's entropy is NaN
            logits[rng.choice(300, 20, replace=False)] = -np.inf
        params = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), **chain)
        ours, theirs = distribution(logits, params), llamacpp_distribution(logits, params, params.xtc_probability > 0)
        assert set(np.flatnonzero(ours)) == set(np.flatnonzero(theirs)), trial
        np.testing.assert_allclose(ours, theirs, atol=2e-6)


def test_dynamic_temperature_from_zero_samples_as_llamacpps_and_greedy_is_no_temperature_above_zero():
    """temp 0 with a range: llama.cpp's temp_ext samples at temperatures in [0, range], not greedily."""
    logits = np.random.default_rng(5).normal(size=200).astype(np.float32) * 2
    params = SamplingParams(temperature=0.0, dynatemp_range=0.8, top_k=0, top_p=1.0, min_p=0.0)
    assert not params.greedy
    np.testing.assert_allclose(distribution(logits, params), llamacpp_distribution(logits, params, False), atol=2e-6)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=-1.0, dynatemp_range=0.5).greedy
    low = SamplingParams(temperature=1.0, dynatemp_range=0.5, top_k=0, top_p=1.0, min_p=0.0)  # in [0.5, 1.5]
    flat = np.zeros(50, dtype=np.float32)  # entropy at its most: the highest temperature (still uniform)
    np.testing.assert_allclose(distribution(flat, low), np.full(50, 1 / 50))
    peaked = np.array([5.0, 1.0, 0.5, 0.0], dtype=np.float32)
    t = distribution(peaked, low)
    assert distribution(peaked, SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0))[0] < t[0] \
        < distribution(peaked, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))[0]


def test_min_keep_leaves_that_many_to_each_filter_that_reads_it():
    """llama.cpp's min_keep: typical, top-p and min-p leave at least that many tokens, XTC cuts none where
    fewer would be left (top-k and top-n-sigma do not read it)."""
    logits = np.array([8.0, 4.0, 3.0, 2.5, 2.0, 1.0, 0.5, 0.0], dtype=np.float32)
    kept = lambda **chain: int(np.count_nonzero(distribution(logits, SamplingParams(temperature=1.0, **chain))))
    assert kept(top_p=0.5) == 1 and kept(top_p=0.5, min_keep=4) == 4
    assert kept(top_p=1.0, min_p=0.5) == 1 and kept(top_p=1.0, min_p=0.5, min_keep=3) == 3
    assert kept(top_p=1.0, min_p=0.0, typical_p=0.1) == 1 and kept(top_p=1.0, min_p=0.0, typical_p=0.1, min_keep=6) == 6
    assert kept(top_k=2, min_keep=5) == 2
    flat = np.zeros(8, dtype=np.float32)  # every token at 1/8: XTC at 0.1 would leave one
    cut = SamplingParams(temperature=1.0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.1)
    assert np.count_nonzero(distribution(flat, cut)) == 1
    assert np.count_nonzero(distribution(flat, dataclasses.replace(cut, min_keep=2))) == 8  # so it cuts none


def test_xtc_is_the_mixture_of_acting_and_not():
    logits = np.random.default_rng(3).normal(size=200).astype(np.float32) * 2
    off = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    on = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.05)
    half = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=0.3, xtc_threshold=0.05)
    assert not np.allclose(distribution(logits, on), distribution(logits, off))
    np.testing.assert_allclose(distribution(logits, half), 0.7 * distribution(logits, off) + 0.3 * distribution(logits, on))
    above = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.6)  # above 0.5: off, as llama.cpp
    np.testing.assert_array_equal(distribution(logits, above), distribution(logits, SamplingParams(temperature=1.0)))


PROMPT = [1, 261, 262, 263]
DRAWS = 3000


# settings that leave several tokens to the tiny target's peaked distributions (typical 0.999: 9 of 281 first
# tokens, 3 pairs after the likeliest; top-n-sigma 2: 60 and 449; XTC: all 281 and 78,961)
@pytest.mark.parametrize("chain", [dict(typical_p=0.999, temperature=2.0), dict(top_n_sigma=2.0, temperature=1.5),
                                   dict(xtc_probability=0.5, xtc_threshold=0.1, temperature=1.2),
                                   dict(dynatemp_range=1.0, temperature=1.2)],
                         ids=["typical", "top-n-sigma", "xtc", "dynatemp"])
def test_speculative_sampling_with_them_is_the_targets_distribution(tiny_pair, tiny_decoder, chain):
    params = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, **chain)
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], PROMPT, params)
    samples = draw_samples(tiny_decoder, PROMPT, params, 2, DRAWS)
    assert tiny_decoder.last_stats.n_drafted > 0
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


def test_greedy_is_untouched_and_bad_values_are_one_line(tiny_decoder):
    plain = tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0).tokens
    filtered = tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0, typical_p=0.2, top_n_sigma=0.5,
                                     xtc_probability=1.0, xtc_threshold=0.01).tokens
    assert filtered == plain
    assert tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=-1, dynatemp_range=0.5).tokens == plain
    for bad, says in ((dict(typical_p=-0.1), "--typical must be >= 0"), (dict(xtc_probability=1.5), r"--xtc-probability must be in \[0, 1\]"),
                      (dict(top_n_sigma=float("nan")), "top_n_sigma must be a finite number"),
                      (dict(xtc_threshold="0.1"), "xtc_threshold must be a number"),
                      (dict(dynatemp_exponent=-1.0), "--dynatemp-exp must be >= 0"),
                      (dict(dynatemp_range=float("inf")), "dynatemp_range must be a finite number")):
        with pytest.raises(GgufspecError, match=says):
            SamplingParams(temperature=1.0, **bad)
