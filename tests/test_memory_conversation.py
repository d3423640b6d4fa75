"""Conversations on memory that cannot simply drop a suffix (recurrent: Mamba; hybrid: LFM2; a
sliding window: Gemma 2) keep their memory: a second turn reuses the first turn's prompt and its
answer, not only the prompt, and its answer is the one the target alone gives from a fresh context."""
import itertools

import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.load import LoadParams, open_model
from ggufspec.tinymodels import make_gemma2_pair, make_lfm2_pair, make_mamba_pair
from reference import NEAR_TIE, first_difference, target_alone

N_CTX = 512
REUSED = 0.8  # of turn one's tokens (prompt and answer), at least
FIRST = [{"role": "user", "content": "the cat sat on the mat and the dog ran"}]
MAKERS = {"mamba": make_mamba_pair, "lfm2": make_lfm2_pair, "gemma2": make_gemma2_pair}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def pair(request, tmp_path_factory):
    return request.param, MAKERS[request.param](tmp_path_factory.mktemp(request.param))


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
    expected, margins, _ = target_alone(path, prompt, len(got.tokens), N_CTX, "on")
    diff = first_difference(got.tokens, expected[:len(got.tokens)])
    assert diff is None or margins[diff] < NEAR_TIE, f"first difference at {diff}"


def turn_two(decoder, first_answer: str, user: str = "and the dog", **options):
    """The conversation's next turn: its prompt tokens and the answer."""
    messages = FIRST + [{"role": "assistant", "content": first_answer}, {"role": "user", "content": user}]
    tokens = decoder.tokenize(decoder.render_chat(messages))
    return tokens, decoder.generate(tokens, **options)


def reuse(first, second) -> float:
    return second.stats.n_prompt_cached / (first.stats.n_prompt + len(first.tokens))


@pytest.mark.parametrize("n_draft", [3, 0, "auto"])
def test_turn_two_reuses_the_answer_and_is_the_target_alone(pair, decoder, n_draft):
    name, (target_path, _) = pair
    decoder.target.keep(0)
    first = decoder.chat(FIRST, n_predict=40, n_draft=n_draft, temperature=0)
    tokens, second = turn_two(decoder, first.text, n_predict=24, n_draft=n_draft, temperature=0)
    print(f"{name} K={n_draft}: turn two reused {reuse(first, second):.0%} of turn one "
          f"({second.stats.n_prompt_cached} of {first.stats.n_prompt} + {len(first.tokens)})")
    assert reuse(first, second) >= REUSED
    check_target_alone(target_path, tokens, second)


def test_a_stream_closed_early_is_reused_up_to_what_was_read(pair, decoder):
    """A client that stops reading (a stop string) leaves the cache past its answer: the next turn
    branches off near where the answer it saw ended."""
    name, (target_path, _) = pair
    decoder.target.keep(0)
    stream = decoder.stream(decoder.render_chat(FIRST), n_predict=40, n_draft=4, temperature=0)
    pieces = list(itertools.islice(stream, 30))
    stream.close()
    first = decoder.last_stats
    assert len(pieces) > 10
    answer = "".join(p.text for p in pieces[:-3])  # the stop string: its last three tokens
    tokens, second = turn_two(decoder, answer, n_predict=24, n_draft=4, temperature=0)
    reused = second.stats.n_prompt_cached / (first.n_prompt + len(pieces))
    print(f"{name}: after a stream closed early, turn two reused {reused:.0%}")
    assert reused >= REUSED
    check_target_alone(target_path, tokens, second)


def test_a_new_last_message_branches_off_at_the_previous_answer(pair, decoder):
    """Turn two asked again with another question: the end of turn one's answer was kept."""
    name, (target_path, _) = pair
    decoder.target.keep(0)
    first = decoder.chat(FIRST, n_predict=40, n_draft=3, temperature=0)
    turn_two(decoder, first.text, n_predict=40, n_draft=3, temperature=0)
    tokens, again = turn_two(decoder, first.text, user="a cat ran on", n_predict=24, n_draft=3, temperature=0)
    print(f"{name}: the edited turn two reused {reuse(first, again):.0%} of turn one")
    assert reuse(first, again) >= REUSED
    check_target_alone(target_path, tokens, again)


def test_served_chat_turn_two_reuses_the_answer(tmp_path):
    """Through `ggufspec serve` (chat completions, OpenAI's usage): a Mamba pair's turn two reports
    most of turn one as cached, and answers as the target alone does."""
    from serverproc import serving
    target, draft = make_mamba_pair(tmp_path)
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", str(N_CTX)) as server:
        client = server.client()
        conversation = list(FIRST)
        one = client.chat.completions.create(model="target", messages=conversation, max_tokens=40, temperature=0)
        conversation += [{"role": "assistant", "content": one.choices[0].message.content},
                         {"role": "user", "content": "and the dog"}]
        two = client.chat.completions.create(model="target", messages=conversation, max_tokens=24, temperature=0)
    cached = two.usage.prompt_tokens_details.cached_tokens
    print(f"served mamba: turn two reused {cached / one.usage.total_tokens:.0%} of turn one")
    assert cached >= REUSED * one.usage.total_tokens
    with SpeculativeDecoder(target, None, n_ctx=N_CTX, n_threads=1) as alone:
        expected = alone.generate(alone.render_chat(conversation), n_predict=24, n_draft=0, temperature=0)
    assert two.choices[0].message.content == expected.text
