"""A recurrent (Mamba) target and draft: lossless, rolled back by state snapshots, never re-evaluated whole."""
import numpy as np
import pytest

from ggufspec import SamplingParams, SpeculativeDecoder
from ggufspec.costs import Costs
from ggufspec.stepcosts import measure_step_costs
from reference import (NEAR_TIE, draw_samples, exact_first_and_next_two, first_difference,
                       greedy_every_k_is_target_alone, prompts, same_as_target_alone, sampling_pvalues,
                       target_alone)
from ggufspec.tinymodels import make_mamba_pair


@pytest.fixture(scope="module")
def mamba_pair(tmp_path_factory):
    return make_mamba_pair(tmp_path_factory.mktemp("mamba"))


@pytest.fixture(scope="module")
def decoder(mamba_pair):
    with SpeculativeDecoder(*mamba_pair, n_ctx=256, n_threads=1) as dec:
        yield dec


def check_identity(path, prompt, got, n_ctx=256):
    expected, margins, _ = target_alone(path, prompt, len(got.tokens), n_ctx)
    diff = first_difference(got.tokens, expected[:len(got.tokens)])
    if diff is not None and diff < len(margins) and margins[diff] < NEAR_TIE:
        return False  # a near-tie: reported by the caller
    assert diff is None, f"first difference at {diff}"
    return True


def test_the_memory_is_known(decoder):
    assert decoder.target.recurrent and decoder.target.rollback == "snapshot"
    assert decoder.target.can_roll_back() and decoder.draft.can_roll_back()


def test_greedy_equals_target_alone_for_every_k(mamba_pair, decoder):
    checked, near_ties = greedy_every_k_is_target_alone(decoder, mamba_pair[0], prompts(5, seed=11), 40, decoder.n_ctx)
    assert near_ties <= checked // 10


def test_a_step_evaluates_only_its_batch_and_the_kept_tokens(decoder):
    """No whole-sequence re-evaluation: per step the target evaluates its batch (1 + k) and, after a
    rejection, the tokens it keeps again after restoring its state, with its own token: that batch
    decides the next token too (llama-server's replay), so a generated token is evaluated once
    either way."""
    for k in (1, 3, 5):
        prompt = prompts(1, seed=20 + k)[0]
        target = decoder.target
        decoder.target.keep(0)
        before, replayed = target.n_evaluated, target.n_replayed
        out = decoder.generate(prompt, n_predict=60, n_draft=k, temperature=0)
        s = out.stats
        evaluated = target.n_evaluated - before
        assert s.n_drafted > 0 and s.n_accept < s.n_drafted  # there were rejections to roll back
        assert target.n_replayed - replayed <= s.n_accept + s.n_steps
        assert evaluated <= len(prompt) + len(out.tokens) + 1 + s.n_drafted + s.n_accept + s.n_steps
        decided_by_replays = len(out.tokens) - s.n_steps - s.n_accept
        assert 0 < decided_by_replays < s.n_steps, "each rejection's re-evaluation decides a token too"
        print(f"K={k}: {evaluated / len(out.tokens):.2f} target tokens evaluated per generated token")


def test_a_two_turn_conversation_reuses_its_prefix(mamba_pair, decoder):
    first = prompts(1, seed=3)[0] * 2
    out1 = decoder.generate(first, n_predict=24, n_draft=3)
    second = first + out1.tokens + [265, 266, 267]
    before = decoder.target.n_evaluated
    out2 = decoder.generate(second, n_predict=24, n_draft=3)
    assert out2.stats.n_prompt_cached == len(first) + len(out1.tokens) - 1
    assert decoder.target.n_evaluated - before <= 2 + 3 + 4 * out2.stats.n_steps + out2.stats.n_drafted
    check_identity(mamba_pair[0], second, out2)
    # a third prompt that leaves the answer: back to the checkpoint kept one token short of where the
    # first prompt ended (where the same prompt asked again resumes too)
    third = first + [270, 271]
    out3 = decoder.generate(third, n_predict=24, n_draft=2)
    assert out3.stats.n_prompt_cached == len(first) - 1
    check_identity(mamba_pair[0], third, out3)


def test_chat_turns_reuse_the_cache(decoder):
    history = [{"role": "user", "content": "the cat sat"}]
    first = decoder.chat(history, n_predict=12, n_draft=3)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and the dog"}]
    second = decoder.chat(history, n_predict=12, n_draft=3)
    assert second.stats.n_prompt_cached >= first.stats.n_prompt - 1  # at least up to where the first prompt ended


def test_measuring_costs_leaves_the_cache_as_it_found_it(mamba_pair, decoder):
    prompt = prompts(1, seed=4)[0]
    out = decoder.generate(prompt, n_predict=20, n_draft=2)
    held = list(decoder.target.tokens)
    measure_step_costs(decoder.target, decoder.draft, Costs(), token=prompt[0])
    assert decoder.target.tokens == held
    follow = prompt + out.tokens + [262, 263]
    again = decoder.generate(follow, n_predict=20, n_draft=2)
    assert again.stats.n_prompt_cached == len(held)  # all that was cached (the answer, but for its last token unless it ended)
    check_identity(mamba_pair[0], follow, again)


PROMPT = [1, 261, 262, 263]


def test_speculative_sampling_matches_target(mamba_pair, decoder):
    params = SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0)
    p1, x, joint = exact_first_and_next_two(mamba_pair[0], PROMPT, params)
    samples = draw_samples(decoder, PROMPT, params, 3, 1500)
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


@pytest.mark.parametrize("n_batch, strict", [(8, False), (512, True)])
def test_n_rs_seq_with_micro_batches_no_larger_is_refused_not_a_crash(tmp_path, n_batch, strict):
    """llama.cpp asserts n_ubatch > n_rs_seq in its first batch, which killed the process."""
    from ggufspec.errors import GgufspecError
    from ggufspec.load import LoadParams, open_model
    from ggufspec.tinymodels import make_lfm2_pair
    target_path, _ = make_lfm2_pair(tmp_path)
    with pytest.raises(GgufspecError, match="n_rs_seq 8 needs micro-batches of more than 8"):
        open_model(target_path, "target", LoadParams(n_ctx=256, n_threads=1, n_batch=n_batch, n_rs_seq=8,
                                                     strict=strict), strict=strict)


@pytest.mark.parametrize("n_rs_seq", [0, 8])
def test_a_hybrid_rolls_back_by_snapshot_or_by_n_rs_seq(tmp_path, n_rs_seq):
    """LFM2 (short convolutions beside attention): identical to the target alone either way; with
    llama.cpp's per-token rollback states (n_rs_seq) the target re-evaluates nothing."""
    from ggufspec.load import LoadParams, open_model
    from ggufspec.tinymodels import make_lfm2_pair
    target_path, draft_path = make_lfm2_pair(tmp_path)
    target = open_model(target_path, "target", LoadParams(n_ctx=256, n_threads=1, n_rs_seq=n_rs_seq))
    draft = open_model(draft_path, "draft", LoadParams(n_ctx=256, n_threads=1))
    with SpeculativeDecoder(target, draft) as dec:
        assert dec.target.hybrid and dec.target.n_rs_seq == n_rs_seq
        near_ties = checked = 0
        for prompt in prompts(3, seed=2):
            expected, margins, _ = target_alone(target_path, prompt, 40, 256, "off")  # -fa auto: off on a CPU
            for k in [1, 3, 5, "auto"]:
                dec.target.keep(0)
                replayed = dec.target.n_replayed
                got = dec.generate(prompt, n_predict=40, n_draft=k)
                if not same_as_target_alone(got, expected, margins, f"K={k}"):
                    near_ties += 1
                    continue
                checked += 1
                if n_rs_seq and k != "auto":
                    assert dec.target.n_replayed == replayed
        assert near_ties <= checked // 10
    target.close()
    draft.close()


def test_constraints_and_logprobs_through_the_replay(decoder):
    """A rejection's re-evaluation decides a token with the request's processing (bias, penalties,
    grammar) and reports its logprobs, as the target alone would: the same tokens and logprobs
    at every K as at K = 0 (the target alone through the same code)."""
    from ggufspec.processing import Constraints
    grammar = 'root ::= ("a" | "b" | "c" | " ")+\n'
    constraints = Constraints(logit_bias={265: 2.0, 2: float("-inf")}, frequency_penalty=0.5, repeat_penalty=1.2,
                              grammar=grammar)  # no end of text: every run goes 30 tokens
    drafted = accepted = generated = 0
    for prompt in prompts(4, seed=17):
        alone = list(decoder.stream(prompt, n_predict=30, n_draft=0, temperature=0, constraints=constraints, logprobs=2))
        for k in (1, 3, 5):
            got = list(decoder.stream(prompt, n_predict=30, n_draft=k, temperature=0, constraints=constraints,
                                      logprobs=2))
            assert [p.token for p in got] == [p.token for p in alone], f"K={k}"
            assert np.allclose([p.logprob for p in got], [p.logprob for p in alone], atol=5e-3), f"K={k}"
            stats = decoder.last_stats
            drafted, accepted, generated = drafted + stats.n_drafted, accepted + stats.n_accept, generated + len(got)
    assert generated >= 40 and drafted > accepted  # rejections were replayed


def test_cache_prompt_false_empties_the_state_and_answers_as_the_target_alone(mamba_pair, decoder):
    """cache_prompt=False on recurrent memory: the state and its checkpoints are dropped, the prompt
    is evaluated whole, and the answer is the target alone's (as with a warm cache)."""
    prompt = prompts(1, seed=8)[0] * 2
    warm = decoder.generate(prompt, n_predict=24, n_draft=3)
    fresh = decoder.generate(prompt, n_predict=24, n_draft=3, cache_prompt=False)
    assert fresh.stats.n_prompt_cached == 0 and fresh.tokens == warm.tokens
    assert check_identity(mamba_pair[0], prompt, fresh)
