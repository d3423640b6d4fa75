"""Slots (issue 30): several prompts at once, their tokens in one batch per model and round, each answer
the one it gets alone.

The decoders here verify with micro-batches of one token (`strict`), which also gives every sequence a
cache of its own (where its tokens lie cannot depend on the others'), so the identity is exact, greedy
and sampled, for a KV cache, a recurrent (Mamba) and a sliding-window target.
"""
import threading

import numpy as np
import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.costs import Costs
from ggufspec.processing import Constraints
from ggufspec.tinymodels import Shape, make_gemma2_pair, make_mamba_pair, make_weights, write_model
from reference import differs_at_near_tie, first_difference, prompts, same_as_target_alone, target_alone

PROMPTS = prompts(7, seed=5)


def alone_and_together(pair, n_parallel, **options):
    with SpeculativeDecoder(*pair, n_ctx=512, n_threads=1, strict=True) as alone:
        expected = [alone.generate(p, **options) for p in PROMPTS]
    with SpeculativeDecoder(*pair, n_ctx=512, n_threads=1, strict=True, n_parallel=n_parallel) as decoder:
        together = decoder.generate_many(PROMPTS, **options)
        again = decoder.generate_many(PROMPTS, **options)  # each finds a slot caching some of it
        lockstep = decoder.slots.lockstep
    return expected, together, again, (lockstep.n_batches, lockstep.n_requests)


@pytest.mark.parametrize("options", [
    {"n_draft": 3}, {"n_draft": "auto"}, {"n_draft": 0}, {"n_draft": 3, "drafter": "lookup"},
    {"n_draft": 2, "temperature": 0.8, "seed": 11}, {"n_draft": "auto", "temperature": 1.2, "seed": 3},
], ids=["k3", "auto", "alone", "lookup", "sampled-k2", "sampled-auto"])
def test_every_answer_is_the_one_it_gets_alone(tiny_pair, options):
    expected, together, again, (n_batches, n_requests) = alone_and_together(tiny_pair, 4, n_predict=40, **options)
    for want, got, got_again in zip(expected, together, again):
        assert got.tokens == want.tokens and got_again.tokens == want.tokens
    assert {g.stats.id_slot for g in together} == {0, 1, 2, 3}
    assert n_batches < 0.6 * n_requests  # batched: most llama_decode calls held several sequences


@pytest.mark.parametrize("maker", [make_mamba_pair, make_gemma2_pair], ids=["mamba", "gemma2-swa"])
def test_recurrent_and_sliding_window_slots_roll_back_independently(maker, tmp_path):
    pair = maker(tmp_path, seed=0)
    expected, together, again, _ = alone_and_together(pair, 3, n_predict=48, n_draft=3)
    assert [g.tokens for g in together] == [e.tokens for e in expected]
    assert [g.tokens for g in again] == [e.tokens for e in expected]
    assert sum(g.stats.n_drafted - g.stats.n_accept for g in together) > 0  # rejections were rolled back


def test_a_prompt_goes_to_the_slot_caching_most_of_it(tiny_pair):
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, n_parallel=3) as decoder:
        first = decoder.generate_many(PROMPTS[:3], n_predict=16, n_draft=0)
        turn2 = [p + g.tokens + [260, 261] for p, g in zip(PROMPTS[:3], first)]
        second = decoder.generate_many(turn2[::-1], n_predict=8, n_draft=0)  # in another order
        for before, after, prompt in zip(first[::-1], second, turn2[::-1]):
            assert after.stats.id_slot == before.stats.id_slot
            assert after.stats.n_prompt_cached >= len(prompt) - 3


def test_a_short_conversation_is_not_overwritten_while_a_slot_is_empty(tiny_pair):
    """A conversation short enough that all of it lies within the tail a next turn may tokenize otherwise is
    still a conversation: a new prompt sharing only its BOS goes to the empty slot, not over it."""
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, n_parallel=2) as decoder:
        short = decoder.generate_many([PROMPTS[0][:2]], n_predict=8, n_draft=0)[0]
        other = decoder.generate_many([[PROMPTS[0][0]] + [270] * 12], n_predict=8, n_draft=0)[0]
        assert other.stats.id_slot != short.stats.id_slot
        again = decoder.generate_many([PROMPTS[0][:2] + short.tokens + [260]], n_predict=4, n_draft=0)[0]
        assert again.stats.id_slot == short.stats.id_slot and again.stats.n_prompt_cached >= 2 + 8 - 1


def test_a_full_unified_cache_drops_idle_slots_conversations_first(tiny_pair):
    """Two slots share one cache (llama.cpp pads 128 cells to 256): a second long prompt fits once the
    first slot's cached conversation goes."""
    with SpeculativeDecoder(*tiny_pair, n_ctx=128, n_threads=1, n_parallel=2) as decoder:
        n = int(decoder.n_ctx * 0.7)
        a = decoder.generate_many([[1] + [260] * n], n_predict=8, n_draft=0)[0]
        cached = {s["id"]: s["n_cached"] for s in decoder.slots.describe()}
        assert cached[a.stats.id_slot] > n
        b = decoder.generate_many([[1] + [270] * n], n_predict=8, n_draft=0)[0]
        assert b.stats.id_slot != a.stats.id_slot and b.stats.n_predict > 0
        assert {s["id"]: s["n_cached"] for s in decoder.slots.describe()}[a.stats.id_slot] == 0


@pytest.mark.parametrize("similarity, cut_back", [(0.1, True), (0.5, False), (0.0, False)])
def test_a_slot_is_cut_back_for_a_prompt_holding_more_than_the_similarity(tiny_pair, similarity, cut_back):
    """llama-server's -sps: a new prompt sharing 30 of its 70 tokens with a slot's 48 cached ones takes
    that slot (cutting it back to the 30) where 30/70 is over the threshold, else the empty slot. Under
    --strict, where no slot takes another's prefix."""
    conversation = [1] + [259 + j % 22 for j in range(39)]
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, strict=True, n_parallel=2) as decoder:
        decoder.slots.prompt_similarity = similarity
        first = decoder.generate_many([conversation], n_predict=8, n_draft=0,
                                      constraints=Constraints(logit_bias={2: -100.0}))[0]
        new = conversation[:30] + [260 + j % 7 for j in range(40)]
        got = decoder.generate_many([new], n_predict=4, n_draft=0)[0]
    assert (got.stats.id_slot == first.stats.id_slot) == cut_back
    assert got.stats.n_prompt_cached == (30 if cut_back else 0)


@pytest.mark.parametrize("strict", [False, True], ids=["shared-cells", "strict"])
def test_two_conversations_with_one_system_prompt_keep_a_slot_each(tiny_pair, strict):
    """Turns alternate between two conversations that begin with one system prompt: each turn finds its
    whole conversation cached, with the cells shared or not (llama-server's rule, the slot sharing the
    longest prefix, had them take turns in one slot, each cutting the other back to the system prompt)."""
    system = [1] + [259 + j % 22 for j in range(40)]
    histories = {0: system + [270, 271], 1: system + [272, 273]}
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1, strict=strict, n_parallel=4) as decoder:
        for turn in range(3):
            for c in (0, 1):
                got = decoder.generate_many([histories[c]], n_predict=48, n_draft=0,
                                             constraints=Constraints(logit_bias={2: -100.0}))[0]
                if turn:
                    assert got.stats.n_prompt_cached >= len(histories[c]) - 3, (turn, c)
                histories[c] = histories[c] + got.tokens + [260 + turn, 261]


def test_questions_on_one_document_reuse_it_under_strict(tiny_pair):
    """Under --strict a slot's cells are its own: a second question on the same document goes to the
    slot holding it (cutting the first question's short answer saves far more than it drops)."""
    document = [1] + [259 + (7 * j) % 22 for j in range(200)]
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1, strict=True, n_parallel=4) as decoder:
        for question in range(3):
            got = decoder.generate_many([document + [270 + question, 271]], n_predict=16, n_draft=0)[0]
            if question:
                assert got.stats.n_prompt_cached >= len(document), question


@pytest.fixture(scope="module")
def endless_pair(tmp_path_factory):
    """The tiny pair with no end of sequence: every answer as long as it is allowed."""
    directory, shape = tmp_path_factory.mktemp("endless"), Shape()
    weights = make_weights(shape, seed=0)
    weights["output.weight"][2] = 0
    first_layer = {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    return (write_model(directory / "target.gguf", shape, weights),
            write_model(directory / "draft.gguf", Shape(n_layer=1), first_layer))


@pytest.mark.parametrize("n_draft", [0, 3])
def test_slots_that_fill_the_unified_cache_wait_or_end_early_never_wrong(endless_pair, n_draft):
    """Three answers that fit the cache one after another but not together (llama.cpp pads 128 cells to
    256). Where a round's batch finds no room, one slot decodes alone and the others wait for the next
    round: llama.cpp keeps the logits of its last decode only, and slots decoded one after another read
    the last one's rows (wrong tokens, or none: "no logits"). Where none fits, the newest ends as at
    the context's end and its cells go to the others. Every answer is the start of its answer alone."""
    prompts = [[1] + [259 + (3 * i + j) % 22 for j in range(40)] for i in range(5)]
    with SpeculativeDecoder(*endless_pair, n_ctx=128, n_threads=1, n_parallel=3) as decoder:
        # the last two prompts find no room while three answers fill the cells: they wait for a slot to end
        answers = decoder.generate_many(prompts, n_predict=150, n_draft=n_draft)
    assert sum(a.stats.stop_reason == "n_predict" for a in answers) >= 1
    assert any(a.stats.stop_reason == "context" for a in answers)  # 3 x 191 tokens: not all at once
    for prompt, got in zip(prompts, answers):
        want, margins, _ = target_alone(endless_pair[0], prompt, len(got.tokens), n_ctx=256)
        if got.tokens != want:  # batched rows over scattered cells differ from single-token ones by up to
            # 0.012 in this model past position 128 (measured, F16 and F32 caches alike): closer calls are ties
            assert differs_at_near_tie(got.tokens, want, margins, tie=0.05), first_difference(got.tokens, want)


def test_a_slot_left_mid_answer_leaves_the_others_exact(tiny_pair):
    """One generation stops after 3 tokens (a client gone) while the others decode: theirs are unchanged."""
    options = {"n_predict": 40, "n_draft": 3}
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, strict=True) as alone:
        expected = [alone.generate(p, **options).tokens for p in PROMPTS[:3]]
    results = {}
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, strict=True, n_parallel=3) as decoder:
        def run(i):
            with decoder.slots.use(PROMPTS[i]) as view:
                stream = view.stream(PROMPTS[i], **options)
                try:
                    results[i] = [piece.token for _, piece in zip(range(3 if i == 0 else 10**6), stream)]
                finally:
                    stream.close()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert decoder.slots.n_busy == 0
        assert decoder.generate_many(PROMPTS[:1], **options)[0].tokens == expected[0]
    assert results[0] == expected[0][:3] and results[1] == expected[1] and results[2] == expected[2]


def test_drafts_stop_where_the_batch_is_full_enough():
    """Costs.most_worth_drafting: where a batch of n costs n single tokens, drafting pays alone (a
    cheap verification) but not in a batch already holding other slots' tokens."""
    costs = Costs()
    linear = {1: 1.0, 2: 1.1, 4: 1.6, 8: 3.0, 16: 6.0, 32: 12.0, 64: 24.0}  # flat up to 2, then ~n/2.7
    for n, seconds in linear.items():
        for _ in range(3):
            costs.add_batch(n, seconds)
    assert costs.most_worth_drafting(8, 0, 0) == 8       # alone: K unbounded here (the controller decides)
    assert costs.most_worth_drafting(8, 1, 1) >= 1        # one other token: the batch is still cheap
    assert costs.most_worth_drafting(8, 15, 15) == 0      # 15 other slots' tokens: no draft pays


def test_a_slot_prices_drafts_with_the_batch_it_shares():
    """BatchCosts: T'(n) = T(B + n) - Y T(B + 1) / (1 + Y), so the controllers' own rule, E(k) / T'(k + 1)
    against 1 / T'(1), is the whole batch's: (E(k) + Y) / T(B + k + 1) against (1 + Y) / T(B + 1)."""
    from ggufspec.slots import BatchCosts

    class Round:  # three other slots put 6 tokens in the latest round
        members = 4

        def others(self, name):
            return 6, 3
    costs = Costs()
    for n, seconds in {1: 1.0, 2: 1.1, 4: 1.6, 8: 3.0, 16: 6.0}.items():
        for _ in range(3):
            costs.add_batch(n, seconds)
    seen = BatchCosts(costs, Round())
    T, shifted = costs.batch_model(), seen.batch_model()
    t0 = T(7) / 4
    assert abs(shifted(1) - t0) < 1e-12 and abs(shifted(5) - (T(11) - 3 * t0)) < 1e-12
    for k, expected in ((2, 2.5), (4, 3.2)):  # E(k) for some acceptance: the two rules agree
        assert (expected / shifted(k + 1) > 1 / shifted(1)) == ((expected + 3) / T(7 + k) > 4 / T(7))
    seen.add_batch(1, 0.01)  # a shared step is not learned from
    assert min(costs.batch_times[1]) == 1.0


def test_a_long_prompt_is_prefilled_in_chunks_between_the_other_slots_steps(tiny_pair):
    """A 1,600-token prompt arrives while another slot decodes: it is evaluated n_batch tokens a round,
    and the decoding slot gets a token in each of those rounds instead of waiting for all of it."""
    events = []
    with SpeculativeDecoder(*tiny_pair, n_ctx=2048, n_threads=1, n_parallel=2) as decoder:
        started = threading.Event()

        def decoding():
            with decoder.slots.use(PROMPTS[0]) as view:
                no_end = Constraints(logit_bias={2: -100.0})  # it goes on decoding whatever the CPU's rounding
                for i, _ in enumerate(view.stream(PROMPTS[0], n_predict=300, n_draft=0, constraints=no_end)):
                    events.append("token")
                    if i == 5:
                        started.set()

        def long_prompt():
            started.wait()
            prompt = [1] + [260 + i % 20 for i in range(1600)]
            with decoder.slots.use(prompt) as view:
                events.append("long prompt starts")
                stream = view.stream(prompt, n_predict=2, n_draft=0)
                next(stream)
                events.append("its first token")
                stream.close()
        threads = [threading.Thread(target=decoding), threading.Thread(target=long_prompt)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    between = events[events.index("long prompt starts"):events.index("its first token")]
    assert between.count("token") >= 3  # one per 512-token chunk (n_batch)


_words = np.random.default_rng(2).integers(259, 281, size=(5, 100))
SYSTEM = [1] + [int(t) for t in _words[0]]  # a system prompt four agents share
SHARING = [SYSTEM + [int(t) for t in words[:8]] for words in _words[1:]]


@pytest.mark.parametrize("options", [{"n_draft": 3}, {"n_draft": 0}, {"n_draft": "auto"}],
                         ids=["k3", "alone", "auto"])
def test_prompts_arriving_together_with_one_system_prompt_evaluate_it_once(tiny_pair, options):
    """In the unified cache a slot takes another slot's cells for the prefix they share
    (llama_memory_seq_cp), waiting a round for them where they are being evaluated: four prompts with
    one 101-token prefix cost one prefix on the target (and on the draft), and each answer is still the
    target alone's greedy one (batch rounding aside: near-ties are counted, a real difference fails),
    though the slot that filled the cells cuts its own drafts back from them meanwhile."""
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1, n_parallel=4) as decoder:
        got = decoder.generate_many(SHARING, n_predict=40, **options)
        evaluated = dict(decoder.slots.lockstep.tokens)
        shared = [(s.target.n_shared, s.draft.n_shared) for s in decoder.slots.slots]
    decided = 0
    for prompt, generation in zip(SHARING, got):
        expected, margins, _ = target_alone(tiny_pair[0], prompt, 40, 1024)
        decided += same_as_target_alone(generation, expected, margins, "shared prefix")
    assert decided >= 3
    cached = sorted(g.stats.n_prompt_cached for g in got)  # (two agents' own words may begin alike)
    assert cached[0] == 0 and all(len(SYSTEM) <= n < len(SYSTEM) + 8 for n in cached[1:])
    n_answers = sum(g.stats.n_predict + g.stats.n_drafted for g in got)
    if options["n_draft"] != "auto":  # (auto first times the step costs, on these contexts)
        assert evaluated["target"] <= len(SYSTEM) + 4 * 12 + n_answers  # the prefix once, then each its own
    if options["n_draft"] == 3:
        assert sum(draft >= len(SYSTEM) for _, draft in shared) == 3
        assert sum(g.stats.n_drafted - g.stats.n_accept for g in got) > 0  # rejections were cut back


def test_a_next_prompt_takes_the_prefix_another_slot_holds_and_strict_shares_none(tiny_pair):
    """A prompt arriving after another's answer takes its cached prefix from that slot, in whichever
    slot it runs; with strict verification every sequence has a cache of its own, so nothing is shared."""
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1, n_parallel=2) as decoder:
        first = decoder.generate_many(SHARING[:1], n_predict=8, n_draft=0)[0]
        taken = decoder.slots.slots[first.stats.id_slot]
        taken.busy = True  # as if another client held it: the next prompt gets the other slot
        second = decoder.generate_many(SHARING[1:2], n_predict=8, n_draft=0)[0]
        taken.busy = False
        assert second.stats.id_slot != first.stats.id_slot and second.stats.n_prompt_cached == len(SYSTEM)
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, n_parallel=4, strict=True) as decoder:
        got = decoder.generate_many(SHARING, n_predict=8, n_draft=0)
        assert [g.stats.n_prompt_cached for g in got] == [0] * 4
        assert all(s.target.n_shared == 0 for s in decoder.slots.slots)


def test_a_sub_agent_with_the_agents_system_prompt_leaves_the_agents_conversation_cached(tiny_pair):
    """Two slots, the agent's conversation cached in one: a prompt sharing only its system prompt goes to
    the other slot (taking the system prompt's cells from the first) instead of cutting the conversation
    back to the system prompt, so the agent's next turn finds all of it cached."""
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1, n_parallel=2) as decoder:
        agent = decoder.generate_many(SHARING[:1], n_predict=24, n_draft=0)[0]
        sub_agent = decoder.generate_many(SHARING[1:2], n_predict=8, n_draft=0)[0]
        assert sub_agent.stats.id_slot != agent.stats.id_slot
        assert sub_agent.stats.n_prompt_cached >= len(SYSTEM)
        next_turn = SHARING[0] + agent.tokens + [262, 263]
        again = decoder.generate_many([next_turn], n_predict=8, n_draft=0)[0]
        assert again.stats.id_slot == agent.stats.id_slot
        assert again.stats.n_prompt_cached >= len(next_turn) - 3


def test_seeded_sampled_answers_with_a_shared_prefix_are_the_ones_they_get_alone(tiny_pair):
    """Sampled with a seed, each prompt that took its prefix from another slot draws the same text as
    the same request alone (the position's draw; shared cells differ from its own by batch rounding
    at most, so at most one answer may leave it at a draw that close to a boundary)."""
    options = {"n_predict": 40, "n_draft": 2, "temperature": 0.8, "seed": 11}
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1) as alone:
        expected = [alone.generate(p, **options).tokens for p in SHARING]
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1, n_parallel=4) as decoder:
        got = decoder.generate_many(SHARING, **options)
    assert sum(g.stats.n_prompt_cached >= len(SYSTEM) for g in got) == 3
    assert sum(g.tokens == want for g, want in zip(got, expected)) >= 3


def test_generate_many_checks_every_prompt_before_any_runs(tiny_pair):
    """A prompt that cannot run (too long, empty, not a prompt) fails the call before the others are
    computed and thrown away; a text alone is not taken for a list of one-character prompts."""
    from ggufspec.errors import ContextFullError, GgufspecError
    with SpeculativeDecoder(*tiny_pair, n_ctx=128, n_threads=1, n_parallel=2) as decoder:
        with pytest.raises(GgufspecError, match="list of prompts.*got str"):
            decoder.generate_many("the cat")
        with pytest.raises(ContextFullError, match=r"^prompts\[1\]: the prompt is 400 tokens"):
            decoder.generate_many([[1, 260], [1] * 400])
        with pytest.raises(GgufspecError, match=r"^prompts\[0\]: the prompt is empty"):
            decoder.generate_many([[], [1, 260]])
        with pytest.raises(GgufspecError, match=r"^prompts\[1\]: a prompt is a text or a list of token ids"):
            decoder.generate_many([[1, 260], 7])
        assert decoder.slots.lockstep.n_requests == 0  # nothing ran
        assert len(decoder.generate_many([[1, 260], "the cat"], n_predict=4, n_draft=0)) == 2



def test_the_first_token_comes_from_the_prompts_logits_whatever_runs_before_it(tiny_pair, monkeypatch):
    """The first token comes from the logits the prompt's last decode left. With slots, the draft's
    taking of another slot's cells (`reuse_prefix`, after the target's prompt) may let a round of the
    others run, which replaces those logits (llama.cpp keeps the last decode's): here the draft's
    reuse_prefix scribbles over them, as such a round would."""
    from ggufspec.native import Context
    real = Context.reuse_prefix

    def another_round_meanwhile(self, tokens):
        if self.name == "draft":
            row = decoder.target.logits(0)  # llama.cpp's buffer itself
            row[:] = 0.0
            row[7] = 100.0
        return real(self, tokens)
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1) as decoder:
        expected = decoder.generate(PROMPTS[0], n_predict=6, n_draft=0).tokens
        assert expected[0] != 7
        monkeypatch.setattr(Context, "reuse_prefix", another_round_meanwhile)
        got = decoder.generate(PROMPTS[0], n_predict=6, n_draft=3, cache_prompt=False).tokens
    assert got[0] == expected[0]


def test_a_hybrid_draft_in_slots_under_strict_rolls_back_without_running_out_of_cells(tmp_path):
    """Under strict every target sequence has a cache of its own; the draft's was shared, and a hybrid
    (LFM2) draft re-evaluating after a rollback found its cells taken by the other slot: answers ended
    early as at the context's end (QA). The draft now has the target's layout."""
    from ggufspec.tinymodels import make_lfm2_pair
    pair = make_lfm2_pair(tmp_path)
    prompts_ = [[1, 262, 266], [1, 270, 271, 259, 263, 277, 265, 280], [1, 275, 260, 268, 261], "the cat sat on the mat"]
    options = dict(n_predict=-1, temperature=0, constraints=Constraints(logit_bias={2: float("-inf")}))
    with SpeculativeDecoder(*pair, n_ctx=256, n_threads=1, strict=True) as alone:
        expected = [alone.generate(p, n_draft=0, **options).tokens for p in prompts_]
    with SpeculativeDecoder(*pair, n_ctx=256, n_threads=1, strict=True, n_parallel=2) as decoder:
        got = decoder.generate_many(prompts_, n_draft=6, **options)
    assert [g.tokens for g in got] == expected


@pytest.mark.parametrize("arch, n_parallel, n_prompts, n_predict", [
    ("llama", 2, 3, 40), ("gemma2-swa", 2, 5, 60), ("mamba", 3, 5, 60)])
def test_a_draft_too_short_to_verify_is_dropped_from_the_draft_cache(tiny_pair, tmp_path, monkeypatch, arch,
                                                                    n_parallel, n_prompts, n_predict):
    """A draft shorter than draft_min is not verified, so no rejection cut it from the draft's cache: the
    draft held the sequence's next token already, its catch-up evaluated nothing, and it drafted from the
    logits of the draft model's latest decode, another slot's round (none at its row: DecodeError 'no
    logits for row 0 of the draft model', found by a fuzz on Gemma 2). The drafter now drops it itself."""
    import ggufspec.drafting as drafting
    pair = {"llama": lambda: tiny_pair, "gemma2-swa": lambda: make_gemma2_pair(tmp_path, seed=0, window=16),
            "mamba": lambda: make_mamba_pair(tmp_path, seed=0)}[arch]()
    prompts_ = prompts(n_prompts, seed=5)
    options = dict(n_predict=n_predict, temperature=0)
    with SpeculativeDecoder(pair[0], None, n_ctx=256, n_threads=1, strict=True) as alone:
        expected = [alone.generate(p, n_draft=0, **options).tokens for p in prompts_]
    lags, propose = [], drafting.ModelDrafter.propose

    def recorded(self, tokens, k, *args, **kwargs):
        cached = self.context.tokens  # a prefix of the sequence, its last token not yet evaluated (fresh logits)
        lags.append(len(tokens) - len(cached) if cached == tokens[:len(cached)] else -1)
        return propose(self, tokens, k, *args, **kwargs)
    monkeypatch.setattr(drafting.ModelDrafter, "propose", recorded)
    with SpeculativeDecoder(*pair, n_ctx=256, n_threads=1, strict=True, n_parallel=n_parallel) as decoder:
        got = decoder.generate_many(prompts_, n_draft=6, drafter="model", draft_p_min=0.3, draft_min=2, **options)
    assert [g.tokens for g in got] == expected
    assert lags and min(lags) >= 1


def test_strict_with_a_loaded_llama_is_refused(tiny_pair):
    """strict and exact set how the target computes as it loads: a Llama given already loaded kept its
    own micro-batches, and the answers were not bit-exact though the decoder said "strict" (QA)."""
    from llama_cpp import Llama

    from ggufspec.errors import GgufspecError
    llm = Llama(str(tiny_pair[0]), n_ctx=256, n_threads=1, verbose=False)
    try:
        with pytest.raises(GgufspecError, match="give its path, not a Llama"):
            SpeculativeDecoder(llm, tiny_pair[1], strict=True)
    finally:
        llm.close()


def test_a_round_wakes_each_slot_once_not_every_slot_at_every_handoff(endless_pair, monkeypatch):
    """Each slot waits on a condition of its own: a round of 8 slots is about 9 waits (8 slots and the
    round thread). One condition notified all woke every waiting slot at each of the 8 handoffs (37 waits
    a round measured), and each woken thread took the GIL: 0.19-0.32 ms a slot a round on these models
    (`benchmarks/slots_overhead.py`)."""
    with SpeculativeDecoder(*endless_pair, n_ctx=2048, n_threads=1, n_parallel=8) as decoder:
        decoder.generate_many(PROMPTS[:7] + PROMPTS[:1], n_predict=4, n_draft=0)  # warm-up
        waits, wait = [], threading.Condition.wait
        monkeypatch.setattr(threading.Condition, "wait",
                            lambda self, timeout=None: waits.append(1) or wait(self, timeout))
        rounds = decoder.slots.lockstep.rounds
        answers = decoder.generate_many(PROMPTS[:7] + PROMPTS[:1], n_predict=40, n_draft=0)
        rounds = decoder.slots.lockstep.rounds - rounds
    assert all(len(a.tokens) == 40 for a in answers)  # (no end of generation: every slot in every round)
    assert len(waits) <= 1.5 * 9 * rounds



def test_every_slot_decode_runs_in_the_round_thread_even_for_a_slot_alone(tiny_pair, monkeypatch):
    """llama.cpp's OpenMP build keeps a team of worker threads per calling thread, and libgomp counts
    every team's threads: once they outnumber the CPUs its barriers (one per graph node) stop spinning
    and sleep. A slot alone decoding in its own thread (a try in round 30, to save two thread switches a
    step) left a second team alive in the server's slot threads, and the demo target's steps took
    1.5-2x as long on 2 cores, the cores idle half the time. So every slot's decode, alone or not,
    runs in the one round thread."""
    import llama_cpp
    callers, decode = set(), llama_cpp.llama_decode
    monkeypatch.setattr(llama_cpp, "llama_decode",
                        lambda ctx, batch: callers.add(threading.get_ident()) or decode(ctx, batch))
    with SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1, n_parallel=2) as decoder:
        callers.clear()  # (the decoder's own loading and timing, from this thread)
        decoder.generate_many(PROMPTS[:1], n_predict=8, n_draft=3)
        decoder.generate_many(PROMPTS[:2], n_predict=8, n_draft=3)
        assert callers == {decoder.slots.lockstep._round_thread.ident}
