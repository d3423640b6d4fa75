"""llama-server's `reasoning_control`: a running generation's thinking ended from outside it (POST
/v1/chat/completions/control with action `reasoning_end`): from the next position the target decides,
the budget message and </think> are forced, as when a budget runs out.

The request changes the target's distribution on purpose, from where it is taken: speculation must give
the target alone's answer with the end forced at that same position. Greedy identity against the
reference of tests/test_reasoning_budget.py (plain llama-cpp-python, the forcing done by hand), and a
chi-square test of sampling after an end asked before the first token.
"""
from collections import Counter

import numpy as np
import pytest

from ggufspec.processing import Constraints
from ggufspec.sampling import SamplingParams, distribution
from ggufspec.thinking import ReasoningControl, ThinkingBlock, ThinkingTags
from reference import chi_square_pvalue, differs_at_near_tie, first_difference, prompts, same_as_target_alone
from test_reasoning_budget import reference_greedy, tag_ids

KS = [0, 1, 3, "auto"]


def block(budget, piece=None):
    return ThinkingBlock(ThinkingTags(open=(7,), close=(8,), forced=(9, 8)), budget, piece)


def test_ending_a_block_forces_its_end_from_the_next_token():
    unlimited = block(None)
    unlimited.accept(7)
    unlimited.accept(1)
    assert unlimited.end_now() and unlimited.forced_token() == 9
    assert not unlimited.end_now()  # already ending: left as it is
    counted = block(5)
    counted.accept(7)
    assert counted.end_now() and counted.forced_token() == 9
    outside = block(None)
    assert not outside.end_now() and outside.state == "outside"
    pieces = {1: b"\xe2\x82", 2: b"\xac"}  # the euro sign over two tokens: the end waits for the second
    split = block(None, pieces.get)
    split.accept(7)
    split.accept(1)
    assert split.end_now() and split.forced_token() is None
    split.accept(2)
    assert split.forced_token() == 9


def test_a_request_is_taken_once():
    control = ReasoningControl()
    assert not control.take_end_request()
    control.request_end()
    assert control.take_end_request() and not control.take_end_request()


def opened(llm, prompt):
    return prompt + tag_ids(llm, " <think>")  # the template's assistant turn opened the block


def test_armed_but_never_asked_changes_nothing(tiny_decoder, plain_target):
    for prompt in prompts(2, seed=21):
        prompt = opened(plain_target, prompt)
        for k in (0, 3):
            plain = tiny_decoder.generate(prompt, n_predict=24, n_draft=k, temperature=0)
            armed = tiny_decoder.generate(prompt, n_predict=24, n_draft=k, temperature=0,
                                          constraints=Constraints(reasoning_control=ReasoningControl()))
            assert armed.tokens == plain.tokens


@pytest.mark.parametrize("message", ["", " ok"])
def test_an_end_asked_before_the_first_token_is_forced_at_once(tiny_decoder, plain_target, message):
    forced = (tag_ids(plain_target, message) if message else []) + tag_ids(plain_target, "</think>")
    decided = near_ties = 0
    for prompt in prompts(3, seed=5):
        prompt = opened(plain_target, prompt)
        expected, margins = reference_greedy(plain_target, prompt, 24, 0, forced)
        assert expected[:len(forced)] == forced
        for drafter, ks in (("model", KS), ("lookup", [3])):
            for k in ks:
                control = ReasoningControl()
                control.request_end()
                got = tiny_decoder.generate(prompt, n_predict=24, n_draft=k, temperature=0, drafter=drafter,
                                            constraints=Constraints(reasoning_control=control,
                                                                    reasoning_budget_message=message))
                if same_as_target_alone(got, expected, margins, f"{drafter} K={k}"):
                    decided += 1
                else:
                    near_ties += 1
    assert decided >= 0.8 * (decided + near_ties), (decided, near_ties)


@pytest.mark.parametrize("k", KS)
def test_an_end_asked_mid_answer_is_the_target_alone_forced_there(tiny_decoder, plain_target, k):
    """Asked after the 4th token reached the client: the end comes where the next step decides (at 4 or
    after, by how much the step ahead had kept), and the answer is the target alone's with the end forced
    at that position."""
    forced = tag_ids(plain_target, "</think>")
    checked = 0
    for prompt in prompts(3, seed=31):
        prompt = opened(plain_target, prompt)
        control = ReasoningControl()
        tokens = []
        for piece in tiny_decoder.stream(prompt, n_predict=30, n_draft=k, temperature=0,
                                         constraints=Constraints(reasoning_control=control)):
            tokens.append(piece.token)
            if len(tokens) == 4:
                control.request_end()
        at = next((i for i in range(len(tokens)) if tokens[i:i + len(forced)] == forced), None)
        if at is None:  # the model closed its block (or ended) before the request was taken
            continue
        assert at >= 4
        expected, margins = reference_greedy(plain_target, prompt, 30, at, forced)
        if not differs_at_near_tie(tokens, expected, margins):
            assert tokens == expected, (k, at, first_difference(tokens, expected))
            checked += 1
    assert checked >= 2


DRAWS = 800


@pytest.mark.parametrize("k", [1, 4])
def test_sampling_after_an_asked_end_is_the_targets(tiny_decoder, plain_target, k):
    params = SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
    forced = tag_ids(plain_target, "</think>")
    prompt = opened(plain_target, [1, 261, 262, 263])
    plain_target.reset()
    plain_target.eval(prompt + forced)
    exact = distribution(np.array(plain_target.scores[plain_target.n_tokens - 1], dtype=np.float32), params)
    after = Counter()
    for seed in range(DRAWS):
        control = ReasoningControl()
        control.request_end()
        tokens = tiny_decoder.generate(prompt, n_predict=len(forced) + 1, n_draft=k, temperature=1.5, top_k=3,
                                       top_p=1.0, min_p=0.0, seed=seed,
                                       constraints=Constraints(reasoning_control=control)).tokens
        assert tokens[:-1] == forced
        after[tokens[-1]] += 1
    assert chi_square_pvalue(after, {int(t): float(exact[t]) for t in np.flatnonzero(exact)}, DRAWS) > 1e-3
