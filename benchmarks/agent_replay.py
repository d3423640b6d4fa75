"""An agent session's drafting replayed without the load of a shared machine (docs/benchmarks.md, issue 29).

    # record: each turn's prompt and the target's greedy answer (n-gram lookup: lossless, quicker)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_replay.py record --session inventory.py --out turns.json
    # replay: n-gram policies over those turns, each step priced by a fixed T(n) table
    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_replay.py replay turns.json
    # ... or by this machine's own, at the session's context (about 1,000 tokens deep)
    third_party/llama.cpp/build/bin/llama-bench -m TARGET -t 2 -p 1,2,4,8,16,32,64 -n 0 -d 1000 -r 2 -o json > tn.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_replay.py replay turns.json --llama-bench tn.json

A replayed step proposes what the policy proposes after the sequence so far, keeps the proposals that
agree with the recorded answer and adds the target's own token, as `speculate` does; its time is
T(k + 1) from the table. Policies: llama.cpp's ngram-simple (common/ngram-map.cpp: the last 12 tokens'
latest earlier place, up to 48 tokens copied, none below 12) and `--draft auto` over n-gram lookup
(`drafting.AutoDrafting`, the engine's own code), with several NGRAM_K_MAX and without the copy limit;
and, for the headroom, the best K at every step for one that knew how far each candidate agrees.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# T(n) / T(1) on the AMD EPYC at 2 threads: T(3), T(9) and T(17) measured (costs._batch_model's
# note), the rest interpolated, T(33) and T(49) extrapolated (assumed)
AMD_RATIOS = {1: 1.0, 2: 1.45, 3: 2.1, 4: 2.3, 8: 3.2, 9: 3.4, 16: 4.4, 17: 4.5, 32: 6.7, 48: 9.0}


def ratios_from_llama_bench(path: str, depth: int | None = None) -> dict[int, float]:
    """T(n) / T(1) from llama-bench's JSON (`-p 1,2,4,... -n 0 -o json`): each prompt test of n tokens is
    one batch of n, at the deepest `-d` measured unless `depth` is given."""
    tests = [t for t in json.loads(Path(path).read_text()) if t.get("n_gen", 0) == 0 and t.get("n_prompt", 0) > 0]
    depth = max(t.get("n_depth", 0) for t in tests) if depth is None else depth
    times = {t["n_prompt"]: t["avg_ns"] for t in tests if t.get("n_depth", 0) == depth}
    if 1 not in times:
        raise SystemExit(f"{path}: no 1-token batch at depth {depth} (run llama-bench with -p 1,2,4,...)")
    return {n: ns / times[1] for n, ns in sorted(times.items())}


def record(session_id: str, out: str, threads: int) -> None:
    import agent_bench as bench
    from ggufspec import load
    from ggufspec.ngram import NgramPool
    from ggufspec.speculate import SpeculativeDecoder
    script = json.loads(bench.SESSIONS.read_text())
    session = next(s for s in script["sessions"] if s["id"] == session_id)
    target, _ = bench.demo_pair()
    turns, messages = [], bench.opening(script, session)
    with SpeculativeDecoder(str(target), None, n_ctx=4096, n_threads=threads) as decoder:
        decoder.ngram_pool = NgramPool()
        for number, turn in enumerate(session["turns"]):
            if number:
                messages.append({"role": "user", "content": turn["user"]})
            prompt = load.render_chat(decoder.target_llm, messages, tools=script["tools"])
            answer = decoder.generate(prompt, n_predict=turn["max_tokens"], n_draft="auto", drafter="lookup")
            turns.append({"prompt": decoder.tokenize(prompt), "answer": answer.tokens, "max_tokens": turn["max_tokens"],
                          "ended": answer.stats.stop_reason == "eos"})
            messages.append({"role": "assistant", "content": answer.text})
    Path(out).write_text(json.dumps(turns))


def batch_time(ratios: dict[int, float]):
    sizes = sorted(ratios)

    def T(n: int) -> float:
        if n in ratios:
            return ratios[n]
        if n > sizes[-1]:  # the slope of the last two
            a, b = sizes[-2], sizes[-1]
            return ratios[b] + (ratios[b] - ratios[a]) * (n - b) / (b - a)
        low, high = max(s for s in sizes if s < n), min(s for s in sizes if s > n)
        return ratios[low] + (ratios[high] - ratios[low]) * (n - low) / (high - low)
    return T


def ngram_simple(sequence: list[int], n: int = 12, m: int = 48) -> list[int]:
    """llama.cpp's common_ngram_simple_draft."""
    length = len(sequence)
    if length <= n + m + 1:
        return []
    pattern = sequence[-n:]
    for j in range(length - n - 1, 0, -1):
        if sequence[j:j + n] == pattern:
            copy = min(m, length - (j + n))
            return sequence[j + n:j + n + copy] if copy >= n else []
    return []


class NgramMod:
    """llama.cpp's ngram-mod (common/ngram-mod.cpp, speculative.cpp): one table shared by every request,
    a hash of 24 tokens -> the token that followed them last (4M entries, emptied when a quarter full or
    after 5 steps in a row keeping under a quarter of their draft); each request's prompt is indexed as it
    begins, its own tokens in chunks once 32 are new; a draft follows the table up to 64 tokens, and is
    dropped when it stops before 48."""

    def __init__(self, n_match: int = 24, n_max: int = 64, n_min: int = 48, size: int = 4 * 1024 * 1024):
        self.n, self.n_max, self.n_min, self.size = n_match, n_max, n_min, size
        self.table: dict[int, int] = {}
        self.i_last = self.n_draft_last = self.n_low = 0

    def key(self, tokens) -> int:
        h = 0
        for t in tokens:
            h = (h * 6364136223846793005 + t) & 0xFFFFFFFFFFFFFFFF
        return h % self.size

    def add_from(self, sequence: list[int], start: int) -> None:
        for i in range(start, len(sequence) - self.n):
            self.table[self.key(sequence[i:i + self.n])] = sequence[i + self.n]

    def start(self):
        return self  # begin() runs at the first proposal of a turn (it needs the prompt)

    def __call__(self, sequence, room, _):
        if getattr(self, "_begun", None) is not sequence:  # a new turn: index its prompt
            self._begun = sequence
            self.add_from(sequence, 0)
            self.i_last = max(len(sequence) - self.n, 0)
            if len(self.table) / self.size > 0.25:
                self.table.clear()
        self.n_draft_last = 0
        if len(sequence) < self.n:
            return []
        if self.i_last + 32 < len(sequence):
            self.add_from(sequence, self.i_last)
            self.i_last = len(sequence) - self.n
        window, draft = list(sequence[-self.n:]), []
        for i in range(self.n_max):
            token = self.table.get(self.key(window[i:i + self.n]))
            if token is None:
                if i < self.n_min:
                    return []
                break
            draft.append(token)
            window.append(token)
        self.n_draft_last = len(draft)
        return draft

    @staticmethod
    def observe(k, kept, seconds, self):
        if self.n_draft_last:
            if kept / self.n_draft_last < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.table.clear()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0


# Qwen2.5's <|im_end|>: a recorded answer that ended on its own ended with it. The replay appends it, so
# that a draft running past an answer's end is verified and rejected as it is live (a replay that cut
# proposals at the answer's end, telling the policy where the answer ends, flattered every policy by
# 2-7%); and the policy's room is what max_tokens leaves, not what is left of the answer.
END_OF_TURN = 151645
ROOM = 512  # a recording without its turns' max_tokens


def ended(turns: list[dict]) -> list[dict]:
    """The turns, each answer with its end-of-turn token (unless the recording says it was cut)."""
    return [{**t, "answer": t["answer"] + ([END_OF_TURN] if t.get("ended", True) else [])} for t in turns]


def replay(turns: list[dict], T, propose, observe=lambda k, kept, seconds, state: None) -> dict:
    seconds = steps = drafted = kept_total = 0
    for turn in turns:
        sequence, answer, i = list(turn["prompt"]), turn["answer"], 0
        start = propose.start() if hasattr(propose, "start") else None
        while i < len(answer):
            room = max(0, turn.get("max_tokens", ROOM) - i - 1)  # what the engine would allow
            proposals = propose(sequence, room, start)[:room]
            kept = 0
            while kept < len(proposals) and i + kept < len(answer) and proposals[kept] == answer[i + kept]:
                kept += 1
            cost = T(len(proposals) + 1)
            observe(len(proposals), kept, cost, start)
            seconds, steps, drafted, kept_total = seconds + cost, steps + 1, drafted + len(proposals), kept_total + kept
            sequence += answer[i:i + kept + 1]
            i += kept + 1
    return {"time": seconds, "steps": steps, "drafted": drafted, "kept": kept_total}


def oracle(turns: list[dict], T, k_max: int = 64) -> dict:
    """The least time any choice of K could take over auto's own n-gram candidates, knowing how far
    each agrees with the answer: a dynamic programme over positions, cost(i) = min over k of
    T(k + 1) + cost(i + min(k, agreeing(i)) + 1). What is left to a policy that must guess."""
    from ggufspec import ngram
    pool, seconds, steps, drafted = ngram.NgramPool(), 0.0, 0, 0
    for turn in turns:
        lookup, answer = ngram.NgramDrafter(1 << 20, pool), turn["answer"]
        agreeing = []
        for i in range(len(answer)):
            candidate = lookup.candidate(turn["prompt"] + answer[:i], k_max)
            proposal, n = (candidate.tokens if candidate else []), 0
            while n < len(proposal) and i + n < len(answer) and proposal[n] == answer[i + n]:
                n += 1
            agreeing.append(n)
        best = [(0.0, 0, 0)] * (len(answer) + 1)  # from position i to the end: (time, steps, drafted)
        for i in range(len(answer) - 1, -1, -1):
            best[i] = min((T(k + 1) + best[j][0], best[j][1] + 1, best[j][2] + k)
                          for k in range(k_max + 1) for j in [min(len(answer), i + min(k, agreeing[i]) + 1)])
        seconds, steps, drafted = seconds + best[0][0], steps + best[0][1], drafted + best[0][2]
    return {"time": seconds, "steps": steps, "drafted": drafted, "kept": sum(len(t["answer"]) for t in turns) - steps}


class AutoLookup:
    """--draft auto over n-gram lookup, the engine's AutoDrafting, its costs from the table."""

    def __init__(self, T, k_max: int, copy_limit: bool = True, stop_at_end: bool = True):
        from ggufspec import costs, drafting, ngram
        self.drafting, self.T = drafting, T
        self.costs = costs.Costs()
        for n in (1, 2, 4, 8, 16, 32, 64):
            for _ in range(3):
                self.costs.add_batch(n, T(n))
        self.pool, self.k_max, self.copy_limit = ngram.NgramPool(), k_max, copy_limit
        self.is_end = (lambda token: token == END_OF_TURN) if stop_at_end else None  # the engine's: llama_vocab_is_eog
        self.ngram = ngram

    def start(self):
        self.drafting.AutoDrafting.NGRAM_K_MAX = self.k_max
        auto = self.drafting.AutoDrafting(self.ngram.NgramDrafter(1 << 20, self.pool, is_end=self.is_end), None,
                                          self.costs, 8)
        if not self.copy_limit:
            auto.long_copy_probe = lambda candidate, acceptance: 0
            self.drafting.copy_limit = lambda match_length: 1 << 20
        return auto

    def __call__(self, sequence, room, auto):
        from ggufspec.sampling import SamplingParams
        k = auto.choose(min(room, 511)) if room > 0 else 0
        return auto.propose(sequence, k, SamplingParams(temperature=0), None) if k > 0 else []

    @staticmethod
    def observe(k, kept, seconds, auto):
        auto.observe(k, kept, 0.0, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--session", default="inventory.py")
    rec.add_argument("--out", required=True)
    rec.add_argument("--threads", type=int, default=1)
    rep = sub.add_parser("replay")
    rep.add_argument("turns")
    rep.add_argument("--llama-bench", default=None, help="T(n) from this llama-bench JSON instead of the AMD table.")
    rep.add_argument("--depth", type=int, default=None, help="Which of its -d depths (default: the deepest).")
    rep.add_argument("--ratios", default=None, help="T(n) / T(1) from this JSON ({n: ratio}: verify_cost.py's).")
    args = parser.parse_args()
    if args.command == "record":
        return record(args.session, args.out, args.threads)
    turns = ended(json.loads(Path(args.turns).read_text()))
    if args.ratios:
        ratios = {int(n): float(r) for n, r in json.loads(Path(args.ratios).read_text()).items()}
    else:
        ratios = ratios_from_llama_bench(args.llama_bench, args.depth) if args.llama_bench else AMD_RATIOS
    T = batch_time(ratios)
    alone = sum(len(t["answer"]) for t in turns) * T(1)
    from ggufspec import drafting
    limit = drafting.copy_limit
    mod = NgramMod()
    rows = [("llama.cpp ngram-simple", replay(turns, T, lambda seq, room, _: ngram_simple(seq))),
            ("llama.cpp ngram-mod", replay(turns, T, mod, mod.observe))]
    for k_max, limited, at_end in ((16, False, True), (64, False, True), (64, True, False), (64, True, True)):
        policy = AutoLookup(T, k_max, limited, at_end)
        name = f"auto lookup, K up to {k_max}" + (", copy limits" if limited else "") + (
            ", copies end at an end of turn (as shipped)" if limited and at_end else "" if at_end else
            ", copies run past an end of turn (round 14)")
        rows.append((name, replay(turns, T, policy, policy.observe)))
        drafting.copy_limit = limit
    rows.append(("best K knowing the answer (auto's candidates)", oracle(turns, T)))
    source = args.ratios or args.llama_bench or "the AMD table"
    print(f"{sum(len(t['answer']) for t in turns)} tokens in {len(turns)} turns; T(n) / T(1) from {source}: "
          + ", ".join(f"T({n}) {r:.2f}" for n, r in sorted(ratios.items()) if n > 1))
    for name, r in rows:
        print(f"{name:78s} {alone / r['time']:.2f}x the target alone, {r['steps']} steps, {r['kept']}/{r['drafted']} kept")


if __name__ == "__main__":
    main()
