"""`ggufspec bench`, with every decoding step's timings kept (for checking the simulator's costs).

    python benchmarks/bench_steps.py STEPS.json bench -m T.gguf -md D.gguf --prompts P.jsonl ...

Runs the bench command in this process, unchanged, and writes STEPS.json: for every generation, in
the order bench ran them, its steps as [k drafted, kept, draft seconds, verify seconds, seconds
since the previous step ended]. The last figure is what a step costs beyond drafting and verifying
(Python, the judge, rewinding both caches, yielding the tokens).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ggufspec import stats as _stats  # noqa: E402
from ggufspec import speculate as _speculate  # noqa: E402

generations: list[dict] = []
_add_step = _stats.Stats.add_step


def _logged_add_step(self, n_drafted, n_accepted, draft_seconds, target_seconds):
    now = time.perf_counter()
    log = self.__dict__.get("_steps")
    if log is None:
        log = self.__dict__["_steps"] = []
        generations.append({"steps": log})
        self.__dict__["_last"] = now - draft_seconds - target_seconds
    gap = now - self.__dict__["_last"] - draft_seconds - target_seconds
    self.__dict__["_last"] = now
    log.append([n_drafted, n_accepted, round(draft_seconds, 6), round(target_seconds, 6), round(gap, 6)])
    _add_step(self, n_drafted, n_accepted, draft_seconds, target_seconds)


def main() -> None:
    out = Path(sys.argv[1])
    _stats.Stats.add_step = _logged_add_step
    from ggufspec.cli import main as cli
    try:
        cli(sys.argv[2:], standalone_mode=False)
    finally:
        out.write_text(json.dumps(generations), encoding="utf-8")


if __name__ == "__main__":
    main()
