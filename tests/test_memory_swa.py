"""A sliding-window target (Gemma 2, window 16) with a window-sized cache, as llama-server's default:
lossless over runs far longer than the window, and a new prompt reuses the cache through checkpoints."""
import llama_cpp
import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.load import LoadParams, open_model
from reference import (NEAR_TIE, first_difference, greedy_every_k_is_target_alone, prompts, same_as_target_alone,
                       target_alone)
from ggufspec.tinymodels import make_gemma2_pair

ATTENTION = "off"  # the target alone as the decoders load it: -fa auto is off on a CPU
N_CTX = 512
WINDOW = 16


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    return make_gemma2_pair(tmp_path_factory.mktemp("gemma2"), window=WINDOW)


@pytest.fixture(scope="module")
def decoder(gemma_pair):
    # n_batch 64 makes the window cache 256 cells (llama.cpp pads it to 256): a 300-token run overflows it
    params = LoadParams(n_ctx=N_CTX, n_threads=1, n_batch=64)
    target, draft = (open_model(path, role, params) for path, role in zip(gemma_pair, ("target", "draft")))
    with SpeculativeDecoder(target, draft) as dec:
        yield dec
    target.close()
    draft.close()


def test_the_cache_holds_the_window_only(decoder):
    assert decoder.target.n_swa == WINDOW and decoder.target_llm.context_params.swa_full is False
    decoder.generate(prompts(1)[0], n_predict=300, n_draft=0)
    assert llama_cpp.llama_memory_seq_pos_min(decoder.target.memory, 0) > 0  # early positions are gone


def test_swa_full_opts_out(gemma_pair):
    llm = open_model(gemma_pair[0], "target", LoadParams(n_ctx=128, n_threads=1, swa_full=True))
    with SpeculativeDecoder(llm) as dec:
        assert dec.target.n_swa == 0 and llm.context_params.swa_full is True
    llm.close()


@pytest.fixture(scope="module")
def strict_decoder(gemma_pair):
    """Verification token by token (n_ubatch 1): bit-identical to the target alone, near-ties included
    (this model's logits are close together: batched rounding alone flips many of its 300 tokens). Its
    cache holds every position (a window-sized one, once wrapped, refills cells out of order)."""
    params = LoadParams(n_ctx=N_CTX, n_threads=1, strict=True)
    target = open_model(gemma_pair[0], "target", params, strict=True)
    draft = open_model(gemma_pair[1], "draft", LoadParams(n_ctx=N_CTX, n_threads=1))
    with SpeculativeDecoder(target, draft) as dec:
        yield dec
    target.close()
    draft.close()


def test_greedy_equals_target_alone_far_past_the_window(gemma_pair, strict_decoder):
    decoder = strict_decoder
    assert decoder.target.n_swa == 0 and decoder.target_llm.context_params.swa_full is True
    _, near_ties = greedy_every_k_is_target_alone(decoder, gemma_pair[0], prompts(2, seed=5), 300, N_CTX, ATTENTION)
    assert near_ties == 0


def test_a_conversation_reuses_its_prefix_past_the_window(gemma_pair, decoder):
    first = prompts(1, seed=8)[0]
    out1 = decoder.generate(first, n_predict=280, n_draft=3)
    second = first + out1.tokens + [265, 266]
    out2 = decoder.generate(second, n_predict=20, n_draft=3)
    assert out2.stats.n_prompt_cached == len(first) + len(out1.tokens) - 1  # the window moved on with it
    expected, margins, _ = target_alone(gemma_pair[0], second, 20, N_CTX, ATTENTION)
    diff = first_difference(out2.tokens, expected)
    assert diff is None or margins[diff] < NEAR_TIE
    # a prompt leaving the conversation where the window no longer reaches: the checkpoint where
    # the first prompt ended, not the whole prompt again
    third = first + [270, 271]
    before = decoder.target.n_evaluated
    out3 = decoder.generate(third, n_predict=20, n_draft=3)
    assert out3.stats.n_prompt_cached == len(first)
    assert decoder.target.n_evaluated - before < 3 + 5 * 20
    expected, margins, _ = target_alone(gemma_pair[0], third, 20, N_CTX, ATTENTION)
    diff = first_difference(out3.tokens, expected)
    assert diff is None or margins[diff] < NEAR_TIE


@pytest.mark.parametrize("n_ctx", [256, 1024, 4096])
@pytest.mark.parametrize("swa_full", [False, True])
def test_the_planner_counts_the_window_cache_as_llamacpp_allocates_it(gemma_pair, n_ctx, swa_full):
    """A window layer holds pad256(min(n_ctx, window + n_ubatch)) cells unless --swa-full; the plan's
    KV estimate is llama.cpp's own KV buffer size (its log) both ways."""
    from llamacpp_log import buffer_sizes
    from ggufspec.plan.gguf_header import read_shape
    shape = read_shape(gemma_pair[0])
    assert shape.n_swa == WINDOW and shape.swa_layers == (True, False, True, False)  # gemma 2: every other layer
    actual = buffer_sizes(gemma_pair[0], n_ctx, n_batch=512, swa_full=swa_full)["kv"]
    assert shape.kv_bytes(n_ctx, n_ubatch=512, swa_full=swa_full) == pytest.approx(actual, rel=0.02, abs=20_000)  # the log rounds to 0.01 MiB
    if n_ctx == 4096 and not swa_full:  # what the default saves here: half the layers at 768 cells of 4096
        assert shape.kv_bytes(n_ctx) < 0.6 * shape.kv_bytes(n_ctx, swa_full=True)


def test_cache_prompt_false_past_the_window_answers_as_the_target_alone(gemma_pair, strict_decoder):
    """cache_prompt=False on a sliding-window cache that has moved past its window: emptied, the
    prompt evaluated whole, the answer bit for bit the target alone's."""
    prompt = prompts(1, seed=6)[0]
    expected, margins, _ = target_alone(gemma_pair[0], prompt, 60, N_CTX, ATTENTION)
    strict_decoder.generate(prompt + expected[:40], n_predict=200, n_draft=3)  # the cache far past the window
    fresh = strict_decoder.generate(prompt, n_predict=60, n_draft=3, cache_prompt=False)
    assert fresh.stats.n_prompt_cached == 0
    assert same_as_target_alone(fresh, expected, margins, "cache_prompt=False")


def test_strict_is_bit_exact_where_a_window_cache_would_have_wrapped(gemma_pair):
    """A 251-token prompt fills the window-sized cache (256 cells); a draft rejected there was cut by
    seq_rm, the freed cells refilled out of position order, and attention, which sums the cells in
    cell order, rounded otherwise: K = 3 parted from K = 0 at the sixth token. Under --strict the
    cache holds every position."""
    import numpy as np
    prompt = [1] + [int(x) for x in np.random.default_rng(3).integers(259, 281, size=250)]
    target = open_model(gemma_pair[0], "target", LoadParams(n_ctx=2048, n_threads=1, strict=True), strict=True)
    draft = open_model(gemma_pair[1], "draft", LoadParams(n_ctx=2048, n_threads=1))
    with SpeculativeDecoder(target, draft) as dec:
        runs = [list(dec.stream(prompt, n_predict=12, n_draft=k, temperature=0, logprobs=2, cache_prompt=False))
                for k in (0, 3, 1)]
    target.close()
    draft.close()
    for run in runs[1:]:
        assert [(p.token, p.logprob) for p in run] == [(p.token, p.logprob) for p in runs[0]]
