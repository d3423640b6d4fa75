"""Per-token overhead of ggufspec's loop on the tiny test models (where a step is ~0.1 ms, so any
Python work per token shows): a bare llama_decode + argmax loop through the same binding, ggufspec's
target alone (--no-draft), and --draft auto when the costs say no draft model could pay (it still drafts
by n-gram where the text repeats itself, as the tiny models' text soon does).

    .venv/bin/python benchmarks/loop_overhead.py [--tokens 2000] [--rounds 7]
    # on a GPU, with a real-shaped model (its own draft for the auto row), flash attention on both sides:
    .venv/bin/python benchmarks/loop_overhead.py --model ~/gpukit/t15.gguf --ngl 99 --tokens 256 --rounds 5 --json

Rounds are interleaved (A B C, C B A, ...); the best round of each (interference only adds time)
and the median are reported.
"""
import argparse
import ctypes
import json
import tempfile
import time
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

from ggufspec.tinymodels import Shape, make_weights, write_model  # noqa: E402

from ggufspec import SpeculativeDecoder  # noqa: E402
from ggufspec.costs import Costs  # noqa: E402


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
    return out.stats.decode_seconds * n_tokens / max(len(out.tokens), 1)  # a real model may stop early


def tiny_models(tmp: Path) -> tuple[Path, Path]:
    shape = Shape()
    weights = make_weights(shape, seed=0)
    weights["output.weight"][2] = 0  # no EOS: runs of any length
    return (write_model(tmp / "target.gguf", shape, weights),
            write_model(tmp / "draft.gguf", shape, make_weights(shape, seed=1)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None, help="A real GGUF instead of the tiny models (it drafts for itself).")
    parser.add_argument("--ngl", type=int, default=0, help="Layers on the GPU (both loops).")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="The table's rows as JSON.")
    args = parser.parse_args()
    target, draft = (args.model, args.model) if args.model else tiny_models(Path(tempfile.mkdtemp()))
    prompt = [1, 260, 261, 262]
    n_ctx = args.tokens + 64
    # the same attention kernels on both sides: off for the tiny models (flash attention on the CPU is
    # another comparison), on for a real model (llama.cpp's default on a GPU)
    flash = args.model is not None
    bare = llama_cpp.Llama(str(target), n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                           n_gpu_layers=args.ngl, verbose=False, flash_attn=flash)
    with SpeculativeDecoder(target, draft, n_ctx=n_ctx, n_threads=args.threads, n_gpu_layers=args.ngl,
                            flash_attn="on" if flash else "off") as decoder:
        # remembered costs that rule drafting out: a batch of 4 far dearer than anything T(1) will
        # measure (only the least of recent times counts, so T(1) soon holds this machine's own)
        cannot_pay = decoder.costs["model"] = Costs()
        for n in (1, 1, 4, 4, 4):
            cannot_pay.add_batch(n, n * 0.25)
        cannot_pay.draft_times.append(0.1)
        runs = {
            "bare llama_decode + argmax loop": lambda: bare_loop(bare, prompt, args.tokens),
            "ggufspec --no-draft": lambda: ggufspec_loop(decoder, prompt, args.tokens, n_draft=0),
            "ggufspec --draft auto (no draft model could pay; n-grams where the text repeats)": lambda: ggufspec_loop(decoder, prompt, args.tokens,
                                                                                    n_draft="auto"),
        }
        times = {name: [] for name in runs}
        for round_ in range(args.rounds):  # A B C, then C B A: no configuration always runs first
            for name in (list(runs) if round_ % 2 == 0 else list(reversed(runs))):
                times[name].append(runs[name]())
    report(times, args)


def report(times: dict, args) -> None:
    best = {name: min(t) for name, t in times.items()}
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base, base_median = best["ggufspec --no-draft"], median["ggufspec --no-draft"]
    if args.json:
        print(json.dumps({"model": args.model or "tiny", "ngl": args.ngl, "tokens": args.tokens,
                          "us_per_token": {name: [1e6 * t / args.tokens for t in ts] for name, ts in times.items()}}))
        return
    model = Path(args.model).name if args.model else "tiny F32 model"
    print(f"| loop ({args.tokens} tokens, {model}, {args.threads} thread(s), -ngl {args.ngl}) | us/token (best) "
          f"| us/token (median) | vs --no-draft (best) | vs --no-draft (median) |")
    print("|---|---:|---:|---:|---:|")
    for name in times:
        print(f"| {name} | {1e6 * best[name] / args.tokens:.1f} | {1e6 * median[name] / args.tokens:.1f} "
              f"| {base / best[name]:.3f}x | {base_median / median[name]:.3f}x |")


if __name__ == "__main__":
    main()
