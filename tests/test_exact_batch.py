"""Greedy bit-identical without giving up the batch (issue 28, `--exact`), on the real demo target.

llama.cpp's CPU backend computes a batch with other kernels than a single token: weights repacked for
tiled products, and a tiled K-quant matmul from 8 rows up. With both off (`load.exact_kernels`) and
flash attention on, every row of a verification batch is computed as a single token is, so its
logits are exactly the single-token ones and the speculative text is the target alone's bit for bit
at every K, from a warm n-gram pool too: no near-tie allowance here. The kernel switch is read once
per process, so each check runs in a process of its own.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import demo_pair_paths

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
HELD_OUT = BENCHMARKS / "held-out-prompts.jsonl"

LOGITS = """
import json, sys
sys.path.insert(0, sys.argv[3])
from exact_batch import batch_minus_single
from ggufspec.load import LoadParams, open_model, tokenize
from ggufspec.native import Context
llm = open_model(sys.argv[1], "target", LoadParams(n_ctx=512, n_threads=2, exact=sys.argv[2] == "exact"))
ctx = Context(llm, "target")
tokens = tokenize(llm, "def identity(a):\\n    return a\\n" * 8 + "def quicksort(arr):\\n    if len(arr) <= 1:\\n        return arr\\n    pivot = arr[0]\\n"
                       "    left = [x for x in arr if x < pivot]\\n    return quicksort(left) + [pivot]\\n")
# 65: past llama.cpp's flash-attention tile of 64 query rows
print(json.dumps(batch_minus_single(ctx, tokens, (3, 8, 17, 65))))
"""

GREEDY = """
import json, sys
from ggufspec import SpeculativeDecoder
from ggufspec.ngram import NgramPool
prompts = [json.loads(line)["prompt"] for line in open(sys.argv[3]) if line.strip()][:3]
with SpeculativeDecoder(sys.argv[1], sys.argv[2], n_ctx=1024, n_threads=2, exact=True) as decoder:
    decoder.ngram_pool = NgramPool(1 << 16)
    differ = []
    for text in prompts:
        prompt = decoder.render_chat([{"role": "user", "content": text}])
        expected = decoder.generate(prompt, n_predict=40, n_draft=0).tokens
        # the second lookup run drafts from the pool the first one filled
        for k, drafter in [(1, "model"), (3, "model"), (8, "model"), ("auto", "model"), (4, "lookup"), (16, "lookup")]:
            got = decoder.generate(prompt, n_predict=40, n_draft=k, drafter=drafter)
            if got.tokens != expected:
                differ.append([text[:30], str(k), drafter])
print(json.dumps(differ))
"""

SLOTS = """
import json, sys
from ggufspec import SpeculativeDecoder
prompts = [json.loads(line)["prompt"] for line in open(sys.argv[3]) if line.strip()][:3]
with SpeculativeDecoder(sys.argv[1], sys.argv[2], n_ctx=1024, n_threads=2, exact=True, n_parallel=3) as decoder:
    prompts = [decoder.render_chat([{"role": "user", "content": text}]) for text in prompts]
    alone = [decoder.generate(prompt, n_predict=40, n_draft=0).tokens for prompt in prompts]
    differ = []
    for k in (0, 3, "auto"):
        together = decoder.generate_many(prompts, n_predict=40, n_draft=k)
        differ += [[str(k), i] for i, got in enumerate(together) if got.tokens != alone[i]]
    print(json.dumps({"differ": differ, "batches": decoder.slots.lockstep.n_batches,
                      "requests": decoder.slots.lockstep.n_requests}))
"""


def run_script(code: str, *args) -> object:
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_batch_gives_the_single_token_logits_only_with_exact_kernels():
    target, _ = demo_pair_paths()
    exact = run_script(LOGITS, target, "exact", BENCHMARKS)
    assert exact == {"3": 0.0, "8": 0.0, "17": 0.0, "65": 0.0}
    default = run_script(LOGITS, target, "default", BENCHMARKS)  # llama.cpp's kernels: batch rounding at every size here
    assert max(default.values()) > 0.0


def test_greedy_text_is_the_target_alones_bit_for_bit():
    target, draft = demo_pair_paths()
    assert run_script(GREEDY, target, draft, HELD_OUT) == []


def test_slots_decoding_together_give_each_the_target_alones_text_bit_for_bit():
    """Three prompts in three slots, their tokens in one batch per step (issue 30), with the exact
    kernels and a cache per sequence: each text is the one the target gives it alone."""
    target, draft = demo_pair_paths()
    result = run_script(SLOTS, target, draft, HELD_OUT)
    assert result["differ"] == [] and result["batches"] < result["requests"]


def test_a_repeated_server_request_gets_the_same_answer(tmp_path):
    """Asked twice, the second time with the pool knowing the first answer (it drafts long stretches
    of it): the same text, and the target alone's (`"draft": 0`)."""
    from serverproc import serving
    target, draft = demo_pair_paths()
    question = [{"role": "user", "content": "Write a JavaScript debounce function with a timeout variable."}]
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", "1024", "-t", "2", "--exact") as server:
        client = server.client(timeout=300)
        answers = [client.chat.completions.create(model=Path(target).stem, messages=question, max_tokens=48, temperature=0,
                                                  extra_body=extra)
                   for extra in ({"draft": "auto"}, {"draft": "auto"}, {"lookup": True}, {"draft": 0})]
    texts = [a.choices[0].message.content for a in answers]
    assert len(set(texts)) == 1, texts
