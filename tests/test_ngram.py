"""N-gram drafting (`ggufspec.ngram`): the sequence index and the pool shared across requests, its
bounds, and the output: the target's own, greedy (K = 1..5 and auto) and sampled (chi-square)."""
import numpy as np
import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.costs import Costs
from ggufspec.drafting import AutoDrafting
from ggufspec.errors import GgufspecError
from ggufspec.ngram import NgramDrafter, NgramPool, NgramTallies, SequenceIndex, bucket_of
from ggufspec.sampling import SamplingParams
from ggufspec.tinymodels import Shape, make_weights, write_model
from reference import exact_first_and_next_two, prompts, same_as_target_alone, sampling_pvalues, target_alone

COPY_PROMPT = [1] + [260, 261, 262, 263, 264, 265, 266, 267, 268, 269] * 3
GREEDY = SamplingParams(temperature=0)


def test_the_longest_agreeing_place_wins():
    tokens = [1, 9, 5, 6, 7, 2, 8, 5, 6, 3, 4, 9, 5, 6]
    # (5, 6) was followed by 7 (after 9) and by 3 (after 8): the sequence ends 9 5 6, so 7 it is
    index = SequenceIndex()
    index.extend(tokens)
    found = index.candidate(tokens, 3)
    assert found.tokens == [7, 2, 8] and found.match_length == 3 and found.source == "sequence"
    # past the sequence's end the copy follows itself: a repeating pattern proposes its next period
    loop = [1, 4, 5, 4, 5]
    index = SequenceIndex()
    index.extend(loop)
    assert index.candidate(loop, 5).tokens == [4, 5, 4, 5, 4]


def test_a_copy_ends_at_its_sources_end_of_turn():
    # an earlier answer (30 31 32 33) ended with the end-of-turn token 2, then the user spoke (40 41);
    # the new answer repeats it: the copy stops after the 2, where the earlier turn's text went on
    tokens = [1, 30, 31, 32, 33, 2, 40, 41, 1, 30, 31]
    asked = []

    def is_end(token):
        asked.append(token)
        return token == 2
    drafter = NgramDrafter(500, None, is_end=is_end)
    assert drafter.candidate(tokens, 6).tokens == [32, 33, 2]
    assert NgramDrafter(500, None).candidate(tokens, 6).tokens == [32, 33, 2, 40, 41, 1]  # without the test
    drafter.candidate(tokens, 6)
    assert sorted(asked) == [2, 32, 33]  # each token asked once: the native call is cached
    # a copy from the pool (an earlier request's text) ends there too
    pool = NgramPool(1 << 12)
    NgramDrafter(500, pool).candidate(list(range(300, 310)) + [2] + list(range(400, 410)), 4)
    found = NgramDrafter(500, pool, is_end=lambda t: t == 2).candidate([1, 7] + list(range(300, 308)), 8)
    assert found.source == "pool" and found.tokens == [308, 309, 2]


def test_the_pool_drafts_what_an_earlier_request_said():
    pool = NgramPool(1 << 12)
    earlier = [1] + list(range(300, 340))
    NgramDrafter(500, pool).candidate(earlier, 4)  # indexes the earlier sequence into the pool
    now = [1, 7, 7] + list(range(310, 318))  # ends with 8 tokens of the earlier text, not copied here
    found = NgramDrafter(500, pool).candidate(now, 5)
    assert found.source == "pool" and found.tokens == [318, 319, 320, 321, 322] and found.match_length == 8
    assert bucket_of(found) == "pool:8"
    assert NgramDrafter(500, None).candidate(now, 5) is None  # without the pool: nothing to copy


def test_the_pool_is_bounded():
    pool = NgramPool(64)
    tokens = list(np.random.default_rng(0).integers(0, 50_000, size=20_000))
    pool.add(tokens, 1, len(tokens))
    assert pool.used <= 64 and len(pool.keys) == len(pool.next_tokens) == 64 and pool.nbytes == 64 * 12
    assert NgramPool().nbytes == 12 << 20  # the default: 12 MiB
    for size in (0, -5, 10 ** 12):  # 10**12 was a MemoryError's traceback
        with pytest.raises(GgufspecError, match="--lookup-pool must be 1 to"):
            NgramPool(size)


def test_a_pool_holding_another_vocabularys_ids_never_proposes_them():
    """A pool shared with another model's decoder: its ids past this vocabulary reached the grammar,
    whose native code aborted the process on them (QA)."""
    pool = NgramPool(1 << 12)
    earlier = [1] + list(range(260, 270)) + [100_000, 100_001]
    NgramDrafter(300, pool).candidate(earlier, 4)
    found = NgramDrafter(300, pool).candidate([1, 7] + list(range(262, 270)), 4)
    assert found is None or not found.tokens or max(found.tokens) < 300, found
    for orders in ((), (0,), (-3,), ("2",)):
        with pytest.raises(GgufspecError, match="orders must be n-gram lengths"):
            NgramPool(64, orders)
    with pytest.raises(GgufspecError, match="--lookup-pool must be 1 to"):
        NgramPool(True)


def test_stats_count_only_what_is_output_and_the_draft_stops_at_an_end(tiny_pair):
    """A draft model drafted past an end of generation and the target verified past it: n_accept
    counted tokens never output (more than the whole answer)."""
    from ggufspec.drafting import ModelDrafter
    proposed = []
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1) as decoder:
        real = ModelDrafter.propose

        def spy(self, tokens, k, *args, **kwargs):
            proposals = real(self, tokens, k, *args, **kwargs)
            proposed.append(proposals)
            return proposals
        ended = 0
        for prompt in prompts(12, seed=9):
            ModelDrafter.propose = spy
            try:
                steps = list(decoder.stream(prompt, n_predict=40, n_draft=8, drafter="model"))
            finally:
                ModelDrafter.propose = real
            stats = decoder.last_stats
            assert stats.n_accept == sum(step.from_draft for step in steps) <= stats.n_predict
            ended += stats.stop_reason == "eos"
        ends = [decoder.target.is_end_of_generation(t) for p in proposed for t in p[:-1]]
        assert not any(ends)  # an end is a proposal's last token, if it has one
    assert ended > 0, "no answer ended: the test shows nothing"


def test_slots_share_the_pool_as_one_decoder_does(looping_target):
    prompt = [1] + [260, 261, 262, 263, 264, 265] * 3
    with SpeculativeDecoder(looping_target, None, n_ctx=512, n_threads=1, n_parallel=2) as decoder:
        first = decoder.generate_many([prompt], n_predict=30, n_draft=4, drafter="lookup")[0]
        again = decoder.generate_many([prompt], n_predict=30, n_draft=4, drafter="lookup")[0]
        assert again.tokens == first.tokens and decoder.ngram_pool.used > 0
        assert again.stats.n_accept >= first.stats.n_accept  # the answer was learned: copied whole


def test_a_collision_is_a_miss_not_a_wrong_token():
    pool = NgramPool(1)  # every n-gram in one slot: the latest wins, the others miss
    pool.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 3, 10)
    assert pool.next_token([7, 8, 9], 3) == 10
    assert pool.next_token([1, 2, 3], 3) is None


def test_tallies_start_from_what_was_seen():
    fresh = NgramTallies()
    long_copy = "sequence:18"
    assert fresh.acceptance(long_copy) > fresh.acceptance("sequence:2")  # before anything: longer is likelier
    for _ in range(30):
        fresh.observe(long_copy, 8, 8)
        fresh.observe("sequence:2", 4, 0)
    kept = NgramTallies(fresh.to_dict())  # the next generation, from the remembered tallies
    assert kept.acceptance(long_copy) > 0.97 and kept.acceptance("sequence:2") < 0.1
    costs = Costs.from_dict(Costs().to_dict() | {"ngram": fresh.to_dict()})
    assert costs.ngram.acceptance(long_copy) == kept.acceptance(long_copy)


def memory_bound_costs() -> Costs:
    """T(n) about T(1) (a GPU): drafting pays when proposals are often kept."""
    costs = Costs()
    for n in range(1, 10):
        for _ in range(3):
            costs.add_batch(n, 1e-3 * (1 + 0.05 * (n - 1)))
    return costs


def compute_bound_costs() -> Costs:
    """T(n) = n T(1): no draft can pay."""
    costs = Costs()
    for n in range(1, 10):
        for _ in range(3):
            costs.add_batch(n, 1e-3 * n)
    return costs


def test_auto_drafts_long_copies_and_probes_cheaply():
    tokens = COPY_PROMPT + [260, 261, 262, 263]
    auto = AutoDrafting(NgramDrafter(300, NgramPool(1 << 10)), None, memory_bound_costs(), k_max=8)
    auto.choose(8)
    proposals = auto.propose(tokens, 8, GREEDY, None)
    cycle = [264, 265, 266, 267, 268, 269] + list(range(260, 270))  # up to NGRAM_K_MAX
    assert len(proposals) >= 8 and proposals == cycle[:len(proposals)]
    # where a bucket's proposals are seldom kept, only a one-token probe now and then
    costs = memory_bound_costs()
    for _ in range(40):
        costs.ngram.observe("sequence:18", 4, 0)
    stingy = AutoDrafting(NgramDrafter(300, NgramPool(1 << 10)), None, costs, k_max=8)
    sizes = []
    for _ in range(20):
        stingy.choose(8)
        sizes.append(len(stingy.propose(tokens, 8, GREEDY, None)))
        stingy.observe(sizes[-1], 0, 0.0, 1e-3 * (1 + 0.05 * sizes[-1]))
    assert set(sizes) <= {0, 1} and 1 <= sum(sizes) <= 5, sizes
    # where not even a right guess could pay (a batch of n costs n tokens), nothing but, now and then,
    # a long copy (kept in full, it costs what the target alone would: a free check of the costs)
    hopeless = AutoDrafting(NgramDrafter(300, NgramPool(1 << 10)), None, compute_bound_costs(), k_max=8)
    sizes = []
    for _ in range(20):
        hopeless.choose(8)
        sizes.append(len(hopeless.propose(tokens, 8, GREEDY, None)))
        hopeless.observe(0, 0, 0.0, 1e-3)
    assert sum(1 for n in sizes if n) <= 2 and all(n in (0, 8) for n in sizes), sizes  # K = 8 asked
    short_match = [1, 5, 6, 7, 260, 261, 9, 260, 261]  # 260 261 seen once before: a 2-token match
    hopeless = AutoDrafting(NgramDrafter(300, NgramPool(1 << 10)), None, compute_bound_costs(), k_max=8)
    for _ in range(20):
        hopeless.choose(8)
        assert hopeless.propose(short_match, 8, GREEDY, None) == []
        hopeless.observe(0, 0, 0.0, 1e-3)


def test_a_copy_that_broke_starts_again_slowly():
    """After a rejected copy the next one risks 2s + 4 tokens on the s tokens since, however long the
    context that the lookup finds agrees (TCP's slow start after a loss): in an agent's session the
    file read and each rewrite of it agree for 64 tokens where this answer goes elsewhere."""
    stretch = list(range(300, 380))
    tokens = stretch + [5] + stretch[:70]  # the lookup's context agrees for 64 tokens (MAX_MATCH)
    auto = AutoDrafting(NgramDrafter(400, NgramPool(1 << 10)), None, memory_bound_costs(), k_max=64)
    sizes = []
    for kept in (3, None, None, None):  # the first copy breaks after 3 tokens, the next ones are kept
        auto.choose(64)
        proposals = auto.propose(tokens, 64, GREEDY, None)
        assert proposals == (stretch[70:] + [5] + stretch)[:len(proposals)]
        sizes.append(len(proposals))
        auto.observe(sizes[-1], sizes[-1] if kept is None else kept, 0.0, 1e-3)
    assert sizes[0] > 6 and sizes[1:] == [6, 2 * (1 + 6 + 1) + 4, 2 * (8 + 20 + 1) + 4], sizes


@pytest.fixture(scope="module")
def looping_target(tmp_path_factory):
    """A tiny target that falls into loops (no EOS): its answers repeat, so n-gram drafts are kept."""
    shape = Shape()
    weights = make_weights(shape, seed=0)
    weights["output.weight"][2] = 0
    return write_model(tmp_path_factory.mktemp("ngram") / "looping.gguf", shape, weights)


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4, 5, "auto"])
def test_greedy_identical_to_the_target_alone(tiny_pair, looping_target, n_draft):
    """Every prompt twice on one decoder: the second time the pool holds the first answer, so the
    drafts come from an earlier request too."""
    near_ties = checked = 0
    for target in (tiny_pair[0], looping_target):
        with SpeculativeDecoder(target, None, n_ctx=256, n_threads=1) as decoder:
            decoder.ngram_pool = NgramPool(1 << 12)
            for prompt in (prompts(3, seed=7) + [COPY_PROMPT]) * 2:
                expected, margins, _ = target_alone(target, prompt, 60, decoder.n_ctx)
                got = decoder.generate(prompt, n_predict=60, n_draft=n_draft, drafter="lookup")
                if same_as_target_alone(got, expected, margins, f"lookup K={n_draft}"):
                    checked += 1
                else:
                    near_ties += 1
            assert decoder.ngram_pool.used > 0
    assert near_ties <= 1 and checked >= 14


def test_auto_with_a_draft_model_and_a_stale_pool_is_the_target_alone(tiny_pair):
    """A pool full of wrong continuations (another text under the same n-grams) costs verifications only."""
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as decoder:
        decoder.ngram_pool = NgramPool(1 << 12)
        rng = np.random.default_rng(3)
        for prompt in prompts(4, seed=9):
            decoder.ngram_pool.add(prompt + list(rng.integers(259, 281, size=40)), 1, len(prompt) + 40)
            expected, margins, _ = target_alone(target, prompt, 40, decoder.n_ctx)
            for n_draft, drafter in (("auto", "model"), ("auto", "hybrid"), (3, "hybrid")):
                got = decoder.generate(prompt, n_predict=40, n_draft=n_draft, drafter=drafter)
                same_as_target_alone(got, expected, margins, f"{drafter} {n_draft}")


PROMPT_8 = [1, 261, 262, 263, 264, 265, 266, 267]   # no repeats: only the pool can propose after it
# the target's likeliest first token here is 207, after which the sequence itself proposes 263, 261
PROMPT_REPEAT = [1, 262, 207, 263, 261, 262]
DRAWS = 3000


@pytest.mark.parametrize("source", ["pool", "sequence"])
def test_sampling_keeps_the_target_distribution(tiny_pair, source):
    """Proposals from the pool (the likeliest tokens, so both keep and resample happen) or from the
    sequence, K = 2, after the likeliest first token x: the first token, and the next two given x, are
    distributed as the target's (chi-square)."""
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    prompt = PROMPT_8 if source == "pool" else PROMPT_REPEAT
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], prompt, params)
    y, z = max(joint, key=joint.get)
    assert source == "pool" or x == 207
    with SpeculativeDecoder(tiny_pair[0], None, n_ctx=64, n_threads=1) as decoder:
        decoder.ngram_pool = pool = NgramPool(1 << 10)
        if source == "pool":
            pool.add(PROMPT_8 + [x, y, z], len(PROMPT_8) + 1, len(PROMPT_8) + 3)
        samples, drafted = [], 0
        for seed in range(DRAWS):
            out = decoder.generate(prompt, n_predict=5, n_draft=2, drafter="lookup", temperature=params.temperature,
                                   top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            samples.append(tuple(out.tokens))
            drafted += out.stats.n_drafted > 0 and out.tokens[0] == x
    assert drafted == sum(s[0] == x for s in samples)  # every draw after x was drafted
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


class FakeDraftModel:
    """A draft model's surface as AutoDrafting sees it: its context's n_past, and proposals."""

    def __init__(self, n_past: int):
        self.context = type("Ctx", (), {"n_past": n_past})()
        self.catch_up_seconds, self.calls = 0.0, 0

    def propose(self, tokens, k, params, draws, guide=None):
        self.calls += 1
        self.context.n_past = len(tokens)  # caught up
        return [7] * k


def test_a_draft_model_far_behind_catches_up_only_once_the_target_alone_has_cost_as_much():
    """Ski rental: after n-gram copies (or the target alone) made 1,500 tokens the draft has not seen,
    its catch-up costs more than a short answer gains from it; it is bought once the steps made
    without it have cost as much, and a draft nearly caught up drafts at once."""
    costs = memory_bound_costs()  # T(1) = 1 ms, T(n) = 1 + 0.05 (n - 1) ms: the draft model pays
    for _ in range(3):
        costs.draft_times.append(0.2e-3)
    prompt = [1] + list(range(300, 1800))  # no n-gram candidate: each step is the model's or none
    model = FakeDraftModel(n_past=10)
    auto = AutoDrafting(NgramDrafter(4000, NgramPool(1 << 10)), model, costs, k_max=4)
    catch_up = auto.catch_up_estimate(len(prompt) - 10)
    assert catch_up > 10 * 1e-3  # dearer than ten of the target's tokens
    steps_alone = 0
    while model.calls == 0:
        assert auto.choose(4) > 0
        lag = len(prompt) - model.context.n_past
        if auto.propose(prompt, 4, GREEDY, None) == []:
            steps_alone += 1
            prompt = prompt + [prompt[-1] + 1]
        assert steps_alone < 400
    saving = costs.batch_model()(1) - 1.0 / auto.model_k.rates(auto._model_choice)[auto._model_choice]
    # bought at the first step where the rent paid reached the price (the lag grew a token a step)
    assert steps_alone * saving >= auto.catch_up_estimate(lag) > (steps_alone - 1) * saving
    # caught up: the next steps draft at once
    auto.choose(4)
    assert auto.propose(prompt, 4, GREEDY, None) and model.calls == 2
    nearly = FakeDraftModel(n_past=len(prompt) - AutoDrafting.PROBE_MAX_LAG)
    fresh = AutoDrafting(NgramDrafter(4000, NgramPool(1 << 10)), nearly, costs, k_max=4)
    fresh.choose(4)
    assert fresh.propose(prompt, 4, GREEDY, None) and nearly.calls == 1


def test_a_copy_is_priced_against_the_target_alone_while_the_draft_model_lags():
    """A new prompt the draft model has not seen (a code completion's: the cursor moved): until its
    catch-up is bought the model does not draft, so a copy that beats the target alone is proposed,
    though it would not beat the model's rate. Priced against the model, nothing was drafted."""
    costs = memory_bound_costs()
    for _ in range(3):
        costs.draft_times.append(0.2e-3)
    # a short match (2 tokens agree: 5 6) that copies 7 8 9 ..., each token kept 1 time in 5 so far
    prompt = [1] + list(range(300, 1800)) + [4, 5, 6, 7, 8, 9, 10, 11, 12] + list(range(2000, 2100)) + [5, 6]
    model = FakeDraftModel(n_past=10)
    auto = AutoDrafting(NgramDrafter(4000, NgramPool(1 << 10)), model, costs, k_max=4)
    candidate = auto.ngram.candidate(prompt, 8)
    bucket = bucket_of(candidate)
    for _ in range(40):
        auto.tallies.observe(bucket, 1, 0)
        auto.tallies.observe(bucket, 1, 0)
        auto.tallies.observe(bucket, 1, 0)
        auto.tallies.observe(bucket, 1, 0)
        auto.tallies.observe(bucket, 1, 1)
    assert 0.15 < auto.tallies.acceptance(bucket) < 0.25
    auto.choose(4)
    assert auto._model_choice > 0 and not auto._model_may_draft(prompt)  # the model would pay, but lags
    a = auto.tallies.acceptance(bucket)
    best_copy = max((1 - a ** (k + 1)) / (1 - a) / costs.batch_model()(k + 1) for k in range(1, 9))
    assert auto.alternative_rate(model_ready=True) > best_copy > auto.alternative_rate(model_ready=False)
    proposals = auto.propose(prompt, 8, GREEDY, None)
    assert proposals and proposals == candidate.tokens[:len(proposals)] and model.calls == 0


def test_steps_where_the_draft_model_was_not_expected_to_pay_pay_no_rent():
    """The catch-up's rent counts only the steps where the draft model's K was above 0: where the
    target alone was the better choice anyway, drafting would have saved nothing."""
    costs = memory_bound_costs()
    for _ in range(3):
        costs.draft_times.append(0.2e-3)
    prompt = [1] + list(range(300, 1800))
    auto = AutoDrafting(NgramDrafter(4000, NgramPool(1 << 10)), FakeDraftModel(n_past=10), costs, k_max=4)
    for _ in range(50):  # the draft model's controller chose K = 0: the target alone, for free
        auto._model_choice = 0
        assert auto.propose(prompt, 4, GREEDY, None) == []
        prompt = prompt + [prompt[-1] + 1]
    assert auto._alone_steps == 0
    auto.choose(4)
    assert auto._model_choice > 0 and auto.propose(prompt, 4, GREEDY, None) == []
    assert auto._alone_steps == 1
