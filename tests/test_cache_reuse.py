"""Prompt-cache reuse across calls, the lazy draft prefill, and the knobs that reach the context."""
import pytest

from ggufspec import GgufspecError, SpeculativeDecoder
from ggufspec.costs import Costs
from reference import NEAR_TIE, first_difference, prompts, stops_at_call, target_alone


def check_identity(path, prompt, got, n_ctx, flash_attn="auto"):
    expected, margins, _ = target_alone(path, prompt, len(got.tokens), n_ctx, "on" if flash_attn == "on" else "off")
    diff = first_difference(got.tokens, expected[:len(got.tokens)])
    assert diff is None or margins[diff] < NEAR_TIE, f"first difference at {diff}"


def test_a_growing_conversation_evaluates_only_what_is_new(tiny_pair):
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        first = prompts(1, seed=3)[0]
        out1 = decoder.generate(first, n_predict=24, n_draft=3)
        assert out1.stats.n_prompt_cached == 0
        # the next turn: the whole history (prompt + answer) plus new tokens
        second = first + out1.tokens + [265, 266, 267]
        out2 = decoder.generate(second, n_predict=24, n_draft=3)
        assert out2.stats.n_prompt_cached == len(first) + len(out1.tokens) - 1  # all but the answer's last token
        check_identity(target, second, out2, decoder.n_ctx)
        # a different prompt keeps only the common prefix, and the output is still the target's
        other = first[:2] + [270, 271]
        out3 = decoder.generate(other, n_predict=24, n_draft=2)
        assert out3.stats.n_prompt_cached == 2
        check_identity(target, other, out3, decoder.n_ctx)
        # the same prompt again: everything but its last token is cached, the result is the same
        again = decoder.generate(other, n_predict=24, n_draft=2)
        assert again.stats.n_prompt_cached == len(other) - 1
        assert again.tokens == out3.tokens


def test_n_predict_0_puts_the_prompt_alone_into_the_caches(tiny_pair):
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1, strict=True) as decoder:
        prompt = prompts(1, seed=5)[0]
        warm = decoder.generate(prompt, n_predict=0, n_draft=3)
        assert (warm.tokens, warm.stats.stop_reason, warm.stats.n_prompt) == ([], "n_predict", len(prompt))
        after = decoder.generate(prompt, n_predict=16, n_draft=3)
        assert after.stats.n_prompt_cached == len(prompt) - 1
        check_identity(target, prompt, after, decoder.n_ctx)
        with pytest.raises(GgufspecError, match="n-predict must be >= 0"):
            decoder.generate(prompt, n_predict=-2)


def test_cache_prompt_false_evaluates_the_prompt_whole_and_answers_the_same(tiny_pair):
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1, strict=True) as decoder:
        prompt = prompts(1, seed=4)[0]
        first = decoder.generate(prompt, n_predict=20, n_draft=3)
        fresh = decoder.generate(prompt, n_predict=20, n_draft=3, cache_prompt=False)
        assert fresh.stats.n_prompt_cached == 0 and fresh.tokens == first.tokens
        assert decoder.generate(prompt, n_predict=20, n_draft=3).stats.n_prompt_cached == len(prompt) - 1


def test_a_stream_closed_early_leaves_the_cache_consistent(tiny_pair):
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        prompt = prompts(1, seed=5)[0]
        full = decoder.generate(prompt, n_predict=30, n_draft=4)
        stream = decoder.stream(prompt, n_predict=30, n_draft=4)
        for _ in range(7):
            next(stream)
        stream.close()  # mid-step: the draft may hold proposals the target never checked
        # what the cache holds is the true sequence (a step may have verified more than was read)
        assert decoder.target.tokens == (list(prompt) + full.tokens)[:decoder.target.n_past]
        assert decoder.generate(prompt, n_predict=30, n_draft=4).tokens == full.tokens


def test_auto_that_cannot_pay_never_touches_the_draft(tiny_pair):
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        # remembered costs of a machine where a batch of n costs n tokens: no draft could pay
        costs = decoder.costs["model"] = Costs()
        for n in (1, 4, 4, 4):
            costs.add_batch(n, n * 0.01)
        costs.add_batch(1, 0.01)
        costs.draft_times.append(0.005)
        out = decoder.generate(prompts(1, seed=9)[0] * 3, n_predict=40, n_draft="auto")
        assert out.stats.n_drafted == 0
        assert decoder.draft.n_past == 0  # no draft prefill, no catch-up
        check_identity(target, prompts(1, seed=9)[0] * 3, out, decoder.n_ctx)


def test_draft_zero_is_the_target_alone(tiny_decoder):
    out = tiny_decoder.generate([1, 260, 261], n_predict=10, n_draft=0)
    assert out.stats.n_drafted == 0 and out.stats.drafter == "none"


# auto on a CPU: off (`load.resolved_flash_attn`)
@pytest.mark.parametrize("setting,expected", [("on", 1), ("off", 0), ("auto", 0)])
def test_flash_attention_setting_reaches_the_context(tiny_pair, setting, expected):
    with SpeculativeDecoder(tiny_pair[0], None, n_ctx=128, n_threads=1, flash_attn=setting) as decoder:
        assert decoder.target_llm.context_params.flash_attn_type == expected


def test_bad_flash_attention_setting_is_one_line(tiny_pair):
    with pytest.raises(GgufspecError, match="-fa/--flash-attn takes on, off or auto"):
        SpeculativeDecoder(tiny_pair[0], None, flash_attn="maybe")


def test_chat_renders_the_template_and_reuses_the_cache(tmp_path):
    from ggufspec.tinymodels import Shape, make_pair
    target, draft = make_pair(tmp_path, seed=0, shape=Shape(eos_bias=4.0))
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        assert decoder.target_llm.metadata.get("tokenizer.chat_template")  # make_pair writes one
        history = [{"role": "user", "content": "the cat sat"}]
        first = decoder.chat(history, n_predict=12, n_draft=3)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and the dog"}]
        second = decoder.chat(history, n_predict=12, n_draft=3)
        assert second.stats.n_prompt_cached > 0


def test_a_closed_decoder_says_so(tiny_pair):
    decoder = SpeculativeDecoder(tiny_pair[0], None, n_ctx=128, n_threads=1)
    decoder.close()
    with pytest.raises(GgufspecError, match="closed"):
        decoder.generate([1, 260], n_predict=4)


def test_a_long_prompt_stops_between_its_chunks_and_the_cache_stays_true(tiny_pair):
    """`Context.should_stop` (a server's client gone) stops a prompt's evaluation between two n_batch
    chunks: nothing is generated, the statistics say interrupted, and the next request reuses what
    was evaluated and gets the answer the target alone gives."""
    from ggufspec import SpeculativeDecoder
    target, draft = tiny_pair
    prompt = [1] + [259 + (7 * i) % 22 for i in range(1400)]
    with SpeculativeDecoder(target, draft, n_ctx=2048, n_threads=1) as decoder:
        decoder.target.should_stop = stops_at_call(2)  # asked before each chunk: the first goes in
        assert list(decoder.stream(prompt, n_predict=8, n_draft=3)) == []
        assert decoder.last_stats.stop_reason == "interrupted" and decoder.target.n_past == decoder.target.n_batch
        decoder.target.should_stop = None
        again = decoder.generate(prompt, n_predict=16, n_draft=3, temperature=0)
        assert again.stats.n_prompt_cached == decoder.target.n_batch
    with SpeculativeDecoder(target, n_ctx=2048, n_threads=1) as alone:
        assert again.tokens == alone.generate(prompt, n_predict=16, n_draft=0, temperature=0).tokens


def test_a_draft_models_long_catch_up_stops_between_its_chunks_too(tiny_pair):
    """The draft model catches up on a long prompt when it next drafts (the target's prefill does
    not wait for it). Where its caller says stop (a server's client gone), it stops between chunks,
    proposes nothing (the target goes on alone, its answer the same), and catches up on the rest later."""
    from ggufspec import SpeculativeDecoder
    from ggufspec.drafting import ModelDrafter
    from ggufspec.sampling import Draws, SamplingParams
    target, draft = tiny_pair
    prompt = [1] + [259 + (7 * i) % 22 for i in range(1400)]
    with SpeculativeDecoder(target, draft, n_ctx=2048, n_threads=1) as decoder:
        drafter = ModelDrafter(decoder.draft)
        params = SamplingParams(temperature=0)
        decoder.draft.should_stop = stops_at_call(2)
        assert drafter.propose(prompt, 3, params, Draws(0)) == []
        assert decoder.draft.n_past == decoder.draft.n_batch  # the first chunk stays
        decoder.draft.should_stop = None
        assert len(drafter.propose(prompt, 3, params, Draws(0))) == 3
        assert decoder.draft.n_past >= len(prompt)
