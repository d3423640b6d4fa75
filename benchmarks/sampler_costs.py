"""What each of llama.cpp's samplers costs ggufspec per row (a verification batch processes one row per
position), over the demo target's vocabulary (151,936 tokens): the row's processing
(`TargetProcessor.apply`: bias, penalties, DRY), the draw's distribution (`sampling.distribution`), the
judge's pick under Mirostat and adaptive-p (their cut, the draw, the state moved) and a draft's proposal
under Mirostat, on random logits after a 3,000-token history of 2,000 distinct tokens.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sampler_costs.py [--rows 200] [--json FILE]
    # against an older tree (its sampling.py; this script's rows):  PYTHONPATH=/tmp/older:$PWD ...

Best of 3 rounds of `--rows` rows each (interference only adds time), microseconds a row.
"""
import argparse
import json
import sys
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import demo_pair_paths  # noqa: E402

from ggufspec import SamplingParams  # noqa: E402
from ggufspec.adaptivep import AdaptiveP  # noqa: E402
from ggufspec.dry import Dry  # noqa: E402
from ggufspec.mirostat import Mirostat  # noqa: E402
from ggufspec.processing import Constraints, TargetProcessor  # noqa: E402
from ggufspec.sampling import Draws, distribution, sample  # noqa: E402
from timing import best_us  # noqa: E402  (benchmarks/, the script's folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = llama_cpp.Llama(str(demo_pair_paths()[0]), vocab_only=True, verbose=False)
    vocab, n_vocab = llama_cpp.llama_model_get_vocab(llm.model), llm.n_vocab()
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(0, 2000, 3000 + args.rows)]
    rows = [rng.normal(size=n_vocab).astype(np.float32) * 3 for _ in range(8)]
    at = lambda i: (rows[i % len(rows)], history[:3000 + i])

    def processing(constraints: Constraints, window: int | None = None):
        dry = None if window is None else Dry.for_model(llm, vocab, constraints.dry_multiplier, constraints.dry_base,
                                                        constraints.dry_allowed_length, window,
                                                        constraints.dry_sequence_breakers)
        processor = TargetProcessor(constraints, vocab, n_vocab, dry=dry)
        return lambda i: processor.apply(*at(i))

    sampled = SamplingParams(temperature=0.8)
    unfiltered, draws = SamplingParams(temperature=0.8, top_k=0), Draws(1)
    temperature_alone = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0)
    allowed = rng.choice(n_vocab, 100, replace=False)  # a grammar's: 100 tokens allowed, the rest -inf
    masked = [np.where(np.isin(np.arange(n_vocab), allowed), row, -np.inf).astype(np.float32) for row in rows]
    mirostat, mirostat_v1 = Mirostat(2, 5.0, 0.1, 0.8, n_vocab), Mirostat(1, 5.0, 0.1, 0.8, n_vocab)
    adaptive = AdaptiveP(SamplingParams(temperature=0.8, adaptive_target=0.3))
    miro_params = SamplingParams(temperature=0.8, mirostat=2)

    def steered(state):  # what the target's judge does at a position: the cut, the draw, the state moved
        def run(i):
            ids, probs = state.cut(rows[i % len(rows)])
            index = draws.pick_among(ids, probs, i)
            state.observe(int(ids[index]), float(probs[index]))
        return run

    results = {
        "processing: a logit bias alone (the row's copy)": best_us(processing(Constraints(logit_bias={5: 1.0})), args.rows),
        "processing: + penalties (repeat_last_n 64)": best_us(processing(Constraints(logit_bias={5: 1.0},
                                                                                     repeat_penalty=1.1)), args.rows),
        "processing: + DRY (window 64)": best_us(processing(Constraints(dry_multiplier=0.8), 64), args.rows),
        "processing: + DRY (window 4096)": best_us(processing(Constraints(dry_multiplier=0.8), 4096), args.rows),
        "distribution: top-k 40, top-p, min-p, temperature": best_us(lambda i: distribution(rows[i % 8], sampled),
                                                                     args.rows),
        "the pick: distribution, then Draws.pick over the vector": best_us(
            lambda i: draws.pick(distribution(rows[i % 8], sampled), i), args.rows),
        "the pick: sample (the chain's tokens alone)": best_us(lambda i: sample(rows[i % 8], sampled, draws, i),
                                                             args.rows),
        "the pick: sample, top-k 0 (top-p 0.95, min-p 0.05: a prefix, not the row sorted)": best_us(
            lambda i: sample(rows[i % 8], unfiltered, draws, i), args.rows),
        "the pick: sample, temperature alone (top-k 0, top-p 1, min-p 0)": best_us(
            lambda i: sample(rows[i % 8], temperature_alone, draws, i), args.rows),
        "the pick: sample, temperature alone, a grammar allowing 100 tokens": best_us(
            lambda i: sample(masked[i % 8], temperature_alone, draws, i), args.rows),
        "the judge's pick: Mirostat 1": best_us(steered(mirostat_v1), args.rows),
        "the judge's pick: Mirostat 2": best_us(steered(mirostat), args.rows),
        "the judge's pick: adaptive-p after the chain": best_us(steered(adaptive), args.rows),
        "a draft's proposal under Mirostat": best_us(lambda i: sample(rows[i % 8], miro_params, draws, i), args.rows),
    }
    for name, us in results.items():
        print(f"{us:9.1f} us  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"n_vocab": n_vocab, "history": 3000, "us_per_row": results}, indent=1))


if __name__ == "__main__":
    main()
