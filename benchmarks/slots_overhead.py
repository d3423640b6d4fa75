"""What running N slots at once costs beyond llama.cpp's batch, on the tiny test models (a step is a few
hundred microseconds there, so the slots' own synchronisation and Python work show, as they would beside
a GPU's 2-4 ms step): a bare loop that decodes one batch holding each of N sequences' next token and
takes each row's argmax, against `generate_many` over N prompts (N slots, the target alone), per round.

    .venv/bin/python benchmarks/slots_overhead.py [--tokens 300] [--rounds 5] [--json F] [--lockstep REV ...]

--lockstep REV adds slots whose `ggufspec/lockstep.py` is the one at git revision REV, in the same
process (before and after a change, side by side). Rounds are interleaved (the order reversed every
other round); the least of each is reported (interference only adds time), with the median.
"""
import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

from ggufspec import SpeculativeDecoder, slots  # noqa: E402
from ggufspec.bench_parallel import _clear  # noqa: E402
from ggufspec.load import LoadParams, open_model  # noqa: E402
from ggufspec.tinymodels import Shape, make_weights, write_model  # noqa: E402

COUNTS = (1, 2, 4, 8)


def prompts(n: int) -> list[list[int]]:
    return [[1, 260 + i, 261, 262] for i in range(n)]


def bare_rounds(llm, n: int, n_tokens: int) -> float:
    """n sequences, one batch a round, each row's argmax read through the binding: seconds per round."""
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    try:
        rows = []
        for seq, prompt in enumerate(prompts(n)):
            for pos, token in enumerate(prompt):
                _put(batch, batch.n_tokens, token, pos, seq, pos == len(prompt) - 1)
                batch.n_tokens += 1
            rows.append(batch.n_tokens - 1)
        llama_cpp.llama_decode(ctx, batch)
        started = time.perf_counter()
        for step in range(n_tokens):
            tokens = [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,))))
                      for row in rows]
            for seq, token in enumerate(tokens):
                _put(batch, seq, token, 4 + step, seq, True)
            batch.n_tokens, rows = n, list(range(n))
            llama_cpp.llama_decode(ctx, batch)
        return (time.perf_counter() - started) / n_tokens
    finally:
        llama_cpp.llama_batch_free(batch)


def _put(batch, j: int, token: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, pos, 1, logits
    batch.seq_id[j][0] = seq


def slot_rounds(decoder, n: int, n_tokens: int) -> float:
    """generate_many over n prompts in n slots: seconds per round (from the first round, prompts included)."""
    _clear(decoder)  # as the bare loop's: no idle slot's cells widen the batch's attention
    started = time.perf_counter()
    answers = decoder.generate_many(prompts(n), n_predict=n_tokens, temperature=0, n_draft=0)
    assert all(len(a.tokens) == n_tokens for a in answers)
    return (time.perf_counter() - started) / n_tokens


def tiny_target(tmp: Path) -> Path:
    shape = Shape()
    weights = make_weights(shape, seed=0)
    weights["output.weight"][2] = 0  # no EOS: runs of any length
    return write_model(tmp / "target.gguf", shape, weights)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="Write the times (us a round) here as well.")
    parser.add_argument("--lockstep", action="append", default=[], metavar="REV",
                        help="Also slots with lockstep.py as at this git revision (repeatable).")
    args = parser.parse_args()
    target = tiny_target(Path(tempfile.mkdtemp()))
    n_ctx = max(COUNTS) * (args.tokens + 64)
    bare = open_model(target, "target", LoadParams(n_ctx=n_ctx, n_threads=1, flash_attn="off", n_seq=max(COUNTS)))
    decoders = {f"slots@{rev}": slots_decoder(target, n_ctx, lockstep_at(rev)) for rev in args.lockstep}
    decoders["slots"] = slots_decoder(target, n_ctx, slots.Lockstep)
    runs = {"bare": lambda n: bare_rounds(bare, n, args.tokens)}
    runs.update({name: (lambda n, d=decoder: slot_rounds(d, n, args.tokens)) for name, decoder in decoders.items()})
    times = {(name, n): [] for n in COUNTS for name in runs}
    try:
        for round_ in range(args.rounds):
            for n in COUNTS:
                for name in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
                    times[name, n].append(1e6 * runs[name](n))
    finally:
        for decoder in decoders.values():
            decoder.close()
    report(times, list(runs), args)


def slots_decoder(target: Path, n_ctx: int, lockstep_class) -> SpeculativeDecoder:
    slots.Lockstep, current = lockstep_class, slots.Lockstep  # what `Slots` makes its rounds with
    try:
        decoder = SpeculativeDecoder(target, None, n_ctx=n_ctx, n_threads=1, n_parallel=max(COUNTS), flash_attn="off")
    finally:
        slots.Lockstep = current
    slot_rounds(decoder, max(COUNTS), 8)  # warm-up
    return decoder


def lockstep_at(rev: str):
    """The Lockstep class of ggufspec/lockstep.py as at git revision `rev`."""
    shown = subprocess.run(["git", "show", f"{rev}:ggufspec/lockstep.py"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent.parent)
    if shown.returncode != 0:
        raise SystemExit(f"--lockstep {rev}: git has no ggufspec/lockstep.py there ({shown.stderr.strip()})")
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "lockstep_at.py"
    path.write_text(source.replace("from .errors import", "from ggufspec.errors import"))
    spec = importlib.util.spec_from_file_location(f"lockstep_at_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Lockstep


def report(times: dict, names: list[str], args) -> None:
    slot_names = names[1:]
    print(f"| slots at once (tiny F32 target, {args.tokens} tokens each, 1 thread), us a round: least (median) | "
          + " | ".join(names) + " | " + " | ".join(f"{name}: own cost a slot" for name in slot_names) + " |")
    print("|---:|" + "---:|" * (len(names) + len(slot_names)))
    for n in COUNTS:
        bare = min(times["bare", n])
        cells = [f"{min(times[name, n]):.0f} ({_median(times[name, n]):.0f})" for name in names]
        cells += [f"{(min(times[name, n]) - bare) / n:.0f}" for name in slot_names]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{name}-{n}": ts for (name, n), ts in times.items()}, indent=1))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


if __name__ == "__main__":
    main()
