"""llama.cpp's DRY penalty (--dry-*, dry_* per request) stays lossless under speculation.

The reference is llama.cpp's own DRY sampler as llama-server runs it, apart from the engine: a fresh
sampler (llama_sampler_init_dry over the model's vocabulary) fed the whole sequence, prompt included,
then applied to the whole row; the target alone through plain llama-cpp-python, one token per eval.
"""
import ctypes
from collections import Counter

import llama_cpp
import numpy as np
import pytest

from ggufspec import SamplingParams
from ggufspec.dry import Dry
from ggufspec.errors import GgufspecError
from ggufspec.processing import Constraints, TargetJudge
from ggufspec.sampling import distribution
from reference import first_and_second, prompts, same_as_target_alone, sampling_pvalues, seeded_samples

KS = [0, 1, 2, 3, 5, "auto"]
NEWLINE, COLON = 3 + 0x0A, 3 + 0x3A  # the tiny vocabulary's byte tokens for two of the default breakers


def llamacpp_dry(vocab, row, history, c: Constraints) -> np.ndarray:
    """`row` through a fresh llama.cpp DRY sampler fed `history` (all of it: its ring keeps the window)."""
    breakers = [b.encode() for b in c.dry_sequence_breakers]
    sampler = llama_cpp.llama_sampler_init_dry(vocab, c.dry_multiplier, c.dry_base, c.dry_allowed_length,
                                               c.dry_penalty_last_n, (ctypes.c_char_p * len(breakers))(*breakers),
                                               len(breakers))
    for token in history:
        llama_cpp.llama_sampler_accept(sampler, int(token))
    data = (llama_cpp.llama_token_data * len(row))(
        *(llama_cpp.llama_token_data(id=i, logit=float(v), p=0.0) for i, v in enumerate(row)))
    array = llama_cpp.llama_token_data_array(data=data, size=len(row), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    llama_cpp.llama_sampler_free(sampler)
    out = np.empty(len(row), dtype=np.float32)
    out[[data[i].id for i in range(len(row))]] = [data[i].logit for i in range(len(row))]
    return out


SETTINGS = [Constraints(dry_multiplier=0.8),
            Constraints(dry_multiplier=1.5, dry_base=2.0, dry_allowed_length=1, dry_penalty_last_n=24),
            Constraints(dry_multiplier=0.5, dry_allowed_length=3, dry_penalty_last_n=200, dry_sequence_breakers=()),
            Constraints(dry_multiplier=2.0, dry_base=1.1, dry_sequence_breakers=(" cat", " the dog", "\n"))]


@pytest.mark.parametrize("c", SETTINGS, ids=["default", "short-window", "no-breakers", "word-breakers"])
def test_the_penalty_is_llamacpps_own_sampler_on_every_history(tiny_vocab_llm, c):
    """One sampler walked along histories that grow, are rewound and leave for others (as the target's and
    a draft's are) penalises each row as a fresh sampler fed that whole history does."""
    llm, vocab = tiny_vocab_llm
    rng = np.random.default_rng(3)
    dry = Dry.for_model(llm, vocab, c.dry_multiplier, c.dry_base, c.dry_allowed_length, c.dry_penalty_last_n,
                        c.dry_sequence_breakers)
    alphabet = [259, 260, 261, 262, 263, NEWLINE, COLON]
    history, changed = [1], 0
    for step in range(150):
        move = rng.random()
        if move < 0.15 and len(history) > 4:
            history = history[:int(rng.integers(1, len(history)))]  # a rewind
        elif move < 0.25:
            history = [1] + [int(t) for t in rng.choice(alphabet, int(rng.integers(5, 60)))]  # another sequence
        elif move < 0.6 and len(history) > 6:  # a repeat of an earlier stretch
            start = int(rng.integers(0, len(history) - 3))
            history = history + history[start:start + int(rng.integers(2, 8))]
        else:
            history = history + [int(t) for t in rng.choice(alphabet, int(rng.integers(1, 4)))]
        row = rng.normal(size=llama_cpp.llama_vocab_n_tokens(vocab)).astype(np.float32)
        ours = row.copy()
        dry.apply(ours, history)
        np.testing.assert_array_equal(ours, llamacpp_dry(vocab, row, history, c), err_msg=f"step {step}")
        changed += not np.array_equal(ours, row)
    assert changed > 15  # the histories do repeat (and the penalty was there to compare)


@pytest.fixture(scope="module")
def tiny_vocab_llm(tiny_pair):
    llm = llama_cpp.Llama(model_path=str(tiny_pair[0]), vocab_only=True, verbose=False)
    yield llm, llama_cpp.llama_model_get_vocab(llm.model)
    llm.close()


# ---------------------------------------------------------------- the target alone with DRY

DRY = Constraints(dry_multiplier=1.0, dry_allowed_length=1)
WITH_PENALTIES = Constraints(dry_multiplier=0.8, dry_penalty_last_n=-1, repeat_penalty=1.2, frequency_penalty=0.3)


def reference_row(llm, history, c: Constraints) -> np.ndarray:
    """The target alone's processed row after `history` (penalties in numpy, then llama.cpp's DRY)."""
    row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    if c.penalises:
        window = history[-c.repeat_last_n:] if c.repeat_last_n > 0 else history
        for token, count in Counter(window).items():
            logit = row[token] * c.repeat_penalty if row[token] <= 0 else row[token] / c.repeat_penalty
            row[token] = logit - count * c.frequency_penalty - c.presence_penalty
    window = llm.n_ctx() if c.dry_penalty_last_n == -1 else c.dry_penalty_last_n
    return llamacpp_dry(llm._model.vocab, row, history, Constraints(
        dry_multiplier=c.dry_multiplier, dry_base=c.dry_base, dry_allowed_length=c.dry_allowed_length,
        dry_penalty_last_n=window, dry_sequence_breakers=c.dry_sequence_breakers))


def reference_greedy(llm, prompt, n_predict, c: Constraints):
    llm.reset()
    llm.eval(prompt)
    out, margins = [], []
    for _ in range(n_predict):
        row = reference_row(llm, prompt + out, c)
        token = int(np.argmax(row))
        if token == llm.token_eos():
            break
        top2 = np.sort(row)[-2:]
        margins.append(float(top2[1] - top2[0]))
        out.append(token)
        llm.eval([token])
    return out, margins


@pytest.mark.parametrize("c", [DRY, WITH_PENALTIES], ids=["dry", "dry-and-penalties"])
def test_greedy_speculation_with_dry_is_the_target_alone(tiny_decoder, plain_target, c):
    decided = near_ties = changed = 0
    for prompt in prompts(4, seed=7):
        expected, margins = reference_greedy(plain_target, prompt, 40, c)
        changed += expected != tiny_decoder.generate(prompt, n_predict=40, n_draft=0, temperature=0).tokens
        for k in KS:
            got = tiny_decoder.generate(prompt, n_predict=40, n_draft=k, temperature=0, constraints=c)
            kept = same_as_target_alone(got, expected, margins, f"K={k}")  # False: it parted at a near-tie
            decided, near_ties = decided + kept, near_ties + (not kept)
    assert changed >= 2  # DRY changed what the target alone says
    assert decided >= 0.8 * (decided + near_ties), (decided, near_ties)


def test_drafts_guided_by_dry_are_kept_and_change_nothing(tiny_decoder, monkeypatch):
    """The draft model's rows get DRY over their own walk ahead (a sampler of their own): the same text as
    unguided drafts."""
    def run():
        return [tiny_decoder.generate(p, n_predict=40, n_draft=3, temperature=0, constraints=DRY).tokens
                for p in prompts(4, seed=11)]
    guided = run()
    monkeypatch.setattr(TargetJudge, "draft_guide", lambda self: None)
    assert run() == guided


# ---------------------------------------------------------------- sampling: chi-square

PROMPT = [1, 276, 273, 259, 166, 276, 273, 259]  # ends in a repeat of what the target says next: 166
SAMPLED = Constraints(dry_multiplier=1.5, dry_allowed_length=1)
DRAWS = 3000


def exact_with_dry(llm, params, c: Constraints, prompt: list[int]):
    """p(first) and p(first, second) after `prompt` of the target alone with DRY."""
    def dist_after(prefix):
        llm.reset()
        llm.eval(prompt + prefix)
        return distribution(reference_row(llm, prompt + prefix, c), params)
    return first_and_second(dist_after)


def test_sampling_with_dry_is_the_targets_distribution(tiny_decoder, plain_target):
    """The first token (the prompt's batch decides it) against p, and the next two, which a step of
    drafts decides, against p(second, third) given the likeliest first (reference.sampling_pvalues)."""
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    p1, _ = exact_with_dry(plain_target, params, SAMPLED, PROMPT)
    plain, _ = exact_with_dry(plain_target, params, Constraints(dry_multiplier=0.0), PROMPT)
    assert 0.5 * np.abs(p1 - plain).sum() > 0.3  # DRY moved the distribution (total variation 0.64)
    x = int(np.argmax(p1))
    _, joint = exact_with_dry(plain_target, params, SAMPLED, PROMPT + [x])
    samples, drafted = seeded_samples(tiny_decoder, PROMPT, 2, DRAWS, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                      constraints=SAMPLED)
    assert drafted > DRAWS
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3


# ---------------------------------------------------------------- bad values, one line each

@pytest.mark.parametrize("kwargs, says", [
    ({"dry_multiplier": float("inf")}, "dry_multiplier must be a finite number"),
    ({"dry_multiplier": "1"}, "dry_multiplier must be a number"),
    ({"dry_base": 0.9}, "dry_base must be a number >= 1"),
    ({"dry_allowed_length": -1}, "dry_allowed_length must be >= 0"),
    ({"dry_allowed_length": 1.5}, "dry_allowed_length must be a whole number"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n must be >= -1"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers must be a list of texts"),
    ({"dry_sequence_breakers": ["\n", 5]}, "dry_sequence_breakers must be a list of texts"),
])
def test_bad_dry_values_are_one_line(kwargs, says):
    with pytest.raises(GgufspecError) as caught:
        Constraints(**kwargs)
    assert says in str(caught.value) and "\n" not in str(caught.value)
