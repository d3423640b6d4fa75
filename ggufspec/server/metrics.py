"""`GET /metrics` (with `serve --metrics`): llama-server's Prometheus counters and gauges, under its
names (`llamacpp:...`), so that a dashboard made for llama-server reads ggufspec's unchanged.

Counted per choice as it ends, whether whole, stopped or cancelled (its tokens were computed either
way). The two throughput gauges are averages since the last read of /metrics, as llama-server's
"bucket". `n_decode_total` and `n_busy_slots_per_decode` come from the slots' own count of the
target's llama_decode calls (`DecodeCounts`: one per shared step or prompt chunk, with the slots
generating at it), not from the answers."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..stats import Stats


@dataclass
class Throughput:
    """Tokens and the seconds they took: a counter's pair, or a bucket's since the last read."""
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Metrics:
    """What every choice of every request added up to since the server started."""

    def __init__(self):
        self.started = int(time.time())
        self._lock = threading.Lock()  # the slots' worker threads add, a request reads
        self.prompt, self.predicted = Throughput(), Throughput()
        self.prompt_bucket, self.predicted_bucket = Throughput(), Throughput()
        self.n_prompt_cached = self.n_tokens_max = 0
        self.n_drafted = self.n_accepted = self.n_draft_steps = 0

    def add(self, stats: Stats) -> None:
        evaluated = max(0, stats.n_prompt - stats.n_prompt_cached)  # llama-server: "excluding cached tokens"
        with self._lock:
            for prompt in (self.prompt, self.prompt_bucket):
                prompt.add(evaluated, stats.prompt_seconds)
            for predicted in (self.predicted, self.predicted_bucket):
                predicted.add(stats.n_predict, stats.decode_seconds)
            self.n_prompt_cached += stats.n_prompt_cached
            self.n_tokens_max = max(self.n_tokens_max, stats.n_prompt + stats.n_predict)
            self.n_drafted += stats.n_drafted
            self.n_accepted += stats.n_accept
            self.n_draft_steps += stats.n_draft_steps

    def prometheus(self, requests_processing: int, requests_deferred: int, decodes=None) -> str:
        """The text exposition format (version 0.0.4); the buckets start again. `decodes`: the slots'
        `DecodeCounts` (the target's llama_decode calls and the busy slots at each)."""
        n_decode, n_busy_slots = (decodes.n_decode, decodes.n_busy_slots) if decodes is not None else (0, 0)
        with self._lock:
            counters = [
                ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt.tokens),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self.n_prompt_cached),
                ("prompt_seconds_total", "Total time spent processing prompts", self.prompt.seconds),
                ("tokens_predicted_total", "Number of generation tokens processed", self.predicted.tokens),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predicted.seconds),
                ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and "
                 "multimodal decoding", n_decode),
                ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max),
                ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", self.n_drafted),
                ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target "
                 "model", self.n_accepted),
                ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
                 self.n_draft_steps),
            ]
            gauges = [
                ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self.prompt_bucket.per_second),
                ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
                 self.predicted_bucket.per_second),
                ("requests_processing", "Number of requests processing", requests_processing),
                ("requests_deferred", "Number of requests deferred", requests_deferred),
                ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
                 n_busy_slots / max(n_decode, 1)),
            ]
            self.prompt_bucket, self.predicted_bucket = Throughput(), Throughput()
        return "".join(_metric(name, kind, help_text, value)
                       for kind, items in (("counter", counters), ("gauge", gauges))
                       for name, help_text, value in items)


def _metric(name: str, kind: str, help_text: str, value: int | float) -> str:
    shown = value if isinstance(value, int) else round(value, 6)
    return f"# HELP llamacpp:{name} {help_text}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {shown}\n"
