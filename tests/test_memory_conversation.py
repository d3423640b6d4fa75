"""Conversations on memory that cannot simply drop a suffix (recurrent: Mamba; hybrid: LFM2; a
sliding window: Gemma 2) keep their memory: a next turn reuses the previous turn's prompt and answer,
also where it leaves the answer near its end (a stop string) or asks the last question again
differently, and its answer is the one the target alone gives from a fresh context.

The tiny models' answers are random bytes, which come back from a client as other tokens (U+FFFD);
a real model's answer comes back as the tokens it generated. So turn one is kept to printable ASCII
bytes that tokenize back to themselves, and the chat template renders an answer right after the
generation prompt (tinymodels.CONTINUING_CHAT_TEMPLATE), as ChatML does."""
import functools
import itertools

import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.load import LoadParams, open_model
from ggufspec.processing import Constraints
from ggufspec.tinymodels import CONTINUING_CHAT_TEMPLATE, make_gemma2_pair, make_lfm2_pair, make_mamba_pair
from reference import NEAR_TIE, first_difference, target_alone

ATTENTION = "off"  # the target alone as the decoders load it: -fa auto is off on a CPU
N_CTX = 512
REUSED = 0.8  # of turn one's tokens (prompt and answer), at least
FIRST = [{"role": "user", "content": " the cat sat on the mat and the dog ran"}]
N_VOCAB = 281  # tinymodels.vocabulary(): 3 control tokens, 256 bytes, 22 words
# bytes that are not themselves words ("(", ")", ":") and not a space (which tokenizes as "▁")
ROUND_TRIP = {3 + b for b in range(0x21, 0x7F)} - {3 + ord(c) for c in "():"}
NOT_ROUND_TRIP = [t for t in range(N_VOCAB) if t not in ROUND_TRIP]  # end of text included: 40 tokens
ANSWERS_AS_TEXT = Constraints(logit_bias={t: float("-inf") for t in NOT_ROUND_TRIP})
MAKERS = {"mamba": make_mamba_pair, "lfm2": make_lfm2_pair, "gemma2": make_gemma2_pair}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def pair(request, tmp_path_factory):
    return request.param, MAKERS[request.param](tmp_path_factory.mktemp(request.param),
                                                chat_template=CONTINUING_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def decoder(pair):
    _, (target_path, draft_path) = pair
    params = LoadParams(n_ctx=N_CTX, n_threads=1, n_batch=64)  # gemma 2: a 256-cell window cache
    target, draft = open_model(target_path, "target", params), open_model(draft_path, "draft", params)
    with SpeculativeDecoder(target, draft) as dec:
        yield dec
    target.close()
    draft.close()


def check_target_alone(path, prompt, got):
    expected, margins, _ = target_alone(path, prompt, len(got.tokens), N_CTX, ATTENTION)
    diff = first_difference(got.tokens, expected[:len(got.tokens)])
    assert diff is None or margins[diff] < NEAR_TIE, f"first difference at {diff}"


def turn_one(decoder, n_draft):
    decoder.target.keep(0)  # a conversation from scratch
    return decoder.chat(FIRST, n_predict=40, n_draft=n_draft, temperature=0, constraints=ANSWERS_AS_TEXT)


def turn_two(decoder, first_answer: str, user: str = " and the dog", **options):
    """The conversation's next turn: its prompt tokens and the answer."""
    messages = FIRST + [{"role": "assistant", "content": first_answer}, {"role": "user", "content": user}]
    tokens = decoder.tokenize(decoder.render_chat(messages))
    options.setdefault("n_predict", 24)
    return tokens, decoder.generate(tokens, temperature=0, **options)


def reuse(first, second) -> float:
    return second.stats.n_prompt_cached / (first.stats.n_prompt + len(first.tokens))


@pytest.mark.parametrize("n_draft", [3, 0, "auto"])
def test_turn_two_reuses_the_answer_and_is_the_target_alone(pair, decoder, n_draft):
    name, (target_path, _) = pair
    first = turn_one(decoder, n_draft)
    assert len(first.tokens) == 40
    tokens, second = turn_two(decoder, first.text, n_draft=n_draft)
    print(f"{name} K={n_draft}: turn two reused {reuse(first, second):.0%} of turn one")
    assert reuse(first, second) >= REUSED
    check_target_alone(target_path, tokens, second)


@pytest.mark.parametrize("n_draft", [4, 0])
def test_a_stop_string_leaves_the_answer_near_its_end(pair, decoder, n_draft):
    """A client that stops reading at a stop string leaves the cache past the answer it keeps: the next
    turn branches off at a state saved before one of the last steps, not where the prompt ended."""
    name, (target_path, _) = pair
    decoder.target.keep(0)
    stream = decoder.stream(decoder.render_chat(FIRST), n_predict=40, n_draft=n_draft, temperature=0,
                            constraints=ANSWERS_AS_TEXT)
    pieces = list(itertools.islice(stream, 30))
    stream.close()
    n_prompt = decoder.last_stats.n_prompt
    answer = "".join(p.text for p in pieces[:-3])  # the stop string: its last three tokens
    drafted_before = decoder.draft.n_evaluated
    tokens, second = turn_two(decoder, answer, n_draft=n_draft)
    reused = second.stats.n_prompt_cached / (n_prompt + len(pieces))
    print(f"{name} K={n_draft}: after a stop string, turn two reused {reused:.0%} of turn one")
    assert reused >= REUSED
    assert decoder.draft.n_evaluated - drafted_before < len(tokens)  # the draft did not start over either
    check_target_alone(target_path, tokens, second)


def test_the_last_question_asked_again_branches_off_after_the_answer(pair, decoder):
    """Turn two asked again differently (a chat's edited message): the state where turn one's answer
    ended was kept when turn two branched off there."""
    name, (target_path, _) = pair
    first = turn_one(decoder, 3)
    turn_two(decoder, first.text, n_draft=3)
    tokens, again = turn_two(decoder, first.text, user=" a cat ran on", n_draft=3)
    print(f"{name}: turn two asked again reused {reuse(first, again):.0%} of turn one")
    assert reuse(first, again) >= REUSED
    check_target_alone(target_path, tokens, again)


def test_a_window_model_branches_off_after_the_answer_past_its_window(pair, decoder):
    """Gemma 2: turn two's long answer moves the window cache (256 cells) past turn one's answer;
    asked again differently, turn two restores the checkpoint kept where it branched off."""
    name, (target_path, _) = pair
    if name != "gemma2":
        pytest.skip("a sliding-window model's case")
    first = turn_one(decoder, 3)
    turn_two(decoder, first.text, n_draft=3, n_predict=300)
    tokens, again = turn_two(decoder, first.text, user=" a cat ran on", n_draft=3)
    print(f"{name}: past the window, turn two asked again reused {reuse(first, again):.0%} of turn one")
    assert reuse(first, again) >= REUSED
    check_target_alone(target_path, tokens, again)


def test_served_chat_with_a_stop_string_reuses_the_answer(tmp_path):
    """Through `ggufspec serve` (chat completions, OpenAI's usage): a Mamba pair's turn one stopped by
    a stop string, turn two reports most of turn one as cached, and answers as the target alone does
    from a fresh context."""
    from serverproc import serving
    target, draft = make_mamba_pair(tmp_path, chat_template=CONTINUING_CHAT_TEMPLATE)
    as_text = {"logit_bias": [[t, False] for t in NOT_ROUND_TRIP]}
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", str(N_CTX), "--draft", "3") as server:
        client = server.client()
        ask = functools.partial(client.chat.completions.create, model="mamba-target", temperature=0)
        unstopped = ask(messages=FIRST, max_tokens=40, extra_body=as_text).choices[0].message.content
        stop = next(unstopped[i:i + 6] for i in range(28, 34) if unstopped.find(unstopped[i:i + 6]) == i)
        one = ask(messages=FIRST, max_tokens=40, extra_body=as_text, stop=[stop])
        assert one.choices[0].finish_reason == "stop" and len(one.choices[0].message.content) >= 28
        conversation = FIRST + [{"role": "assistant", "content": one.choices[0].message.content},
                                {"role": "user", "content": " and the dog"}]
        two = ask(messages=conversation, max_tokens=24)
    cached = two.usage.prompt_tokens_details.cached_tokens
    print(f"served mamba: after a stop string, turn two reused {cached} of {one.usage.total_tokens} tokens of turn one")
    assert cached >= REUSED * one.usage.total_tokens
    with SpeculativeDecoder(target, None, n_ctx=N_CTX, n_threads=1) as alone:
        tokens = alone.tokenize(alone.render_chat(conversation))
        expected = alone.generate(tokens, n_predict=24, n_draft=0, temperature=0)
    assert two.choices[0].message.content == expected.text


def test_the_same_prompt_again_reuses_all_but_its_last_token(pair, decoder):
    """A prompt evaluated alone first (an editor warming the cache: n_predict 0), then asked for an
    answer, then asked again: each time all of it but the last token comes from the state kept one
    token short (QA: a recurrent or hybrid model evaluated it whole every time), and the answer is the
    target alone's."""
    name, (target_path, _) = pair
    decoder.target.keep(0)
    prompt = decoder.tokenize(" the cat sat on the mat and the dog ran" * 3)
    decoder.generate(prompt, n_predict=0)
    for _ in range(2):
        got = decoder.generate(prompt, n_predict=12, n_draft=3, temperature=0)
        assert got.stats.n_prompt_cached == len(prompt) - 1, (name, got.stats.n_prompt_cached, len(prompt))
        check_target_alone(target_path, prompt, got)
