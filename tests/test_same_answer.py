"""Same request, same answer: a seeded sampled text is the target alone's, whatever drafts (issue 28).

Each output position has its own draw (`sampling.Draws`), so the text is a function of the prompt, the
sampling settings and the seed only: the same with no draft, any K, auto, lookup, hybrid, MTP heads,
a recurrent target, a cold or a warm n-gram pool, streamed or not. The decoders here verify with
micro-batches of one token (`strict`), so batch rounding plays no part and the identity is exact.
"""
import numpy as np
import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.ngram import NgramPool
from ggufspec.processing import Constraints
from ggufspec.sampling import Draws
from ggufspec.tinymodels import Shape, make_mamba_pair
from reference import chi_square_pvalue, prompts

WORDS_GRAMMAR = 'root ::= pair+\npair ::= (" the" | " a") (" cat" | " dog" | " mat")\n'
DRAFTING = [(k, "model") for k in range(1, 6)] + [("auto", "model"), (3, "lookup"), ("auto", "lookup"),
                                                    (3, "hybrid")]
CONSTRAINED = {
    "none": {},
    "filters": {"top_k": 5, "top_p": 0.9, "min_p": 0.05},
    "unfiltered": {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "bias": {"constraints": Constraints(logit_bias={262: 3.0, 263: -100.0})},
    "penalties": {"constraints": Constraints(frequency_penalty=0.8, presence_penalty=0.5, repeat_penalty=1.3)},
    "grammar": {"constraints": Constraints(grammar=WORDS_GRAMMAR)},
    "logprobs": {"logprobs": 3},
}


@pytest.fixture(scope="module")
def strict_decoder(tiny_pair):
    with SpeculativeDecoder(*tiny_pair, n_ctx=256, n_threads=1, strict=True) as decoder:
        yield decoder


def run(decoder, prompt, k, drafter="model", **options):
    pieces = list(decoder.stream(prompt, n_predict=32, n_draft=k, drafter=drafter, **options))
    return [p.token for p in pieces], [p.logprob for p in pieces], decoder.last_stats


@pytest.mark.parametrize("temperature", [0.7, 1.5])
@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_sampled_text_is_the_target_alones_for_every_drafter(strict_decoder, case, temperature):
    options = {"temperature": temperature, **CONSTRAINED[case]}
    drafted = 0
    for seed, prompt in enumerate(prompts(3, seed=5)):
        expected, expected_logprobs, _ = run(strict_decoder, prompt, 0, seed=seed, **options)
        for k, drafter in DRAFTING:
            tokens, logprobs, stats = run(strict_decoder, prompt, k, drafter, seed=seed, **options)
            assert tokens == expected, f"{case} T={temperature} seed={seed} K={k} {drafter}"
            assert logprobs == expected_logprobs
            drafted += stats.n_drafted
    assert drafted > 0


def test_a_warm_pool_and_a_stream_give_the_same_text(strict_decoder):
    """The pool learns the first answer and drafts it the second time: same text, more drafted."""
    prompt = prompts(1, seed=9)[0]
    strict_decoder.ngram_pool = NgramPool(1 << 12)
    cold = strict_decoder.generate(prompt, n_predict=40, n_draft=8, drafter="lookup", temperature=0.8, seed=7)
    warm = strict_decoder.generate(prompt, n_predict=40, n_draft=8, drafter="lookup", temperature=0.8, seed=7)
    streamed = [p.token for p in strict_decoder.stream(prompt, n_predict=40, n_draft=8, drafter="lookup",
                                                         temperature=0.8, seed=7)]
    alone = strict_decoder.generate(prompt, n_predict=40, n_draft=0, temperature=0.8, seed=7)
    assert cold.tokens == warm.tokens == streamed == alone.tokens
    assert warm.stats.n_accept > cold.stats.n_accept


def test_the_seed_decides_and_a_missing_seed_is_random(strict_decoder):
    prompt = prompts(1, seed=2)[0]
    same = [strict_decoder.generate(prompt, n_predict=24, n_draft=3, temperature=1.0, seed=42).tokens for _ in range(2)]
    assert same[0] == same[1]
    assert strict_decoder.generate(prompt, n_predict=24, n_draft=3, temperature=1.0, seed=43).tokens != same[0]
    unseeded = {tuple(strict_decoder.generate(prompt, n_predict=24, temperature=1.0).tokens) for _ in range(3)}
    assert len(unseeded) > 1


def test_recurrent_target_samples_the_same_text(tmp_path):
    """Rejections there restore a state and replay, which decides a token too: same draw, same text."""
    with SpeculativeDecoder(*make_mamba_pair(tmp_path), n_ctx=256, n_threads=1, strict=True) as decoder:
        for seed, prompt in enumerate(prompts(3, seed=11)):
            expected = decoder.generate(prompt, n_predict=32, n_draft=0, temperature=0.9, seed=seed).tokens
            for k in (1, 3, 5, "auto"):
                got = decoder.generate(prompt, n_predict=32, n_draft=k, temperature=0.9, seed=seed)
                assert got.tokens == expected, (seed, k)


def test_mtp_heads_sample_the_same_text(tmp_path):
    from ggufspec.load import LoadParams, open_model
    from ggufspec.mtp import open_mtp
    from ggufspec.tinymodels_mtp import make_mtp_model
    llm = open_model(make_mtp_model(tmp_path, seed=0, shape=Shape(eos_bias=4.0)), "target",
                     LoadParams(n_ctx=256, n_threads=1, load_mtp=True), strict=True)
    decoder = SpeculativeDecoder(llm, None, n_threads=1)
    decoder.draft = open_mtp(decoder.target)
    try:
        drafted = 0
        for seed, prompt in enumerate(prompts(3, seed=4)):
            expected = decoder.generate(prompt, n_predict=32, n_draft=0, temperature=0.8, seed=seed).tokens
            for k in (1, 3, "auto"):
                got = decoder.generate(prompt, n_predict=32, n_draft=k, temperature=0.8, seed=seed)
                assert got.tokens == expected, (seed, k)
                drafted += got.stats.n_drafted
        assert drafted > 0
    finally:
        decoder.close()
        llm.close()


def test_a_draw_tied_to_the_call_count_is_caught(strict_decoder, monkeypatch):
    """Negative control: draws taken in call order (as a stream of random numbers would be) make the
    text depend on the drafts, and the identity above fails."""
    calls = iter(range(10**9))
    original = Draws.pick_among  # every pick goes through it
    monkeypatch.setattr(Draws, "pick_among", lambda self, ids, probs, position: original(self, ids, probs, next(calls)))
    differ = 0
    for seed, prompt in enumerate(prompts(3, seed=5)):
        expected = strict_decoder.generate(prompt, n_predict=32, n_draft=0, temperature=1.5, seed=seed).tokens
        differ += strict_decoder.generate(prompt, n_predict=32, n_draft=3, temperature=1.5, seed=seed).tokens != expected
    assert differ > 0


def test_the_draw_is_distributed_as_p():
    """The exponential race picks x with probability p_x (chi-square over many positions)."""
    p = np.array([0.0, 0.5, 0.25, 0.0, 0.15, 0.1])
    draws, n = Draws(3), 20_000
    picks = np.bincount([draws.pick(p, t) for t in range(n)], minlength=len(p))
    assert picks[0] == picks[3] == 0
    assert chi_square_pvalue(dict(enumerate(picks)), {i: float(v) for i, v in enumerate(p) if v}, n) > 1e-3


def test_a_close_draft_distribution_picks_the_same_token():
    """The coupling that makes a sampled draft useful: same position's draw, nearby q, same pick
    (at least (1 - TV) / (1 + TV) of the time)."""
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.4, 0.35, 0.25])
    tv = 0.5 * np.abs(p - q).sum()
    draws = Draws(11)
    same = np.mean([draws.pick(p, t) == draws.pick(q, t) for t in range(20_000)])
    assert same >= (1 - tv) / (1 + tv) - 0.01, same


# ---------------------------------------------------------------- the edges: CLI and server

def test_cli_gives_the_same_text_with_and_without_drafts(tiny_pair):
    import json

    from click.testing import CliRunner

    from ggufspec.cli import main
    target, draft = tiny_pair
    texts = set()
    for flags in (["--no-draft"], ["--draft", "3"], ["--draft", "auto"], ["--lookup"], ["--hybrid"]):
        result = CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the cat sat", "-n", "32",
                                           "-c", "256", "-t", "1", "--temp", "0.8", "-s", "7", "--strict", "--json",
                                           *flags])
        assert result.exit_code == 0, result.output
        texts.add(json.loads(result.stdout)["text"])
    assert len(texts) == 1, texts


def test_server_gives_the_same_text_for_any_draft_stream_and_warm_pool(chat_pair, tmp_path):
    """One request seven ways (no draft, K=3 twice: the pool warm the second time, auto, lookup,
    streamed) and choice 1 of n=2 against its own seed (seed + 1)."""
    from serverproc import serving
    target, draft = chat_pair
    base = {"model": "target", "prompt": "the cat", "max_tokens": 32, "temperature": 0.8, "seed": 7}
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", "512", "--strict") as server:
        client = server.client()
        texts = [client.completions.create(**base, extra_body=extra).choices[0].text
                 for extra in ({"draft": 0}, {"draft": 3}, {"draft": 3}, {"draft": "auto"}, {"lookup": True})]
        texts.append("".join(chunk.choices[0].text for chunk in client.completions.create(
            **base, stream=True, extra_body={"draft": 3}) if chunk.choices))
        assert len(set(texts)) == 1, texts
        pair = client.completions.create(**base, n=2, extra_body={"draft": 3}).choices
        alone = client.completions.create(**{**base, "seed": 8}, extra_body={"draft": 0}).choices[0].text
        assert sorted(pair, key=lambda c: c.index)[1].text == alone


def test_the_system_fingerprint_follows_what_rounds_the_answer(tiny_pair):
    """The threads split a long attention (so they are in it); under --strict the draft changes no bit
    of an answer (so it is not), where batched verification's rounding depends on the batches it drafts."""
    from ggufspec.server.props import system_fingerprint
    target, draft = tiny_pair

    def fingerprint(*models, **options):
        with SpeculativeDecoder(*models, n_ctx=128, **options) as decoder:
            return system_fingerprint(decoder)
    strict = fingerprint(target, draft, n_threads=1, strict=True)
    assert strict == fingerprint(target, n_threads=1, strict=True)
    assert strict != fingerprint(target, draft, n_threads=2, strict=True)
    assert fingerprint(target, draft, n_threads=1) != fingerprint(target, n_threads=1)


@pytest.mark.parametrize("fields", [
    {}, {"top_k": 0, "top_p": 0.9, "min_p": 0.0}, {"typical_p": 0.9}, {"top_n_sigma": 1.5, "top_k": 0},
    {"xtc_probability": 0.5, "xtc_threshold": 0.05, "top_k": 20}, {"temperature": 0.0, "dynatemp_range": 0.5},
    {"min_p": 0.3, "min_keep": 5}, {"top_k": 0}, {"top_k": 0, "min_p": 0.0}])
def test_a_pick_among_the_chains_tokens_is_the_pick_over_the_whole_vocabulary(fields):
    """`sampling.sample` (the tokens the chain leaves, no vector over the vocabulary) picks the token
    `Draws.pick` picks from `distribution`, with the same probability, bit for bit. (Under Mirostat `sample`
    is a draft's proposal among its likeliest tokens: test_stateful_samplers.)"""
    from ggufspec.sampling import SamplingParams, distribution, sample
    params, rng, draws = SamplingParams(**{"temperature": 0.8, **fields}), np.random.default_rng(3), Draws(11)
    for position in range(300):  # rows long enough for `sampling.top_k_ids`'s and `_head`'s shortcuts
        row = (rng.normal(size=40_000) * 3).astype(np.float32)
        row[rng.integers(0, 5, 3)] += 12 * (position % 2)  # peaked rows and flat ones
        row[rng.integers(0, 40_000, 20)] = -np.inf  # banned tokens
        probs = distribution(row, params)
        token, p = sample(row, params, draws, position)
        assert (token, p) == (draws.pick(probs, position), probs[token])
