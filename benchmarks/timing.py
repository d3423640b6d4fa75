"""The benchmarks' per-row timing: the best of a few rounds (interference on a shared machine only adds time)."""
import time


def best_us(run, rows: int = 100, rounds: int = 3) -> float:
    """Microseconds a call of run(i), i = 0..rows-1, in the best of `rounds` rounds."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(rows):
            run(i)
        best = min(best, (time.perf_counter() - t0) / rows)
    return round(best * 1e6, 1)
