"""Logit bias, penalties, a grammar and logprobs stay lossless under speculation.

The references are written here, apart from the engine: the target alone through plain
llama-cpp-python, one token per eval, its logits processed by `reference_process` (bias and
llama.cpp's penalties, in numpy) and, for a grammar, by a fresh llama.cpp grammar sampler walked
along the reference's own output.
"""
import os
from collections import Counter

import numpy as np
import pytest

from ggufspec import SamplingParams
from ggufspec.errors import GgufspecError
from ggufspec.processing import Constraints, Grammar, TargetJudge, log_normaliser
from ggufspec.sampling import distribution
from reference import differs_at_near_tie, first_and_second, first_difference, prompts, sampling_pvalues, seeded_samples

# stateful on purpose: a determiner, then a noun, again and again (a grammar that forgot what it
# accepted would allow determiners only)
WORDS_GRAMMAR = 'root ::= pair+\npair ::= (" the" | " a") (" cat" | " dog" | " mat")\n'
KS = [0, 1, 2, 3, 4, 5, "auto"]


def reference_process(logits, history, c: Constraints, grammar=None):
    out = np.array(logits, dtype=np.float32)
    for token, bias in c.logit_bias.items():
        out[token] += bias
    if c.repeat_last_n:
        window = history[-c.repeat_last_n:] if c.repeat_last_n > 0 else history
        for token, count in Counter(window).items():
            l = out[token]
            l = l * c.repeat_penalty if l <= 0 else l / c.repeat_penalty
            out[token] = l - count * c.frequency_penalty - c.presence_penalty
    if grammar is not None:
        grammar.mask(out)
    return out


def reference_greedy(llm, prompt, n_predict, c: Constraints):
    """The target alone: (tokens, top-2 margins of the processed logits, logprobs of each token)."""
    llm.reset()
    llm.eval(prompt)
    grammar = Grammar(llm._model.vocab, c) if c.grammar else None
    out, margins, logprobs = [], [], []
    for _ in range(n_predict):
        row = reference_process(llm.scores[llm.n_tokens - 1], prompt + out, c, grammar)
        token = int(np.argmax(row))
        if token == llm.token_eos():
            break
        top2 = np.sort(row)[-2:]
        margins.append(float(top2[1] - top2[0]))
        logprobs.append(float(row[token]) - log_normaliser(row))
        out.append(token)
        if grammar is not None:
            grammar.accept(token)
        llm.eval([token])
    return out, margins, logprobs


CASES = {
    "bias": Constraints(logit_bias={262: 5.0, 263: -100.0, 2: -3.0}),
    "penalties": Constraints(frequency_penalty=0.8, presence_penalty=0.5, repeat_penalty=1.3, repeat_last_n=16),
    "grammar": Constraints(grammar=WORDS_GRAMMAR),
    "all": Constraints(logit_bias={264: 2.0}, frequency_penalty=0.4, repeat_penalty=1.1, grammar=WORDS_GRAMMAR),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identity_under_constraints(tiny_decoder, plain_target, case):
    constraints = CASES[case]
    decided = near_ties = 0
    for prompt in prompts(4, seed=7):
        expected, margins, _ = reference_greedy(plain_target, prompt, 40, constraints)
        for k in KS:
            got = tiny_decoder.generate(prompt, n_predict=40, n_draft=k, temperature=0, constraints=constraints)
            if differs_at_near_tie(got.tokens, expected, margins):
                near_ties += 1
                continue
            assert got.tokens == expected, f"{case} K={k}: first difference at {first_difference(got.tokens, expected)}"
            decided += 1
    assert decided >= 0.8 * (decided + near_ties), (decided, near_ties)


def test_constraints_change_the_output(tiny_decoder):
    """The cases above would pass vacuously if the constraints did nothing."""
    prompt = prompts(1, seed=7)[0]
    plain = tiny_decoder.generate(prompt, n_predict=40, n_draft=3, temperature=0).tokens
    for case, constraints in CASES.items():
        assert tiny_decoder.generate(prompt, n_predict=40, n_draft=3, temperature=0,
                                     constraints=constraints).tokens != plain, case


def test_grammar_output_matches_the_grammar(tiny_decoder):
    for k in (0, 3, "auto"):
        text = tiny_decoder.generate(prompts(1, seed=3)[0], n_predict=30, n_draft=k,
                                     constraints=CASES["grammar"]).text
        words = text.split(" ")[1:]
        assert text.startswith(" ") and len(words) >= 2 and len(words) % 2 == 0, (k, text)
        assert all(w in ("the", "a") for w in words[0::2]) and all(w in ("cat", "dog", "mat") for w in words[1::2]), (k, text)


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_targets_for_every_token(tiny_decoder, plain_target, k):
    """Draft-accepted tokens included (llama-server reports 0.0 for them)."""
    constraints = CASES["bias"]
    prompt = prompts(1, seed=11)[0]
    expected, margins, expected_logprobs = reference_greedy(plain_target, prompt, 40, constraints)
    got = list(tiny_decoder.stream(prompt, n_predict=40, n_draft=k, constraints=constraints, logprobs=3))
    n = first_difference([p.token for p in got], expected) or len(expected)
    assert n > 5
    assert np.allclose([p.logprob for p in got[:n]], expected_logprobs[:n], atol=5e-3)
    for piece in got:
        tops = piece.top_logprobs
        assert len(tops) == 3 and [lp for _, lp in tops] == sorted((lp for _, lp in tops), reverse=True)
        assert piece.logprob <= tops[0][1] + 1e-6
    if k:
        assert any(p.from_draft for p in got)


def test_no_logprobs_unless_asked(tiny_decoder):
    piece = next(iter(tiny_decoder.stream("the cat", n_predict=2, n_draft=2)))
    assert piece.logprob is None and piece.top_logprobs == ()
    piece = next(iter(tiny_decoder.stream("the cat", n_predict=2, n_draft=2, logprobs=0)))
    assert piece.logprob is not None and piece.top_logprobs == ()


# ---------------------------------------------------------------- sampling: chi-square

PROMPT = [1, 261, 262, 263]
DRAWS = 3000
SAMPLED = Constraints(logit_bias={265: 3.0, 266: -2.0}, frequency_penalty=1.0, presence_penalty=0.5,
                      repeat_penalty=1.5, grammar=WORDS_GRAMMAR)


def exact_processed(llm, params, c: Constraints, before: tuple[int, ...] = ()):
    """p(first) and p(first, second) of the target alone after the constraints, the prompt and `before`."""
    def dist_after(prefix):
        prefix = list(before) + prefix
        llm.reset()
        llm.eval(PROMPT + prefix)
        grammar = Grammar(llm._model.vocab, c)
        for token in prefix:
            grammar.accept(token)
        row = reference_process(llm.scores[llm.n_tokens - 1], PROMPT + prefix, c, grammar)
        grammar.close()
        return distribution(row, params)
    return first_and_second(dist_after)


@pytest.mark.parametrize("k, top_k", [(1, 0), (3, 0), (3, 2)])  # top-k: the grammar checks the best few first
def test_sampling_matches_the_constrained_target(tiny_decoder, plain_target, k, top_k):
    """The first token (the prompt's batch decides it) against p, and the next two, which a step of drafts
    decides, against p(second, third) given the likeliest first (reference.sampling_pvalues)."""
    params = SamplingParams(temperature=1.5, top_k=top_k, top_p=1.0, min_p=0.0)
    p1, _ = exact_processed(plain_target, params, SAMPLED)
    x = int(np.argmax(p1))
    _, joint = exact_processed(plain_target, params, SAMPLED, (x,))
    samples, drafted = seeded_samples(tiny_decoder, PROMPT, k, DRAWS, temperature=1.5, top_k=top_k, top_p=1.0,
                                      min_p=0.0, constraints=SAMPLED)
    assert drafted > DRAWS
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


# ---------------------------------------------------------------- bad input, one line each

@pytest.mark.parametrize("kwargs, says", [
    ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be in [-2, 2]"),
    ({"repeat_penalty": 0.0}, "repeat_penalty must be > 0"),
    ({"repeat_last_n": -2}, "repeat_last_n must be >= -1"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias must map token ids to numbers"),
    ({"logit_bias": {5: "x"}}, "logit_bias must map token ids to numbers"),
    ({"frequency_penalty": None}, "frequency_penalty must be a number"),
    ({"repeat_last_n": 2.5}, "repeat_last_n must be a whole number"),
    ({"grammar": 5}, "grammar and grammar_root must be texts"),
    ({"grammar": 'root ::= "a"', "grammar_patterns": ("(",)}, "is not a regular expression"),
    ({"grammar": 'root ::= "a"', "grammar_patterns": ("a{2,1}",)}, "is not a regular expression"),
    ({"grammar": 'root ::= "a"', "grammar_patterns": ("(?P<n>a)",)}, "ECMAScript"),  # std::regex aborted on these
    ({"grammar": 'root ::= "a"', "grammar_patterns": ("(?<=a)b",)}, "ECMAScript"),
    ({"grammar": 'root ::= "a"', "grammar_patterns": ("a{,3}",)}, "ECMAScript"),  # std::regex throws: an abort
    ({"grammar": 'root ::= "a"', "grammar_patterns": (r"\Aab",)}, "ECMAScript"),
    ({"grammar": 'root ::= "a"', "grammar_patterns": (r"\u00e9",)}, "as the character itself"),
    ({"grammar": 'root ::= "a"', "grammar_patterns": "ab"}, "a sequence of regular expressions"),
    ({"grammar": 'root ::= "a"', "grammar_trigger_tokens": (-1,)}, "grammar_trigger_tokens must be token ids"),
])
def test_bad_constraints_are_one_line(kwargs, says):
    with pytest.raises(GgufspecError, match=None) as caught:
        Constraints(**kwargs)
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("grammar, says", [
    ("root ::= (unclosed", "expecting ')' at"), ("a,b", "expecting ::= at ,b"),
    ('root ::= "a"{3000}', "number of repetitions exceeds sane defaults"), ("root ::= x", "Undefined rule identifier 'x'"),
    ('other ::= "a"', "grammar does not contain a 'root' symbol"),
    ('root ::= root "a"', "left recursion detected for nonterminal at index 0")])
def test_a_grammar_that_does_not_parse_says_why_in_one_line_and_nothing_else(tiny_decoder, capfd, grammar, says):
    """llama.cpp's parser prints its reason (and the grammar) to fd 2: the error said only to set
    GGUFSPEC_VERBOSE, below the parser's report already on the terminal (audit). Its reason is the error's now."""
    with pytest.raises(GgufspecError) as caught:
        tiny_decoder.generate("the", n_predict=4, constraints=Constraints(grammar=grammar))
    assert str(caught.value).startswith("the grammar does not parse: ") and says in str(caught.value)
    assert "\n" not in str(caught.value) and capfd.readouterr().err == ""


def test_what_else_reaches_fd_2_while_a_grammar_is_read_is_passed_on(tiny_decoder, capfd):
    """Another thread's lines, before and after the parser's report, go on to fd 2 (review); the report does not."""
    from ggufspec.grammar import parser_said
    with parser_said("a,b") as said:
        os.write(2, b"before\nparse: error parsing grammar: expecting ::= at ,b\n\na,b\nafter\n")
    assert said.reason == "expecting ::= at ,b" and capfd.readouterr().err == "before\nafter\n"


def test_a_grammar_is_read_with_fd_2_closed_and_with_an_error_inside(tiny_decoder, capfd):
    """A server started with 2>&- : os.dup(2) failed on every constrained request (review)."""
    from ggufspec.grammar import parser_said
    saved = os.dup(2)
    os.close(2)
    try:
        with parser_said("root ::= x") as said:
            pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert said.reason == ""
    with pytest.raises(KeyError):
        with parser_said("root ::= x"):
            os.write(2, b"kept\n")
            raise KeyError("inside")
    assert capfd.readouterr().err == "kept\n"


def test_bad_grammar_and_vocabulary_errors(tiny_decoder):
    with pytest.raises(GgufspecError, match="grammar does not parse"):
        tiny_decoder.generate("the", n_predict=4, constraints=Constraints(grammar="root ::= (unclosed"))
    with pytest.raises(GgufspecError, match="vocabulary has"):
        tiny_decoder.generate("the", n_predict=4, constraints=Constraints(logit_bias={10**6: 1.0}))
    with pytest.raises(GgufspecError, match="logprobs must be between 0 and 20"):
        tiny_decoder.generate("the", n_predict=4, logprobs=21)
    assert tiny_decoder.generate("the cat", n_predict=4, n_draft=2).tokens  # still usable


# ---------------------------------------------------------------- drafts guided by the same constraints

@pytest.mark.parametrize("case", ["grammar", "all"])
def test_guided_drafts_are_kept_more_often_and_change_nothing(tiny_decoder, monkeypatch, case):
    """The draft model's rows get the request's bias, penalties and grammar mask (processing.DraftGuide):
    the same text as unguided drafts, and more of the drafted tokens kept."""
    def run():
        accepted = drafted = 0
        outputs = []
        for prompt in prompts(4, seed=11):
            got = tiny_decoder.generate(prompt, n_predict=40, n_draft=3, temperature=0, constraints=CASES[case])
            outputs.append(got.tokens)
            accepted, drafted = accepted + got.stats.n_accept, drafted + got.stats.n_drafted
        return outputs, accepted / drafted
    guided, guided_rate = run()
    monkeypatch.setattr(TargetJudge, "draft_guide", lambda self: None)
    unguided, unguided_rate = run()
    assert guided == unguided
    assert guided_rate > unguided_rate + 0.1, (guided_rate, unguided_rate)


def test_an_ngram_proposal_stops_where_the_grammar_forbids(tiny_decoder):
    judge = TargetJudge(tiny_decoder.target, SamplingParams(temperature=0), CASES["grammar"])
    guide = judge.draft_guide()
    valid = tiny_decoder.generate(prompts(1, seed=3)[0], n_predict=30, n_draft=0, temperature=0,
                                  constraints=CASES["grammar"]).tokens
    first_row = np.zeros(tiny_decoder.target.n_vocab, np.float32)
    allowed_first = Grammar(tiny_decoder.target.vocab, CASES["grammar"]).allows(np.arange(len(first_row)), first_row)
    forbidden = int(np.flatnonzero(~allowed_first)[0])
    assert guide.allowed_prefix(valid) == len(valid)
    middle = len(valid) // 2
    assert middle >= 1 and guide.allowed_prefix(valid[:middle] + [forbidden] + valid[middle:]) == middle
    assert guide.allowed_prefix([forbidden] + valid) == 0
    judge.close()


@pytest.mark.parametrize("k", [1, 3])
def test_a_grammar_with_top_k_off_never_feeds_it_a_forbidden_draft_token(tiny_decoder, k):
    """With top-k off the draft's row is not masked by the grammar (a full check costs more than a
    draft token): a forbidden proposal reached the grammar's accept, and llama.cpp aborted the process
    ("Unexpected empty grammar stack"). The seeded answer is the target alone's."""
    c = Constraints(grammar='root ::= [a-c]+ "."')
    same = 0
    for seed in range(4):
        options = dict(n_predict=12, temperature=1.5, top_k=0, seed=seed, constraints=c)
        alone = tiny_decoder.generate("the cat", n_draft=0, **options)
        drafted = tiny_decoder.generate("the cat", n_draft=k, **options)
        assert set(drafted.text) <= set("abc.") and drafted.stats.n_drafted > 0
        same += drafted.tokens == alone.tokens  # (batch rounding may move a draw across a boundary)
    assert same >= 3
