"""Greedy bit-identical without giving up the batch (issue 28), on the real demo target.

With weight repacking off and flash attention on, llama.cpp's CPU backend computes every row of a batch
with the same dot-product kernel as a single token (no tiled gemm for the repacked weights, no
llamafile sgemm for K-quants, and flash attention handles each query row on its own), so a
verification batch's logits are exactly the single-token ones. Then the speculative text is the target
alone's bit for bit, at every K, with n-gram drafts from a warm pool too: no near-tie allowance here.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import demo_pair_paths
from ggufspec import SpeculativeDecoder
from ggufspec.load import LoadParams, open_model, tokenize
from ggufspec.native import Context
from ggufspec.ngram import NgramPool

pytestmark = pytest.mark.slow

HELD_OUT = Path(__file__).parent.parent / "benchmarks" / "held-out-prompts.jsonl"
N_PREDICT = 40


@pytest.fixture(scope="module")
def exact_decoder():
    target, draft = demo_pair_paths()
    with SpeculativeDecoder(target, draft, n_ctx=1024, n_threads=2, repack=False) as decoder:
        yield decoder


def held_out_prompts(decoder, n):
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines() if line.strip()][:n]
    return [decoder.render_chat([{"role": "user", "content": row["prompt"]}]) for row in rows]


@pytest.mark.parametrize("repack, identical", [(False, True), (True, False)])
def test_a_batch_gives_the_single_token_logits_only_without_repacking(repack, identical):
    target, _ = demo_pair_paths()
    llm = open_model(target, "target", LoadParams(n_ctx=256, n_threads=2, flash_attn="on", repack=repack))
    ctx = Context(llm, "target")
    try:
        tokens = tokenize(llm, "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n")
        head, tail = tokens[:-6], tokens[-6:]
        ctx.decode(head, n_logits=0)
        ctx.decode(tail, n_logits=6)
        batched = np.array([ctx.logits(i) for i in range(6)])
        ctx.keep(len(head))
        single = []
        for token in tail:
            ctx.decode([token], n_logits=1)
            single.append(ctx.logits(0).copy())
        assert (np.abs(batched - np.array(single)).max() == 0.0) == identical
    finally:
        ctx.close()
        llm.close()


def test_greedy_text_is_the_target_alones_bit_for_bit(exact_decoder):
    exact_decoder.ngram_pool = NgramPool(1 << 16)
    for prompt in held_out_prompts(exact_decoder, 3):
        expected = exact_decoder.generate(prompt, n_predict=N_PREDICT, n_draft=0).tokens
        for k, drafter in [(1, "model"), (3, "model"), (8, "model"), ("auto", "model"), (4, "lookup"),
                           (4, "lookup")]:  # the second lookup run drafts from the pool the first filled
            got = exact_decoder.generate(prompt, n_predict=N_PREDICT, n_draft=k, drafter=drafter)
            assert got.tokens == expected, (k, drafter, prompt[-60:])


def test_a_repeated_server_request_gets_the_same_answer(tmp_path):
    """Asked twice, the second time with the pool knowing the first answer (it drafts long stretches
    of it): the same text, and the target alone's (`"draft": 0`)."""
    from serverproc import serving
    target, draft = demo_pair_paths()
    question = [{"role": "user", "content": "Write a JavaScript debounce function with a timeout variable."}]
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", "1024", "-t", "2", "--no-repack") as server:
        client = server.client(timeout=300)
        answers = [client.chat.completions.create(model="target", messages=question, max_tokens=48, temperature=0,
                                                  extra_body=extra)
                   for extra in ({"draft": "auto"}, {"draft": "auto"}, {"lookup": True}, {"draft": 0})]
    texts = [a.choices[0].message.content for a in answers]
    assert len(set(texts)) == 1, texts
