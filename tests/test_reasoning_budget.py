"""llama.cpp's `--reasoning-budget N`: a reasoning model's <think> block holds at most N tokens, then its
</think> (after `--reasoning-budget-message`) is forced; and a format that shapes the answer after the
block rather than the block (a JSON schema after DeepSeek-R1's thinking).

Both change the target's distribution on purpose, so speculation must give the target alone's answer
under the same rule: greedy identity against a reference written here apart from the engine (plain
llama-cpp-python, the forcing and the grammar's start done by hand), and a chi-square test of sampling.
"""
from collections import Counter

import numpy as np
import pytest
from llama_cpp import Llama

from ggufspec.errors import GgufspecError
from ggufspec.processing import Constraints, Grammar
from ggufspec.sampling import SamplingParams, distribution
from ggufspec.thinking import ThinkingBlock, ThinkingTags, utf8_complete
from reference import chi_square_pvalue, differs_at_near_tie, first_difference, prompts, same_as_target_alone

WORDS_GRAMMAR = 'root ::= pair+\npair ::= (" the" | " a") (" cat" | " dog" | " mat")\n'
KS = [0, 1, 3, 5, "auto"]


# ---------------------------------------------------------------- the block's states

def block(budget, piece=None, message=()):
    return ThinkingBlock(ThinkingTags(open=(7,), close=(8,), forced=(*message, 8)), budget, piece)


def test_the_budget_counts_the_blocks_tokens_then_forces_its_end():
    b = block(2, message=(9,))
    b.accept(7)
    assert b.inside and b.forced_token() is None
    b.accept(1)
    b.accept(2)  # the second token: the budget is spent
    assert b.forced_token() == 9 and b.allows(9) and not b.allows(1)
    row = np.array([5.0, 1.0, 2.0, -np.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0])
    b.restrict(row)
    assert np.isfinite(row).sum() == 1 and row[9] == 3.0
    b.accept(9)
    assert b.forced_token() == 8
    b.accept(8)
    assert not b.inside and b.forced_token() is None
    b.accept(7)  # another block: a fresh budget, as llama.cpp re-arms
    assert b.inside and b.left == 2


def test_the_models_own_end_closes_the_block_and_no_budget_only_tracks():
    b = block(5)
    for token in (7, 1, 8, 3):
        b.accept(token)
    assert not b.inside and b.forced_token() is None
    unlimited = block(None)
    unlimited.accept(7)
    for token in range(100):
        unlimited.accept(token if token not in (7, 8) else 1)
    assert unlimited.inside and unlimited.forced_token() is None


def test_a_tag_of_several_tokens_and_the_prompts_tail():
    tags = ThinkingTags(open=(5, 6), close=(7, 8), forced=(7, 8))
    opened = ThinkingBlock(tags, 3)
    opened.read_prompt([1, 2, 5, 6, 4])  # the assistant turn opened it; one token of it already counted
    assert opened.inside and opened.left == 2
    closed = ThinkingBlock(tags, 3)
    closed.read_prompt([5, 6, 4, 7, 8, 2])  # an empty block written by the template: the answer is outside
    assert not closed.inside
    copy = opened.clone()
    copy.accept(1)
    copy.accept(1)
    assert copy.forced_token() == 7 and opened.forced_token() is None  # the copy walks alone


def test_the_end_waits_for_a_whole_character():
    pieces = {1: b"a", 2: b"\xe2\x82", 3: b"\xac"}  # the euro sign split over two tokens
    b = block(2, piece=pieces.get)
    for token in (7, 1, 2):
        b.accept(token)
    assert b.inside and b.forced_token() is None  # not in the middle of the character
    b.accept(3)
    assert b.forced_token() == 8
    assert utf8_complete(b"") and utf8_complete(b"a\xe2\x82\xac") and not utf8_complete(b"\xf0\x9f\x98")


@pytest.mark.parametrize("kwargs, says", [
    ({"reasoning_budget": -2}, "reasoning_budget must be a whole number >= -1"),
    ({"reasoning_budget": 2.5}, "reasoning_budget must be a whole number >= -1"),
    ({"reasoning_budget": 2, "reasoning_budget_message": 5}, "reasoning_budget_message must be a text"),
])
def test_bad_budgets_are_one_line(kwargs, says):
    with pytest.raises(GgufspecError, match=says):
        Constraints(**kwargs)


# ---------------------------------------------------------------- greedy: the target alone's answer

def tag_ids(llm, text):
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def whole_character(llm, token) -> bool:
    """The reference's own test: the token's bytes do not stop inside a UTF-8 sequence."""
    try:
        llm.detokenize([token]).decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason != "unexpected end of data"
    return True


def reference_greedy(llm, prompt, n_predict, budget, forced, grammar_text=None):
    """The target alone, the prompt ending inside a <think> block: greedy for `budget` tokens (and to
    the end of a character), then `forced` token by token whatever the logits say, then greedy again,
    through the grammar from there on. (tokens, the top-2 margin of each decided token)"""
    llm.reset()
    llm.eval(prompt)
    out, margins, queue, grammar = [], [], list(forced) if budget == 0 else [], None
    left = budget
    while len(out) < n_predict:
        if queue:
            token, margin = queue.pop(0), np.inf
            if not queue:
                left = None  # the block is over
                grammar = Grammar(llm._model.vocab, Constraints(grammar=grammar_text)) if grammar_text else None
        else:
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            if grammar is not None:
                grammar.mask(row)
            token, top2 = int(np.argmax(row)), np.sort(row)[-2:]
            margin = float(top2[1] - top2[0])
            if token == llm.token_eos():
                break
            if left is not None:
                left -= 1
                if left <= 0 and whole_character(llm, token):
                    queue = list(forced)
            elif grammar is not None:
                grammar.accept(token)
        out.append(token)
        margins.append(margin)
        llm.eval([token])
    return out, margins


CASES = {"budget 0": (0, ""), "budget 3": (3, ""), "budget 6, a message": (6, " ok")}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identity_under_a_budget(tiny_decoder, plain_target, case):
    budget, message = CASES[case]
    constraints = Constraints(reasoning_budget=budget, reasoning_budget_message=message)
    forced = tag_ids(plain_target, message) + tag_ids(plain_target, "</think>") if message else tag_ids(plain_target, "</think>")
    decided = near_ties = 0
    for prompt in prompts(3, seed=5):
        prompt = prompt + tag_ids(plain_target, " <think>")  # the template's assistant turn opened the block
        expected, margins = reference_greedy(plain_target, prompt, 30, budget, forced)
        start = next(i for i in range(len(expected)) if expected[i:i + len(forced)] == forced)
        assert budget <= start <= budget + 3, (start, expected)  # the end forced where the budget ran out
        for drafter, ks in (("model", KS), ("lookup", [3])):
            for k in ks:
                got = tiny_decoder.generate(prompt, n_predict=30, n_draft=k, temperature=0, drafter=drafter,
                                            constraints=constraints)
                if same_as_target_alone(got, expected, margins, f"{case} {drafter} K={k}"):
                    decided += 1
                else:
                    near_ties += 1
    assert decided >= 0.8 * (decided + near_ties), (decided, near_ties)


def test_the_forced_end_is_drafted_and_kept(tiny_decoder, plain_target):
    """The drafter's guide knows the forced tokens: with K = 5 they come from drafts, not target steps."""
    forced = tag_ids(plain_target, "</think>")
    prompt = prompts(1, seed=5)[0] + tag_ids(plain_target, " <think>")
    pieces = list(tiny_decoder.stream(prompt, n_predict=20, n_draft=5, temperature=0,
                                      constraints=Constraints(reasoning_budget=2)))
    tokens = [p.token for p in pieces]
    start = next(i for i in range(len(tokens)) if tokens[i:i + len(forced)] == forced)
    assert sum(p.from_draft for p in pieces[start:start + len(forced)]) >= len(forced) - 2


def test_a_format_shapes_the_answer_after_the_thinking_not_the_thinking(tiny_decoder, plain_target):
    constraints = Constraints(grammar=WORDS_GRAMMAR, grammar_outside_thinking=True, reasoning_budget=4)
    forced = tag_ids(plain_target, "</think>")
    for prompt in prompts(2, seed=9):
        prompt = prompt + tag_ids(plain_target, " <think>")
        expected, margins = reference_greedy(plain_target, prompt, 30, 4, forced, WORDS_GRAMMAR)
        for k in (0, 3, "auto"):
            got = tiny_decoder.generate(prompt, n_predict=30, n_draft=k, temperature=0, constraints=constraints)
            if not differs_at_near_tie(got.tokens, expected, margins):
                assert got.tokens == expected, (k, first_difference(got.tokens, expected))
        answer = tiny_decoder.target.detokenize(got.tokens).decode(errors="replace").split("</think>", 1)[1]
        words = answer.split(" ")[1:]
        assert words and all(w in ("the", "a") for w in words[0::2]), answer
    # without the flag the grammar shapes the block too: its first token is a word already
    shaped = tiny_decoder.generate(prompt, n_predict=4, n_draft=0, temperature=0,
                                   constraints=Constraints(grammar=WORDS_GRAMMAR, reasoning_budget=4))
    assert shaped.text.startswith((" the", " a"))


# ---------------------------------------------------------------- sampling: chi-square

DRAWS = 1500


def exact_budgeted(llm, prompt, params, forced):
    """Budget 1: p(first) of the target alone, and p(first, the token after the forced end)."""
    def dist_after(prefix):
        llm.reset()
        llm.eval(prompt + prefix)
        return distribution(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32), params)
    p1 = dist_after([])
    joint = {}
    for a in np.flatnonzero(p1):
        assert whole_character(llm, int(a))  # else the end would wait a token: a prompt chosen so it does not
        p2 = dist_after([int(a)] + forced)
        for b in np.flatnonzero(p2):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    return p1, joint


@pytest.mark.parametrize("k", [1, 4])
def test_sampling_under_a_budget_is_the_targets(tiny_decoder, plain_target, k):
    params = SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
    forced = tag_ids(plain_target, "</think>")
    prompt = [1, 261, 262, 263] + tag_ids(plain_target, " <think>")
    p1, joint = exact_budgeted(plain_target, prompt, params, forced)
    first, pairs = Counter(), Counter()
    for seed in range(DRAWS):
        tokens = tiny_decoder.generate(prompt, n_predict=len(forced) + 2, n_draft=k, temperature=1.5, top_k=3,
                                       top_p=1.0, min_p=0.0, seed=seed,
                                       constraints=Constraints(reasoning_budget=1)).tokens
        assert tokens[1:-1] == forced
        first[tokens[0]] += 1
        pairs[(tokens[0], tokens[-1])] += 1
    assert chi_square_pvalue(first, {int(t): float(p1[t]) for t in np.flatnonzero(p1)}, DRAWS) > 1e-3
    assert chi_square_pvalue(pairs, joint, DRAWS) > 1e-3


def test_a_grammar_that_forbids_the_forced_end_is_one_line_not_an_abort(tiny_decoder, plain_target):
    """llama.cpp's grammar aborts the process when made to accept a token it forbids."""
    prompt = prompts(1, seed=9)[0] + tag_ids(plain_target, " <think>")
    for k in (0, 3):
        with pytest.raises(GgufspecError, match="the grammar forbids the </think> that the reasoning budget forces"):
            tiny_decoder.generate(prompt, n_predict=30, n_draft=k, temperature=0,
                                  constraints=Constraints(grammar=WORDS_GRAMMAR, reasoning_budget=2))
    assert tiny_decoder.generate(prompt, n_predict=3, n_draft=3, temperature=0).tokens  # still serving


# ---------------------------------------------------------------- Qwen3: the model opens the block itself

THINK, END = 281, 282  # the vocabulary's <think> and </think> (tinymodels.THINKING_TOKENS)


@pytest.fixture(scope="module")
def thinking_pair(tmp_path_factory):
    from ggufspec.tinymodels import Shape, make_pair
    return make_pair(tmp_path_factory.mktemp("thinking"), seed=0, shape=Shape(eos_bias=4.0, thinking=True))


def reference_opening(llm, prompt, n_predict, bias, budget, grammar_text):
    """The target alone under a format that shapes the answer only: at the answer's start the grammar's
    tokens and <think>; inside the block no grammar, `budget` tokens, then </think> forced; then the
    grammar from its start."""
    llm.reset()
    llm.eval(prompt)
    grammar = Grammar(llm._model.vocab, Constraints(grammar=grammar_text))
    out, margins, state, left = [], [], "start", budget
    while len(out) < n_predict:
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        for token, value in bias.items():
            row[token] += value
        if state == "forcing":
            token, margin, state = END, np.inf, "answer"
        else:
            if state in ("start", "answer"):
                opening = row[THINK]
                grammar.mask(row)
                if state == "start":
                    row[THINK] = opening
            token, top2 = int(np.argmax(row)), np.sort(row)[-2:]
            margin = float(top2[1] - top2[0])
            if token == llm.token_eos():
                break
            if state == "inside":
                left -= 1
                state = "forcing" if left <= 0 and whole_character(llm, token) else state
            elif token == THINK and state == "start":
                state = "inside"
            else:
                grammar.accept(token)
                state = "answer"
        out.append(token)
        margins.append(margin)
        llm.eval([token])
    grammar.close()
    return out, margins


@pytest.mark.parametrize("bias", [{}, {THINK: 30.0}])  # the model's own choice, or <think> made likely
def test_a_format_lets_the_model_open_a_block_first(thinking_pair, bias):
    from ggufspec import SpeculativeDecoder
    constraints = Constraints(grammar=WORDS_GRAMMAR, grammar_outside_thinking=True, reasoning_budget=3,
                              logit_bias=bias)
    llm = Llama(model_path=str(thinking_pair[0]), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    with SpeculativeDecoder(*map(str, thinking_pair), n_ctx=256, n_threads=1) as decoder:
        for prompt in prompts(2, seed=13):
            expected, margins = reference_opening(llm, prompt, 24, bias, 3, WORDS_GRAMMAR)
            assert (expected[0] == THINK and END in expected) == bool(bias), expected
            for k in (0, 3, "auto"):
                got = decoder.generate(prompt, n_predict=24, n_draft=k, temperature=0, constraints=constraints)
                if not differs_at_near_tie(got.tokens, expected, margins):
                    assert got.tokens == expected, (k, first_difference(got.tokens, expected))
    llm.close()
