"""What the target's judge pays a position under Mirostat and adaptive-p (the cut, the position's draw, the state
moved), and what a draft's proposal under Mirostat costs, over the demo target's vocabulary (151,936 tokens, random
logits): with the tree on PYTHONPATH, before round 31 (its dense `distribution`, `Draws.pick` over the vector,
`observe(probs, token)`) or after (`cut`, `pick_among`, `observe(token, p)`), so that both run on one machine:

    git worktree add /tmp/r30 546d247
    for tree in /tmp/r30 $PWD; do PYTHONPATH=$tree .venv/bin/python benchmarks/steered_costs.py; done

Best of 3 rounds of 100 rows, microseconds a row.
"""
import json

import numpy as np

from ggufspec.adaptivep import AdaptiveP
from ggufspec.mirostat import Mirostat
from ggufspec.sampling import Draws, SamplingParams, sample
from timing import best_us  # benchmarks/, the script's folder

N_VOCAB = 151_936
ROWS = [np.random.default_rng(0).normal(size=N_VOCAB).astype(np.float32) * 3 for _ in range(8)]
DRAWS = Draws(1)
SPARSE = hasattr(Mirostat, "cut")  # round 31's interface


def judged(state):
    def run(i: int) -> None:
        row = ROWS[i % len(ROWS)]
        if SPARSE:
            ids, probs = state.cut(row)
            index = DRAWS.pick_among(ids, probs, i)
            state.observe(int(ids[index]), float(probs[index]))
        else:
            probs = state.distribution(row)
            state.observe(probs, DRAWS.pick(probs, i))
    return run


def main() -> None:
    proposal = SamplingParams(temperature=0.8, mirostat=2)
    print(json.dumps({
        "interface": "cut" if SPARSE else "distribution",
        "Mirostat 1: the judge's pick": best_us(judged(Mirostat(1, 5.0, 0.1, 0.8, N_VOCAB))),
        "Mirostat 2: the judge's pick": best_us(judged(Mirostat(2, 5.0, 0.1, 0.8, N_VOCAB))),
        "adaptive-p: the judge's pick": best_us(judged(AdaptiveP(SamplingParams(temperature=0.8, adaptive_target=0.3)))),
        "Mirostat: a draft's proposal": best_us(lambda i: sample(ROWS[i % len(ROWS)], proposal, DRAWS, i)),
    }))


if __name__ == "__main__":
    main()
