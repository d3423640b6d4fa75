"""Target and draft vocabularies of different sizes (llama.cpp pairs them within 128 tokens):
greedy identity with the target alone and the exact sampling distribution, in both directions."""
import numpy as np
import pytest

from ggufspec import SamplingParams, SpeculativeDecoder
from ggufspec.sampling import distribution
from reference import prompts, same_as_target_alone, stops_at_call, target_alone
from ggufspec.tinymodels import Shape, make_weights, vocabulary, write_model

EXTRA = 16  # the bigger model's extra words


def pair(tmp_path, bigger: str):
    """Target and draft (the target's first layer) whose vocabularies differ by EXTRA words at the end.
    The extra words get a strong output bias so the text often holds them."""
    shape = Shape(extra_words=EXTRA, eos_bias=4.0)
    weights = make_weights(shape, seed=0)
    n_big = len(vocabulary(EXTRA)[0])
    weights["output.weight"][n_big - EXTRA:] *= 3.0
    small = {k: (v[:n_big - EXTRA] if k in ("token_embd.weight", "output.weight") else v) for k, v in weights.items()}
    draft_of = lambda w: {k: v for k, v in w.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    one_layer = lambda s: Shape(**{**s.__dict__, "n_layer": 1})
    small_shape = Shape(**{**shape.__dict__, "extra_words": 0})
    if bigger == "target":
        target = write_model(tmp_path / "t.gguf", shape, weights)
        draft = write_model(tmp_path / "d.gguf", one_layer(small_shape), draft_of(small))
    else:
        target = write_model(tmp_path / "t.gguf", small_shape, small)
        draft = write_model(tmp_path / "d.gguf", one_layer(shape), draft_of(weights))
    return target, draft


@pytest.mark.parametrize("bigger", ["target", "draft"])
def test_greedy_identity_with_mismatched_vocabularies(tmp_path, bigger):
    target, draft = pair(tmp_path, bigger)
    seen_extra, near_ties, checked = 0, 0, 0
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1, flash_attn="off") as decoder:
        n_target, n_draft = decoder.target_llm.n_vocab(), decoder.draft_llm.n_vocab()
        assert (n_draft > n_target) if bigger == "draft" else (n_target > n_draft), (n_target, n_draft)
        for prompt in prompts(8, seed=4):
            expected, margins, _ = target_alone(target, prompt, 40, decoder.n_ctx, "off")
            for k in (1, 3, 5):
                for drafter in ("model", "hybrid"):
                    got = decoder.generate(prompt, n_predict=40, n_draft=k, drafter=drafter)
                    if not same_as_target_alone(got, expected, margins, f"K={k} {drafter}"):
                        near_ties += 1
                        continue
                    checked += 1
                    seen_extra += sum(t >= len(vocabulary(0)[0]) for t in got.tokens)
    assert near_ties <= checked // 10
    if bigger == "target":
        assert seen_extra > 0, "the target never emitted a token the draft lacks: the test proves nothing"


@pytest.mark.parametrize("bigger", ["target", "draft"])
def test_sampling_distribution_with_mismatched_vocabularies(tmp_path, bigger):
    """First-token distribution of speculative sampling equals the target's exact p (chi-square)."""
    from scipy import stats as scipy_stats
    from llama_cpp import Llama
    target, draft = pair(tmp_path, bigger)
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    prompt = [1, 261, 262, 263]
    llm = Llama(model_path=str(target), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(prompt)
    p = distribution(np.array(llm.scores[llm.n_tokens - 1]), params)
    llm.close()
    draws = 2000
    counts = np.zeros(len(p))
    with SpeculativeDecoder(target, draft, n_ctx=64, n_threads=1, flash_attn="off") as decoder:
        for seed in range(draws):
            out = decoder.generate(prompt, n_predict=1, n_draft=3, temperature=1.5, top_k=0, top_p=1.0,
                                   min_p=0.0, seed=seed)
            counts[out.tokens[0] if out.tokens else 2] += 1
    keep = p * draws >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(p[keep] * draws, p[~keep].sum() * draws)
    mask = expected > 0
    pvalue = scipy_stats.chisquare(observed[mask], expected[mask] * observed[mask].sum() / expected[mask].sum()).pvalue
    assert pvalue > 1e-3


def test_a_bridged_drafts_long_catch_up_stops_between_chunks_and_stays_consistent(tmp_path):
    """A draft with a smaller vocabulary, behind a VocabBridge: a client gone stops its catch-up between
    chunks as the draft's own context would (the bridge passes `should_stop` on), and the bridge then
    counts only the target tokens evaluated whole, so the next catch-up resumes at the right place."""
    from ggufspec.bridge import VocabBridge
    from ggufspec.drafting import ModelDrafter
    from ggufspec.sampling import Draws
    target, draft = pair(tmp_path, "target")
    n_small = len(vocabulary(0)[0])
    prompt = [1] + [259 + (7 * i) % 22 if i % 5 else n_small + i % EXTRA for i in range(1400)]  # extras: several ids
    with SpeculativeDecoder(target, draft, n_ctx=4096, n_threads=1, flash_attn="off") as decoder:
        bridge = decoder.draft
        assert isinstance(bridge, VocabBridge)
        drafter, params = ModelDrafter(bridge), SamplingParams(temperature=0)
        bridge.should_stop = stops_at_call(2)
        assert drafter.propose(prompt, 3, params, Draws(0)) == []
        assert 0 < len(bridge.tokens) < len(prompt) and bridge.ends[-1] == len(bridge.inner.tokens)
        bridge.should_stop = None
        assert len(drafter.propose(prompt, 3, params, Draws(0))) == 3
        assert bridge.tokens[:len(prompt)] == prompt and bridge.ends[len(prompt) - 1] <= len(bridge.inner.tokens)


def test_constraints_with_a_bridged_draft_are_the_target_alones(tmp_path):
    """A bias (any constraint) guides the draft where its vocabulary holds the whole distribution; a
    bridged draft's smaller one does not, and it drafts unguided (this raised AttributeError)."""
    from ggufspec.processing import Constraints
    target, draft = pair(tmp_path, "target")
    bias = Constraints(logit_bias={5: 2.0, 9: -1.0})
    with SpeculativeDecoder(target, None, n_ctx=256, n_threads=1, strict=True) as alone, \
            SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1, strict=True) as decoder:
        for prompt in prompts(3, seed=7):
            expected = alone.generate(prompt, n_predict=24, n_draft=0, constraints=bias)
            got = decoder.generate(prompt, n_predict=24, n_draft=3, constraints=bias)
            assert got.stats.stop_reason != "error" and got.stats.n_drafted > 0
            assert got.tokens == expected.tokens  # --strict: no batch rounding to allow for
