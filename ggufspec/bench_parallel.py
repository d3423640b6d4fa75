"""`bench --streams 1,2,4`: N prompts generated at once in N slots (`slots`), against one at a time.

For each stream count n and each configuration (the target alone, --draft auto), the prompts go in
rounds of n, each round through `generate_many` (one batch per model and step for all n), after a
warm-up round. Reported per n: the aggregate tokens per second (all tokens / wall time), the mean of
each stream's own tokens per second, and the aggregate against one stream's. Where a batch of n
tokens costs about one (GPUs, the Intel AVX-512 VMs), n streams give about n times the throughput;
where it costs about n (the AMD CPUs here), about none.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StreamsRun:
    streams: int
    config: str
    tokens: int
    seconds: float
    per_stream_tps: float

    @property
    def aggregate_tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


CONFIGS = {"target": {"n_draft": 0}, "auto": {"n_draft": "auto"}}


def run_streams(decoder, prompts: list[str], counts: list[int], *, n_predict: int, configs=("target", "auto"),
                chat: bool = True, progress=None) -> list[StreamsRun]:
    """Every configuration at every stream count, interleaved (a shared machine drifts)."""
    runs = []
    for config in configs:  # (the slots' views are made per generation: they see the fresh pool)
        options = {"n_predict": n_predict, "temperature": 0.0, "chat": chat, **CONFIGS[config]}
        decoder.generate_many(prompts[:max(counts)], **{**options, "n_predict": 4})  # warm-up: graphs, costs
        for n in counts:
            runs.append(_one(decoder, prompts, n, config, options))
            if progress is not None:
                progress.update(1)
    return runs


def _one(decoder, prompts: list[str], n: int, config: str, options: dict) -> StreamsRun:
    """The prompts in rounds of n at once (each round as many prompts as slots, cycling through them)."""
    rounds = max(1, len(prompts) // n)
    tokens, seconds, rates = 0, 0.0, []
    for r in range(rounds):
        batch = [prompts[(r * n + i) % len(prompts)] for i in range(n)]
        _clear(decoder)  # each prompt evaluated afresh: no round reuses another's cache
        started = time.perf_counter()
        answers = decoder.generate_many(batch, **options)
        seconds += time.perf_counter() - started
        tokens += sum(a.stats.n_predict for a in answers)
        rates += [a.stats.decode_tps for a in answers]
    return StreamsRun(n, config, tokens, seconds, sum(rates) / len(rates) if rates else 0.0)


def _clear(decoder) -> None:
    """Empty caches and an empty n-gram pool: no round copies what an earlier one generated."""
    from .bench import _fresh_pool
    for slot in decoder.slots.slots:
        for ctx in slot.contexts():
            ctx.keep(0)
    _fresh_pool(decoder)


def markdown(runs: list[StreamsRun]) -> str:
    one = {r.config: r.aggregate_tps for r in runs if r.streams == 1}
    lines = ["| streams | config | tokens | seconds | aggregate tok/s | per stream tok/s | vs 1 stream |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        ratio = f"{r.aggregate_tps / one[r.config]:.2f}x" if one.get(r.config) else ""
        lines.append(f"| {r.streams} | {r.config} | {r.tokens} | {r.seconds:.2f} | {r.aggregate_tps:.1f} | "
                     f"{r.per_stream_tps:.1f} | {ratio} |")
    return "\n".join(lines)
