"""llama.cpp's samplers with a state the tokens move, Mirostat (--mirostat 1|2, --mirostat-ent, --mirostat-lr;
mirostat, mirostat_tau, mirostat_eta per request) and adaptive-p (--adaptive-target, --adaptive-decay where
the chain lists adaptive_p), stay lossless under speculation.

`mirostat.Mirostat` and `adaptivep.AdaptiveP` against llama.cpp's own samplers through the bindings
(temperature, then llama_sampler_init_mirostat or _v2, as common/sampling.cpp chains them; adaptive-p
after the chain): at every step of a walk the same tokens kept with the same probabilities, the state
moved by the token llama.cpp drew. Then
speculative sampling with it against the exact distribution of the target alone (chi-square), and
llama.cpp's chain with Mirostat: no penalties, and greedy at temperature 0."""
import copy
import ctypes

import llama_cpp
import numpy as np
import pytest

from ggufspec import SamplingParams
from ggufspec.errors import GgufspecError
from ggufspec.adaptivep import AdaptiveP
from ggufspec.mirostat import Mirostat
from ggufspec.processing import Constraints
from ggufspec.sampling import MIROSTAT_HEAD, Draws, distribution, sample
from reference import sampling_pvalues, seeded_samples

N_VOCAB = 400


def llamacpp_step(chain, logits: np.ndarray) -> tuple[np.ndarray, int]:
    """The probabilities llama.cpp's chain leaves (0 for tokens it cut) and the token it drew."""
    data = (llama_cpp.llama_token_data * len(logits))(
        *(llama_cpp.llama_token_data(id=i, logit=float(v), p=0.0) for i, v in enumerate(logits)))
    array = llama_cpp.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    probs = np.zeros(len(logits))
    for i in range(array.size):
        probs[array.data[i].id] = array.data[i].p
    return probs, array.data[array.selected].id


@pytest.mark.parametrize("version, tau, eta, temperature", [(2, 5.0, 0.1, 1.0), (2, 3.0, 0.3, 0.7), (2, 8.0, 0.5, 1.5),
                                                            (1, 5.0, 0.1, 1.0), (1, 3.0, 0.3, 0.8), (1, 6.0, 0.2, 1.3)])
def test_the_cut_and_its_state_are_llamacpps(version, tau, eta, temperature):
    rng = np.random.default_rng(version * 100 + int(tau * 10))
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_mirostat(N_VOCAB, 7, tau, eta, 100)
                                      if version == 1 else llama_cpp.llama_sampler_init_mirostat_v2(7, tau, eta))
    ours = Mirostat(version, tau, eta, temperature, N_VOCAB)
    sizes = set()
    for step in range(60):
        logits = (rng.normal(size=N_VOCAB) * rng.uniform(1.0, 4.0)).astype(np.float32)
        if step % 5 == 0:
            logits[rng.choice(N_VOCAB, 30, replace=False)] = -np.inf  # banned tokens (a logit bias, a grammar)
        theirs, drawn = llamacpp_step(chain, logits)
        probs = ours.distribution(logits)
        assert set(np.flatnonzero(probs)) == set(np.flatnonzero(theirs)), step
        np.testing.assert_allclose(probs, theirs, atol=1e-5, err_msg=f"step {step}")
        ours.observe(drawn, probs[drawn])
        sizes.add(int(np.count_nonzero(probs)))
    llama_cpp.llama_sampler_free(chain)
    assert len(sizes) > 3  # mu moved the cut


TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


def llamacpp_kept(chain, logits: np.ndarray) -> tuple[dict[int, float], int]:
    """`llamacpp_step` over a whole vocabulary's row: the tokens llama.cpp's chain keeps, their probabilities,
    and the token it drew."""
    data = np.zeros(len(logits), dtype=TOKEN_DATA)
    data["id"], data["logit"] = np.arange(len(logits)), logits
    array = llama_cpp.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                             size=len(logits), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    kept = np.ctypeslib.as_array(array.data, shape=(array.size,)).view(TOKEN_DATA)
    return dict(zip(kept["id"].tolist(), kept["p"].tolist())), int(kept["id"][array.selected])


@pytest.mark.parametrize("version", [1, 2])
def test_the_cut_over_a_real_vocabulary_is_llamacpps(version):
    """At the demo target's vocabulary size (151,936), where the cut reads no float64 vector over the row
    (v2 compares the float32 weights with their sum; v1 reads its 100 likeliest tokens, then its top k)."""
    rng, n_vocab = np.random.default_rng(version), 151_936
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(0.8))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_mirostat(n_vocab, 7, 5.0, 0.3, 100)
                                      if version == 1 else llama_cpp.llama_sampler_init_mirostat_v2(7, 5.0, 0.3))
    ours, sizes = Mirostat(version, 5.0, 0.3, 0.8, n_vocab), set()
    for step in range(12):
        logits = (rng.normal(size=n_vocab) * 2.5).astype(np.float32)
        logits[rng.choice(n_vocab, 20, replace=False)] += rng.uniform(4.0, 12.0, size=20).astype(np.float32)
        theirs, drawn = llamacpp_kept(chain, logits)
        mu, (ids, probs) = ours.mu, ours.cut(logits)
        ours_kept = dict(zip(ids.tolist(), probs.tolist()))
        for token in set(ours_kept) ^ set(theirs):  # only at the edge: llama.cpp's float32 sum of 151k terms
            assert abs(surprise(logits, 0.8, token) - mu) < 1e-3, (step, token)
        both = sorted(set(ours_kept) & set(theirs))
        np.testing.assert_allclose([ours_kept[i] for i in both], [theirs[i] for i in both], rtol=2e-3, atol=1e-6)
        ours.observe(drawn, ours_kept.get(drawn, theirs[drawn]))
        sizes.add(len(ids))
    llama_cpp.llama_sampler_free(chain)
    assert len(sizes) > 3  # mu moved the cut


def test_mirostat_far_from_its_start_neither_overflows_nor_keeps_what_it_cut():
    """mu far below 0 (a negative tau, a large eta) took 2^-mu past a float's range; far above, the float32
    threshold rounded to 0 and kept every token; extreme temperatures made 0 * inf. The cut is compared in
    the log domain now (found by review)."""
    row = np.array([0, -50, -100, -120, -300], dtype=np.float32)
    far_below, far_above = Mirostat(2, -600.0, 0.1, 1.0, 5), Mirostat(2, 75.0, 0.1, 1.0, 5)
    assert far_below.cut(row)[0].tolist() == [0]  # every surprise is above mu: the likeliest alone
    assert far_above.cut(row)[0].tolist() == [0, 1, 2]  # mu 150: -log2 p of 150 bits at most
    steered = Mirostat(2, 5.0, 1000.0, 1.0, 400)
    for step in range(5):
        ids, probs = steered.cut(np.random.default_rng(step).normal(size=400).astype(np.float32))
        steered.observe(int(ids[0]), float(probs[0]))
    tied = np.array([3, 3, 1, -np.inf], dtype=np.float32)
    for temperature, kept in ((1e-39, [0, 1]), (1e50, [0, 1, 2])):
        ids, probs = Mirostat(2, 5.0, 0.1, temperature, 4).cut(tied)
        assert ids.tolist() == kept and np.allclose(probs, 1 / len(kept))
        token, q = sample(tied, SamplingParams(temperature=temperature, mirostat=2), Draws(1), 0)
        assert token in kept and q == pytest.approx(1 / len(kept))


def surprise(logits: np.ndarray, temperature: float, token: int) -> float:
    """-log2 p of the token at the temperature, in float64."""
    scaled = logits.astype(np.float64) / temperature
    return float(-(scaled[token] - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())) / np.log(2))


def test_a_draft_under_mirostat_proposes_among_its_likeliest_tokens():
    """The draft cannot know the target's mu: it draws among its 100 likeliest tokens at the temperature (no
    race over the whole row), and gives the token's probability over the whole row (for p_min)."""
    rng, params, draws = np.random.default_rng(3), SamplingParams(temperature=0.8, mirostat=2, seed=1), Draws(1)
    logits = (rng.normal(size=151_936) * 2.5).astype(np.float32)
    logits[:150] += 6.0  # more than 100 plausible tokens: the head is a cut
    softmax = np.exp((logits.astype(np.float64) - logits.max()) / 0.8)
    softmax /= softmax.sum()
    head = set(np.argsort(-logits, kind="stable")[:MIROSTAT_HEAD].tolist())
    proposals = [sample(logits, params, draws, position) for position in range(300)]
    assert {token for token, _ in proposals} <= head and len({token for token, _ in proposals}) > 30
    for token, q in proposals:
        assert q == pytest.approx(softmax[token], rel=1e-5)


@pytest.mark.parametrize("target, decay, temperature", [(0.3, 0.9, 1.0), (0.05, 0.5, 1.5), (0.8, 0.99, 0.7)])
def test_adaptive_p_and_its_average_are_llamacpps(target, decay, temperature):
    """llama.cpp's adaptive-p fed the chain's probabilities (as logits log p, which its softmax gives back)."""
    rng = np.random.default_rng(int(target * 100))
    sampler = llama_cpp.llama_sampler_init_adaptive_p(target, decay, 7)
    params = SamplingParams(temperature=temperature, top_k=50, adaptive_target=target, adaptive_decay=decay)
    ours = AdaptiveP(params)
    for step in range(60):
        logits = (rng.normal(size=N_VOCAB) * rng.uniform(1.0, 3.0)).astype(np.float32)
        chain = distribution(logits, params)
        with np.errstate(divide="ignore"):
            theirs, drawn = llamacpp_step(sampler, np.log(chain).astype(np.float32))
        probs = ours.distribution(logits)
        np.testing.assert_allclose(probs, theirs, atol=2e-5, err_msg=f"step {step}")
        llama_cpp.llama_sampler_accept(sampler, int(drawn))
        ours.observe(drawn, probs[drawn])
    llama_cpp.llama_sampler_free(sampler)


# ---------------------------------------------------------------- the target alone with Mirostat

PROMPT = [1, 261, 262, 263]
DRAWS = 3000


def exact_with_state(llm, params: SamplingParams, prompt):
    """p(first) after `prompt`, the likeliest first x, and p(second, third) after x, of the target alone:
    each position's Mirostat or adaptive-p state moved by the tokens before it, as the judge moves it."""
    def row(prefix):
        llm.reset()
        llm.eval(prompt + prefix)
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    state = Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta, params.temperature, llm.n_vocab()) \
        if params.mirostat else AdaptiveP(params)
    p1 = state.distribution(row([]))
    x = int(np.argmax(p1))
    state.observe(x, p1[x])
    p2 = state.distribution(row([x]))
    joint = {}
    for a in np.flatnonzero(p2):
        after = copy.deepcopy(state)
        after.observe(int(a), p2[a])
        p3 = after.distribution(row([x, int(a)]))
        for b in np.flatnonzero(p3):
            joint[(int(a), int(b))] = p2[a] * p3[b]
    return p1, x, joint


@pytest.mark.parametrize("chain", [dict(temperature=5.0, mirostat=1, mirostat_tau=3.0, mirostat_eta=2.0),
                                   dict(temperature=5.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=2.0),
                                   dict(temperature=3.0, top_k=12, adaptive_target=0.05, adaptive_decay=0.3)],
                         ids=["mirostat-1", "mirostat-2", "adaptive-p"])
def test_speculative_sampling_with_a_state_is_the_targets_distribution(tiny_decoder, plain_target, chain):
    """Hot and fast enough that the state's moves matter: Mirostat left at 2 tau would put the next two
    tokens' joint 0.52 (v1) and 0.65 (v2) away in total variation (the tiny target is sure of itself)."""
    p1, x, joint = exact_with_state(plain_target, SamplingParams(**chain), PROMPT)
    assert 1 < np.count_nonzero(p1) < 20  # cut, and more than one token left
    samples, drafted = seeded_samples(tiny_decoder, PROMPT, 2, DRAWS, **chain)
    assert drafted > DRAWS
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


def test_mirostat_leaves_out_the_penalties_and_greedy_stays_greedy(tiny_decoder):
    """llama.cpp's chain with Mirostat is temperature, then Mirostat: the penalties and DRY are not in it."""
    penalties = Constraints(repeat_penalty=1.5, frequency_penalty=0.5, dry_multiplier=1.0)
    plain = tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0).tokens
    assert tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0, constraints=penalties).tokens != plain
    assert tiny_decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0, mirostat=2,
                                 constraints=penalties).tokens == plain
    sampled = dict(n_predict=24, n_draft=3, temperature=1.2, mirostat=2, seed=5)
    assert tiny_decoder.generate("the cat", **sampled, constraints=penalties).tokens == \
        tiny_decoder.generate("the cat", **sampled).tokens


@pytest.mark.parametrize("bad, says", [(dict(mirostat=3), "--mirostat must be 0 (off), 1 or 2"),
                                       (dict(mirostat=1.5), "mirostat must be a whole number"),
                                       (dict(mirostat=2, mirostat_tau=float("nan")), "mirostat_tau must be a finite"),
                                       (dict(mirostat=2, mirostat_eta="fast"), "mirostat_eta must be a number"),
                                       (dict(adaptive_target=1.5), "adaptive_target must be at most 1"),
                                       (dict(adaptive_target=0.3, adaptive_decay=1.0), "adaptive_decay must be in"),
                                       (dict(adaptive_target=0.3, xtc_probability=0.5), "adaptive-p with XTC")])
def test_bad_mirostat_values_are_one_line(bad, says):
    with pytest.raises(GgufspecError, match=None) as caught:
        SamplingParams(temperature=1.0, **bad)
    assert says in str(caught.value) and "\n" not in str(caught.value)
