"""Per-token overhead of ggufspec's loop on the tiny test models (where a step is ~0.1 ms, so any
Python work per token shows): a bare llama_decode + argmax loop through the same binding, ggufspec's
target alone (--no-draft), and --draft auto when the costs say no draft could pay (K=0 throughout).

    .venv/bin/python benchmarks/loop_overhead.py [--tokens 2000] [--rounds 7]

Rounds are interleaved; the best round of each is reported (interference only adds time).
"""
import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tinymodels import Shape, make_weights, write_model  # noqa: E402

from ggufspec import SpeculativeDecoder  # noqa: E402
from ggufspec.drafting import Costs  # noqa: E402


def bare_loop(llm, prompt, n_tokens):
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, 0, -1)
    tokens = (llama_cpp.llama_token * len(prompt))(*prompt)
    llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(prompt)))
    one = (llama_cpp.llama_token * 1)()
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        one[0] = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))
        llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1))
    return time.perf_counter() - t0


def ggufspec_loop(decoder, prompt, n_tokens, **options):
    out = decoder.generate(prompt, n_predict=n_tokens, temperature=0, **options)
    assert len(out.tokens) == n_tokens
    return out.stats.decode_seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    shape = Shape()
    weights = make_weights(shape, seed=0)
    weights["output.weight"][2] = 0  # no EOS: runs of any length
    target = write_model(tmp / "target.gguf", shape, weights)
    draft = write_model(tmp / "draft.gguf", shape, make_weights(shape, seed=1))
    prompt = [1, 260, 261, 262]
    n_ctx = args.tokens + 64
    bare = llama_cpp.Llama(str(target), n_ctx=n_ctx, n_threads=1, n_threads_batch=1, verbose=False,
                           flash_attn=False)
    # the same attention kernels on both sides (flash attention on the CPU is another comparison)
    with SpeculativeDecoder(target, draft, n_ctx=n_ctx, n_threads=1, flash_attn="off") as decoder:
        cannot_pay = decoder._costs["model"] = Costs()  # a machine where a batch of n costs n tokens
        for n in (1, 1, 4, 4, 4):
            cannot_pay.add_batch(n, n * 1e-4)
        cannot_pay.draft_times.append(5e-5)
        runs = {
            "bare llama_decode + argmax loop": lambda: bare_loop(bare, prompt, args.tokens),
            "ggufspec --no-draft": lambda: ggufspec_loop(decoder, prompt, args.tokens, use_draft=False),
            "ggufspec --draft auto, K=0 (no draft could pay)": lambda: ggufspec_loop(decoder, prompt, args.tokens,
                                                                                    n_draft="auto"),
        }
        best = {name: float("inf") for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                best[name] = min(best[name], run())
    base = best["ggufspec --no-draft"]
    print(f"| loop ({args.tokens} tokens, tiny F32 model, 1 thread) | us/token | tokens/s | vs --no-draft |")
    print("|---|---:|---:|---:|")
    for name, seconds in best.items():
        print(f"| {name} | {1e6 * seconds / args.tokens:.1f} | {args.tokens / seconds:,.0f} | {base / seconds:.3f}x |")


if __name__ == "__main__":
    main()
