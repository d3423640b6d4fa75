"""Per-token overhead of ggufspec's loop on the tiny test models (where a step is ~0.1 ms, so any
Python work per token shows): a bare llama_decode + argmax loop through the same binding, ggufspec's
target alone (--no-draft), and --draft auto when the costs say no draft could pay (K=0 throughout).

    .venv/bin/python benchmarks/loop_overhead.py [--tokens 2000] [--rounds 7]

Rounds are interleaved (A B C, C B A, ...); the best round of each (interference only adds time)
and the median are reported.
"""
import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

from ggufspec.tinymodels import Shape, make_weights, write_model  # noqa: E402

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
        # remembered costs that rule drafting out: a batch of 4 far dearer than anything T(1) will
        # measure (only the least of recent times counts, so T(1) soon holds this machine's own)
        cannot_pay = decoder.costs["model"] = Costs()
        for n in (1, 1, 4, 4, 4):
            cannot_pay.add_batch(n, n * 0.25)
        cannot_pay.draft_times.append(0.1)
        runs = {
            "bare llama_decode + argmax loop": lambda: bare_loop(bare, prompt, args.tokens),
            "ggufspec --no-draft": lambda: ggufspec_loop(decoder, prompt, args.tokens, n_draft=0),
            "ggufspec --draft auto, K=0 (no draft could pay)": lambda: ggufspec_loop(decoder, prompt, args.tokens,
                                                                                    n_draft="auto"),
        }
        times = {name: [] for name in runs}
        for round_ in range(args.rounds):  # A B C, then C B A: no configuration always runs first
            for name in (list(runs) if round_ % 2 == 0 else list(reversed(runs))):
                times[name].append(runs[name]())
    best = {name: min(t) for name, t in times.items()}
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base, base_median = best["ggufspec --no-draft"], median["ggufspec --no-draft"]
    print(f"| loop ({args.tokens} tokens, tiny F32 model, 1 thread) | us/token (best) | us/token (median) "
          f"| vs --no-draft (best) | vs --no-draft (median) |")
    print("|---|---:|---:|---:|---:|")
    for name in runs:
        print(f"| {name} | {1e6 * best[name] / args.tokens:.1f} | {1e6 * median[name] / args.tokens:.1f} "
              f"| {base / best[name]:.3f}x | {base_median / median[name]:.3f}x |")


if __name__ == "__main__":
    main()
