"""Slots under `--exact`, with random arrival delays: does each of three prompts, decoded together in
three slots, get the text the target alone gives it, whatever the batches' composition?

    PYTHONPATH=$PWD .venv/bin/python benchmarks/exact_slots_stress.py SEED TRIALS

Each trial sends the three held-out prompts with delays drawn from SEED (0 to 1 s) and K drawn from
0, 3 and auto, and prints the slots and cached tokens each got and whether any text differs. Round
10 found a difference in 1 of 4 processes (a prompt of 65 tokens prefilled in one batch: llama.cpp's
tiled flash attention from 64 rows), none once `--exact` capped the step at 32 tokens.
"""
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import demo_pair_paths  # noqa: E402
from ggufspec import SpeculativeDecoder  # noqa: E402


def main(seed: int, trials: int) -> None:
    target, draft = demo_pair_paths()
    texts = [json.loads(line)["prompt"] for line in open(ROOT / "benchmarks" / "held-out-prompts.jsonl") if line.strip()][:3]
    with SpeculativeDecoder(target, draft, n_ctx=1024, n_threads=2, exact=True, n_parallel=3) as decoder:
        prompts = [decoder.render_chat([{"role": "user", "content": text}]) for text in texts]
        alone = [decoder.generate(prompt, n_predict=40, n_draft=0).tokens for prompt in prompts]

        def one(args):
            index, delay, k = args
            time.sleep(delay)
            tokens = decoder.tokenize(prompts[index])
            with decoder.slots.use(tokens) as view:
                return view.generate(tokens, n_predict=40, n_draft=k)
        rng = random.Random(seed)
        for trial in range(trials):
            k = rng.choice([0, 3, "auto"])
            delays = [rng.choice([0, 0, 0.05, 0.3, 1.0]) for _ in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(one, [(i, delays[i], k) for i in range(len(prompts))]))
            differ = [i for i, g in enumerate(got) if g.tokens != alone[i]]
            where = [(g.stats.id_slot, g.stats.n_prompt_cached) for g in got]
            print(trial, k, delays, where, "DIFFER" if differ else "ok", differ, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
