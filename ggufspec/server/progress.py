"""llama-server's stream extras: `return_progress` (`prompt_progress: {total, cache, processed, time_ms}`
chunks while the prompt is evaluated, before the first token) and `timings_per_token` (each chunk
carries the `timings` so far).

The engine evaluates a prompt in chunks of n_batch tokens and asks its context's `should_stop` before
each (to stop the prompt of a client gone): `PromptProgress` answers that question for the target and
reports how many tokens the cache holds by then: before the first chunk the cache's share alone
(llama-server's first block, sent as the prompt starts), then after each chunk, as llama-server reports
after each batch. The last block (all of the prompt processed) follows from the "prompt" event, when the
first token is decided. Within a chunk nothing is reported (the engine does not ask there)."""
from __future__ import annotations

import time

from ..stats import Stats


def progress_block(total: int, cache: int, processed: int, seconds: float) -> dict:
    """llama-server's prompt_progress (result_prompt_progress::to_json): time_ms since the prompt began."""
    return {"total": total, "cache": cache, "processed": processed, "time_ms": int(seconds * 1000)}


class PromptProgress:
    """The target's `should_stop` while a choice's prompt is evaluated: a "progress" event each time
    the cache holds more of it (asked between chunks, and while a chunk waits for room among the
    slots' batch), then whether the client has left."""

    def __init__(self, job, index: int, target, stats: Stats):
        self.job, self.index, self.target, self.stats = job, index, target, stats
        self.started, self.reported = time.perf_counter(), -1

    def __call__(self) -> bool:
        processed = self.target.n_past
        if processed != self.reported:
            self.reported = processed
            block = progress_block(self.stats.n_prompt, self.stats.n_prompt_cached, processed,
                                   time.perf_counter() - self.started)
            self.job.emit("progress", (self.index, block))
        return self.job.gone()


class StreamExtras:
    """What a stream adds to its chunks for a job that asked (`Job.return_progress`,
    `Job.timings_per_token`): each choice's progress blocks, the last one once, and its latest statistics."""

    def __init__(self, job):
        self.progress, self.per_token = job.return_progress, job.timings_per_token
        self.prompt_done: set[int] = set()  # choices whose whole prompt's block went out
        self.latest: dict[int, Stats] = {}

    def progress_of(self, kind: str, value) -> tuple[int, dict] | None:
        """(choice index, prompt_progress) to send for a job's event, if any: a "progress" event's, or the
        whole prompt's at the choice's "prompt" event (or at its end, where it generated nothing)."""
        if not self.progress or kind not in ("progress", "prompt", "choice"):
            return None
        index = value[0]
        if kind == "progress":
            return None if index in self.prompt_done else value
        if index in self.prompt_done:
            return None
        self.prompt_done.add(index)
        if kind == "prompt":
            info = value[1]
            return index, progress_block(info["n_prompt"], info["cache_n"], info["n_prompt"], info["prompt_ms"] / 1000)
        stats = value[1]
        return index, progress_block(stats.n_prompt, stats.n_prompt_cached, stats.n_prompt, stats.prompt_seconds)

    def stats_of(self, index: int, pieces: list[dict]) -> Stats | None:
        """The choice's statistics as its latest pieces left them (None: not asked, or none yet)."""
        if not self.per_token:
            return None
        carried = next((piece["stats"] for piece in reversed(pieces) if "stats" in piece), None)
        if carried is not None:
            self.latest[index] = carried
        return self.latest.get(index)
