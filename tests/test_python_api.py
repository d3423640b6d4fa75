"""The Python API misused as a newcomer might (a QA pass): each mistake one GgufspecError, never a
segfault or a silently wrong answer; and what it promises kept (the system message, a session's
n-gram drafting, a Llama object given back empty)."""
from __future__ import annotations

import llama_cpp
import math

import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.errors import GgufspecError


@pytest.fixture
def decoder(tiny_pair):
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as opened:
        yield opened


def test_a_closed_decoder_says_so_instead_of_crashing(tiny_pair):
    decoder = SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1)
    left_open = decoder.stream("the cat", n_predict=40, n_draft=0)
    next(left_open)
    never_read = decoder.stream("the dog", n_predict=4)  # made before close, read after it
    decoder.close()
    calls = [lambda: decoder.chat([{"role": "user", "content": "hi"}]), lambda: decoder.generate_many(["a"]),
             lambda: decoder.tokenize("a"), lambda: decoder.render_chat([{"role": "user", "content": "hi"}]),
             lambda: decoder.n_layer, lambda: decoder.generate("a"), lambda: list(left_open),
             lambda: list(never_read)]
    for call in calls:
        with pytest.raises(GgufspecError, match="closed"):
            call()


def test_a_stream_paused_within_a_steps_kept_drafts_stops_at_close_too(tiny_pair):
    """Paused after an accepted draft, with more of the step's tokens to give: close() must not let
    the next ones read the freed vocabulary (review)."""
    decoder = SpeculativeDecoder(*tiny_pair, n_ctx=512, n_threads=1)
    stream = decoder.stream("the cat sat on the mat", n_predict=60, n_draft=4, temperature=0)
    assert any(piece.from_draft for piece in stream), "no draft accepted: the case is not reached"
    decoder.close()
    with pytest.raises(GgufspecError, match="closed"):
        next(stream)


def test_a_stream_left_behind_by_another_generation_stops_instead_of_going_wrong(decoder):
    first = decoder.stream("the cat", n_predict=40, n_draft=0)
    next(first)
    decoder.generate("a dog sat", n_predict=8, n_draft=3)
    with pytest.raises(GgufspecError, match="another generation began"):
        list(first)
    again = decoder.generate("the cat", n_predict=16, n_draft=3, temperature=0)  # the decoder is fine
    with SpeculativeDecoder(tiny_pair_target(decoder), n_ctx=512, n_threads=1) as alone:
        assert again.tokens == alone.generate("the cat", n_predict=16, n_draft=0, temperature=0).tokens


def tiny_pair_target(decoder) -> str:
    return decoder.target_llm.model_path


@pytest.mark.parametrize("options, says", [
    ({"top_k": 1.5}, "top_k must be a whole number"), ({"temperature": "0.7"}, "temperature"),
    ({"seed": 1.5}, "seed must be a whole number"), ({"logprobs": True}, "logprobs"),
    ({"system": "be brief"}, "chat=True"), ({"seed": -2}, "seed must be >= 0"),
])
def test_bad_arguments_are_one_line_errors(decoder, options, says):
    with pytest.raises(GgufspecError, match=says):
        decoder.generate("the cat", n_predict=4, **options)


@pytest.mark.parametrize("prompt, says", [(b"the cat", "got bytes"), ("", "empty"), (5, "got int"),
                                          ({5: "x"}, "got dict")])
def test_a_prompt_that_is_no_prompt_is_refused(decoder, prompt, says):
    with pytest.raises(GgufspecError, match=says):
        decoder.generate(prompt, n_predict=4)
    with pytest.raises(GgufspecError, match=says):  # one of several too
        decoder.generate_many(["the cat", prompt], n_predict=4)


def test_chat_true_with_a_prompt_of_token_ids_is_refused_not_ignored(decoder):
    """A list of ids is the prompt as it is: there is no text to render through the template, and the
    answer given without it silently was not the one asked for."""
    ids = decoder.tokenize("the cat")
    for call in (lambda: decoder.generate(ids, chat=True, n_predict=4),
                 lambda: decoder.generate_many(["the cat", ids], chat=True, n_predict=4)):
        with pytest.raises(GgufspecError, match="chat=True renders a text"):
            call()


def test_constraints_and_models_of_the_wrong_kind_are_one_line_errors(decoder, tiny_pair):
    from ggufspec.processing import Constraints
    for constraints in ("x", {}, 5):
        with pytest.raises(GgufspecError, match="constraints must be a ggufspec.Constraints"):
            decoder.generate("the cat", n_predict=4, constraints=constraints)
    with pytest.raises(GgufspecError, match="logit_bias bans every token"):
        decoder.generate("the cat", n_predict=4, n_draft=2,
                         constraints=Constraints(logit_bias=dict.fromkeys(range(decoder.target.n_vocab), -math.inf)))
    with pytest.raises(GgufspecError, match="the target model must be a GGUF path or a llama_cpp.Llama"):
        SpeculativeDecoder(5, tiny_pair[1])
    assert decoder.generate("the cat", n_predict=4, n_draft=2).tokens  # still usable


def test_render_chat_checks_its_messages_and_says_when_there_is_no_template(decoder, tmp_path):
    from ggufspec.tinymodels import Shape, make_weights, write_model
    for messages in ("x", [1], []):
        with pytest.raises(GgufspecError, match="messages must be a non-empty list"):
            decoder.render_chat(messages)
    shape = Shape(eos_bias=4.0)
    bare = write_model(tmp_path / "bare.gguf", shape, make_weights(shape, 0), chat_template=None)
    with SpeculativeDecoder(bare, n_ctx=256, n_threads=1) as without_template:
        with pytest.warns(UserWarning, match="no chat template: the conversation is rendered as ChatML"):
            assert "<|im_start|>user" in without_template.render_chat([{"role": "user", "content": "hi"}])


GEMMA2_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
               "{{ raise_exception('System role not supported') }}{% endif %}"
               "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
               "{% endfor %}<start_of_turn>model\n")


def test_a_template_without_a_system_role_gets_the_system_message_in_the_first_user_turn(tmp_path):
    """Gemma 2's template raises on a system message (and so on the tools' system prompt a template
    that renders no tools is given): llama.cpp puts it in front of the next user message; so does this."""
    from ggufspec import tools as toolkit
    from ggufspec.tinymodels import Shape, make_weights, write_model
    shape = Shape(eos_bias=4.0)
    path = write_model(tmp_path / "gemma2-like.gguf", shape, make_weights(shape, 0), chat_template=GEMMA2_LIKE)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    with SpeculativeDecoder(path, n_ctx=256, n_threads=1) as decoder:
        assert decoder.render_chat(conversation).endswith(
            "<start_of_turn>user\nbe brief\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
            "<start_of_turn>user\nand?<end_of_turn>\n<start_of_turn>model")
        tools = toolkit.check_tools([{"type": "function", "function": {"name": "now"}}])
        fmt = toolkit.detect_format(GEMMA2_LIKE)
        with_tools = decoder.render_chat(toolkit.prepare_messages(conversation[1:2], fmt, tools))
        assert with_tools.count("<start_of_turn>user") == 1 and "<tool_call>" in with_tools and with_tools.count("hi<end") == 1
        with pytest.raises(GgufspecError, match="refused these messages: System role not supported"):
            decoder.render_chat([{"role": "system", "content": [{"type": "text", "text": "x"}]},
                                 {"role": "user", "content": "hi"}])  # parts: nothing merged, the template's word


def test_seed_minus_one_is_random_as_in_the_cli(decoder):
    texts = {decoder.generate("the", n_predict=32, n_draft=0, temperature=1.0, seed=-1).text for _ in range(3)}
    assert len(texts) > 1


def test_chat_takes_a_system_message_and_refuses_a_second_template(decoder):
    hi = [{"role": "user", "content": "hi"}]
    plain = decoder.chat(hi, n_predict=1).stats.n_prompt
    assert decoder.chat(hi, n_predict=1, system="You are terse.").stats.n_prompt > plain
    with pytest.raises(GgufspecError, match="chat template already"):
        decoder.chat(hi, chat=True)
    with pytest.raises(GgufspecError, match="give one of them"):
        decoder.chat([{"role": "system", "content": "x"}, *hi], system="y")


def test_a_llama_given_is_reused_and_given_back_empty(tiny_pair):
    target, _ = tiny_pair
    llm = llama_cpp.Llama(str(target), n_ctx=512, n_threads=1, verbose=False)
    llm("the cat", max_tokens=4)  # used directly first: its cells hold that prompt
    with SpeculativeDecoder(llm, n_ctx=512, n_threads=1) as first:
        one = first.generate("a dog", n_predict=12, n_draft=0, temperature=0).tokens
    with SpeculativeDecoder(llm, n_ctx=512, n_threads=1) as second:
        assert second.generate("a dog", n_predict=12, n_draft=0, temperature=0).tokens == one
    llm("the cat", max_tokens=4)  # and usable directly again
    closed_first = SpeculativeDecoder(llm, n_ctx=512, n_threads=1)
    llm.close()
    closed_first.close()  # the Llama closed before its decoder: nothing touches its freed memory


def test_a_session_without_a_draft_model_drafts_by_n_gram_in_python_too(tiny_pair, tmp_path):
    from ggufspec.session import ModelOptions, open_session
    import shutil
    alone = tmp_path / "alone.gguf"
    shutil.copy(tiny_pair[0], alone)  # no draft beside it
    session = open_session(ModelOptions(model=str(alone), n_ctx=512, n_threads=1), log=lambda line: None)
    try:
        assert session.draft_choice["kind"] == "ngram"
        out = session.decoder.generate("the cat the cat the cat", n_predict=24, temperature=0)
        assert out.stats.drafter.startswith("lookup")
    finally:
        session.decoder.close()


def test_a_decoder_interrupted_by_ctrl_c_goes_on_right_afterwards(slow_target):
    """A notebook's interrupt: KeyboardInterrupt comes when llama_decode returns, before the Context
    had counted the tokens now in the cache, and the next generation's positions clashed with them
    (llama_decode failed with code -1). The Context now counts what the cache holds."""
    import os
    import signal
    import threading

    import llama_cpp
    with SpeculativeDecoder(slow_target, n_ctx=1024, n_threads=1) as alone:
        expected = alone.generate("the cat", n_predict=24, n_draft=0, temperature=0).tokens
    with SpeculativeDecoder(slow_target, n_ctx=1024, n_threads=1) as decoder:
        for delay in [0.05 + 0.037 * i for i in range(8)]:
            timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                decoder.generate("the dog ran", n_predict=100_000, n_draft=0)
            timer.join()
            target = decoder.target  # what the cache holds is what the Context counts
            assert llama_cpp.llama_memory_seq_pos_max(target.memory, target.seq) == len(target.tokens) - 1
            target.decode([1], n_logits=1)  # a decode right after (bench's cost sampling) finds its position
            assert decoder.generate("the cat", n_predict=24, n_draft=0, temperature=0).tokens == expected


def test_chat_passes_the_templates_variables(tmp_path):
    """Qwen3's enable_thinking=False: the template writes an empty thinking block, a longer prompt."""
    from test_server_reasoning import QWEN3_LIKE, reasoner
    hi = [{"role": "user", "content": "hi"}]
    with SpeculativeDecoder(str(reasoner(tmp_path, QWEN3_LIKE)), n_ctx=256, n_threads=1) as decoder:
        thinking = decoder.chat(hi, n_predict=1, n_draft=0).stats.n_prompt
        closed = decoder.chat(hi, template_variables={"enable_thinking": False}, n_predict=1, n_draft=0)
        assert closed.stats.n_prompt > thinking


def test_two_threads_generating_on_one_decoder_take_turns_instead_of_crashing(slow_target):
    """Each step holds the decoder (llama.cpp is not thread-safe): two threads' generations crashed the
    process (a GGML_ASSERT or a segfault, audit); now the later takes the decoder over, as in one thread,
    and the earlier stops with an error. The decoder goes on exactly afterwards."""
    import threading
    with SpeculativeDecoder(slow_target, slow_target, n_ctx=1024, n_threads=1) as decoder:
        expected = decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0).tokens
        outcomes, started = {}, threading.Barrier(2)

        def generate(prompt):
            started.wait()
            try:
                outcomes[prompt] = len(decoder.generate(prompt, n_predict=300, n_draft=3, temperature=0).tokens)
            except GgufspecError as exc:
                outcomes[prompt] = str(exc)
        threads = [threading.Thread(target=generate, args=(prompt,)) for prompt in ("the cat", "a dog ran")]
        [thread.start() for thread in threads]
        [thread.join(120) for thread in threads]
        assert sorted(map(type, outcomes.values()), key=str) == [int, str], outcomes
        assert "left behind" in next(v for v in outcomes.values() if isinstance(v, str))
        assert decoder.generate("the cat", n_predict=24, n_draft=3, temperature=0).tokens == expected


def test_close_from_another_thread_waits_for_the_step_then_stops_the_generation(slow_target):
    """close() freed the models under a step running in another thread: a segfault (audit)."""
    import threading
    import time
    decoder = SpeculativeDecoder(slow_target, slow_target, n_ctx=1024, n_threads=1)
    outcome = []

    def generate():
        try:
            outcome.append(len(decoder.generate("the cat", n_predict=5000, n_draft=3, temperature=0).tokens))
        except GgufspecError as exc:
            outcome.append(str(exc))
    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(0.3)
    decoder.close()
    thread.join(60)
    assert not thread.is_alive() and "closed" in outcome[0], outcome


@pytest.mark.parametrize("options, says", [({"temprature": 0.5}, "unknown generation option 'temprature': did you "
                                            "mean 'temperature'"), ({"stpo": ["x"]}, "did you mean 'stop'"),
                                           ({"stops": ["x"]}, "did you mean 'stop'")])
def test_an_unknown_generation_option_is_named_with_what_it_may_have_meant(decoder, options, says):
    """A typo raised a TypeError that named SamplingParams.__init__ (audit)."""
    with pytest.raises(GgufspecError, match=says):
        decoder.generate("the cat", n_predict=2, **options)


@pytest.mark.parametrize("field", ["n_ctx", "n_threads", "n_gpu_layers", "n_parallel"])
def test_a_count_given_as_text_or_a_fraction_is_one_line_error(tiny_pair, field):
    for value in ("2", 1.5):
        with pytest.raises(GgufspecError, match=f"{field} must be a whole number, got {value!r}"):
            SpeculativeDecoder(*tiny_pair, **{field: value})


def test_generate_many_in_one_thread_and_generate_or_close_in_another_take_turns(slow_target):
    """With several slots, slot 0 is the decoder's own sequence: a generate() from another thread decoded
    beside the slots' rounds, and close() freed them under it (review). generate_many holds the decoder."""
    import threading
    import time
    decoder = SpeculativeDecoder(slow_target, slow_target, n_ctx=1024, n_threads=1, n_parallel=2)
    expected = decoder.generate("the cat", n_predict=16, n_draft=3, temperature=0).tokens
    many = []
    worker = threading.Thread(target=lambda: many.extend(decoder.generate_many(
        ["the dog", "a cat"], n_predict=200, n_draft=3, temperature=0)))
    worker.start()
    time.sleep(0.3)
    alone = decoder.generate("the cat", n_predict=16, n_draft=3, temperature=0)  # waits for generate_many
    worker.join(120)
    assert [len(g.tokens) for g in many] == [200, 200] and alone.tokens == expected
    assert alone.stats.n_predict == 16  # its own statistics, not another generation's
    worker = threading.Thread(target=lambda: many.extend(decoder.generate_many(
        ["the dog", "a cat"], n_predict=200, n_draft=3, temperature=0)))
    worker.start()
    time.sleep(0.3)
    decoder.close()  # after generate_many
    worker.join(120)
    assert len(many) == 4 and not worker.is_alive()


def _greedy(decoder, **options):
    return decoder.generate("once upon a time", n_predict=40, temperature=0, **options)


def test_stop_ends_the_text_before_the_first_stop_string_as_llama_cpp_python_does(decoder):
    whole = _greedy(decoder, n_draft=0)
    assert len(whole.text) > 20 and whole.stats.stop_reason == "n_predict"
    stop = whole.text[12:15]  # may span tokens; the text ends before its first appearance
    ended = _greedy(decoder, n_draft=3, stop=[stop, "never there"])
    assert ended.text == whole.text[:whole.text.find(stop)] and ended.stats.stop_reason == "stop"
    assert ended.tokens == whole.tokens[:len(ended.tokens)] and ended.stats.n_predict <= len(whole.tokens)
    streamed = list(decoder.stream("once upon a time", n_predict=40, temperature=0, stop=stop))  # one string too
    assert "".join(piece.text for piece in streamed) == ended.text
    assert [piece.token for piece in streamed] == ended.tokens
    assert _greedy(decoder, stop=["never there", ""]).text == whole.text  # none found: all of it


def test_stop_in_generate_many_applies_to_each_prompt(decoder):
    prompts = ["the cat", "once upon a time"]
    alone = [decoder.generate(p, n_predict=30, temperature=0) for p in prompts]
    stops = [alone[0].text[8:10], alone[1].text[12:14]]
    both = decoder.generate_many(prompts, n_predict=30, temperature=0, stop=stops)
    for one, many in zip(alone, both):
        assert many.text == one.text[:min(i for s in stops if (i := one.text.find(s)) >= 0)]


def test_stop_none_is_no_stop_and_steps_says_it_takes_none(decoder):
    assert decoder.generate("once upon a time", n_predict=8, stop=None).stats.stop_reason != "stop"
    with pytest.raises(GgufspecError, match=r"steps\(\) does not take 'stop': stream\(\) does"):
        decoder.steps("the cat", n_predict=2, stop=["x"])


@pytest.mark.parametrize("stop", [5, [b"x"], {"x": 1}, ["x", None]])
def test_a_stop_that_is_not_strings_is_one_line_error(decoder, stop):
    with pytest.raises(GgufspecError, match="stop must be a string or a list of strings"):
        decoder.generate("the cat", n_predict=4, stop=stop)
