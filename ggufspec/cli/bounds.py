"""The limits of numeric flags that llama.cpp holds in fixed-width fields: a value past them is refused
in one line at parsing, where it would otherwise wrap in ctypes (2**32 threads are 0), abort in
llama.cpp (std::bad_alloc, a GGML_ASSERT) or exhaust the memory. And floats that are numbers: click's
FloatRange lets nan through (no comparison with it is true), and inf where a range has no upper end."""
from __future__ import annotations

import math

import click

from ..cpuflags import GGML_MAX_N_THREADS
from ..errors import GgufspecError

UINT32_MAX = 2 ** 32 - 1  # llama_context_params' n_ctx, n_batch and n_ubatch are uint32_t
INT32_MAX = 2 ** 31 - 1   # llama.cpp's int flags (std::stoi)
LLAMA_MAX_SEQ = 256       # the most sequences one llama.cpp context holds (llama-cparams.h)


class AtMost(click.IntRange):
    """click's IntRange whose refusal of a value above its upper end says where that limit comes from."""

    def __init__(self, low: int, high: int, why: str):
        super().__init__(low, high)
        self.why = why

    def convert(self, value, param, ctx):
        number = click.INT.convert(value, param, ctx)
        if number > self.max:
            self.fail(f"{number} is more than {self.max} ({self.why})", param, ctx)
        return super().convert(number, param, ctx)


def threads() -> AtMost:
    """-t, -tb, -td, -tbd and worker's -t: ggml runs at most GGML_MAX_N_THREADS threads a graph."""
    return AtMost(1, GGML_MAX_N_THREADS, "llama.cpp's GGML_MAX_N_THREADS")


def tokens(low: int = 1) -> AtMost:
    """-c, -b, -ub: llama.cpp's 32-bit token counts."""
    return AtMost(low, UINT32_MAX, "llama.cpp's 32-bit count of tokens")


class FiniteRange(click.FloatRange):
    """click's FloatRange that refuses nan and inf, which no ggufspec option means anything by."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number in the range {self._describe_range()}", param, ctx)
        return number


def check_sequences(flag: str, count: int, n_ctx: int | None, n_batch: int | None, n_ubatch: int | None) -> None:
    """-np's slots and bench --streams' count: sequences decoded at once, one output row each in a
    batch. llama.cpp's context holds at most LLAMA_MAX_SEQ of them (more fail its creation), and its
    outputs at most n_batch rows, n_batch itself at most the unified cache's -c (more abort the process:
    GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)). `n_ctx` None or 0: not bounding (the model's
    own context, or a cache per sequence); `n_batch`, `n_ubatch`: -b and -ub as given (None: not)."""
    from ..session import DEFAULT_BATCH, DEFAULT_UBATCH
    n_batch = n_batch or max(DEFAULT_BATCH, n_ubatch or DEFAULT_UBATCH)  # as the session loads it
    limits = [(LLAMA_MAX_SEQ, "llama.cpp's LLAMA_MAX_SEQ"), (n_batch, f"-b {n_batch}: one output row each; raise -b")]
    if n_ctx:
        limits.append((n_ctx, f"-c {n_ctx}: a cell each at least; raise -c"))
    limit, why = min(limits)
    if count > limit:
        raise GgufspecError(f"{flag} {count}: at most {limit} sequences at once ({why}); give {flag} {limit} or less")
