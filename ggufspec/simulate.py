"""Replaying acceptance traces: what a K policy would have done with a pair, on a given machine.

A trace says, for every position of a greedy generation by the target, how far the draft model's
greedy proposals starting there agree with the target's tokens (`runs[i]`, up to MAX_RUN). That is
all a step needs: drafting k tokens from position i keeps min(k, runs[i]) of them and adds the
target's own token. Costs come from a `CostCurve`: the target's batch time T(n) for every n and a
draft token's time (a `costs.Costs`, measured or estimated), plus what a step costs around them.

The K policies are the engine's own controllers driven with simulated times: `drafting.FixedK`,
and for `auto` `drafting.AutoDrafting` itself (its AdaptiveK for the draft model, and the real
n-gram lookup over the trace's tokens), so a prediction follows the decisions `--draft auto`
would take. The loop below mirrors `speculate.speculative_steps` step by step, including how far
the draft lags behind (after a step that kept every draft token it has two tokens to catch up on;
after a run of steps without drafting, the whole stretch).

A trace is written by `ggufspec bench --record-trace` (see `traces`); this module reads it, checks
whose it is, and replays it. It imports only engine modules.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .costs import Costs
from .drafting import AdaptiveK, AutoDrafting, FixedK, LookupDrafter, ModelDrafter
from .ngram import NgramPool
from .errors import GgufspecError
from .native import common_prefix_length
from .sampling import SamplingParams

TRACE_FORMAT = "ggufspec-trace"
TRACE_VERSION = 1
MAX_RUN = 16               # runs are recorded up to this many agreeing tokens (K never goes past 8)
FINGERPRINT_BYTES = 1 << 20  # a GGUF header's first MiB: magic, version, architecture, shapes, types
MEASURED_SIZES = range(1, 10)  # target batches a cost curve knows (K up to 8: batches up to 9)
AUTO_PROBE_SIZES = (1, 2, 4, 8, 16)  # what `--draft auto` measures before its first step (measure_step_costs)


class TraceError(GgufspecError):
    """A trace file that cannot be used: empty, truncated, damaged, or from another pair."""


# ---------------------------------------------------------------- whose trace it is

def model_identity(path) -> dict:
    """A model file's name, size and a fingerprint of its header's first MiB (sha256, 16 hex digits)."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(FINGERPRINT_BYTES)
    return {"file": path.name, "size": path.stat().st_size, "fingerprint": hashlib.sha256(head).hexdigest()[:16]}


def pair_identity(target_path, draft_path) -> dict:
    return {"target": model_identity(target_path), "draft": model_identity(draft_path)}


def same_model(a: dict, b: dict) -> bool:
    """Same size and header; a fingerprint absent on either side (a model not on disk) is not compared."""
    if a.get("size") != b.get("size"):
        return False
    return not (a.get("fingerprint") and b.get("fingerprint")) or a["fingerprint"] == b["fingerprint"]


def same_pair(a: dict, b: dict) -> bool:
    return all(same_model(a.get(role, {}), b.get(role, {})) for role in ("target", "draft"))


def describe_pair(pair: dict) -> str:
    return " + ".join(f"{m.get('file', '?')} ({m.get('size', 0) / 2 ** 20:.0f} MiB)"
                      for m in (pair.get("target", {}), pair.get("draft", {})))


# ---------------------------------------------------------------- the trace file

@dataclass
class PromptTrace:
    """One prompt's greedy generation: per position, how far the draft's proposals agree."""

    prompt: str
    kind: str                   # chat | raw, as in the prompt file
    n_prompt: int
    runs: list[int]             # one per generated position (the end-of-generation token included)
    eos: bool = False           # the last position is the end marker (not output)
    p: list[float] | None = None       # the draft's probability of its proposal there (for p-min)
    tokens: list[int] | None = None    # prompt and generated tokens (the n-gram lookup replays on them)
    n_predict: int = 0                 # the generation's limit (an end marker may have come first)

    @property
    def n_output(self) -> int:
        return len(self.runs) - self.eos

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "kind": self.kind, "n_prompt": self.n_prompt, "n_predict": self.n_predict,
                "eos": self.eos, "runs": self.runs, "p": self.p, "tokens": self.tokens}


@dataclass
class Trace:
    pair: dict
    prompts: list[PromptTrace]
    source: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: the share of positions where the draft's first proposal agrees."""
        runs = [r for p in self.prompts for r in p.runs]
        return sum(r > 0 for r in runs) / len(runs) if runs else 0.0

    def check_pair(self, identity: dict) -> None:
        if not same_pair(self.pair, identity):
            raise TraceError(f"{self.source}: recorded on {describe_pair(self.pair)}, not on this pair "
                             f"({describe_pair(identity)}); record one with `ggufspec bench --record-trace FILE`")


def runs_from_agreement(agrees: list[bool], limit: int = MAX_RUN) -> list[int]:
    """runs[i]: how many consecutive positions from i agree (a greedy draft from i keeps that many)."""
    runs, streak = [0] * len(agrees), 0
    for i in range(len(agrees) - 1, -1, -1):
        streak = streak + 1 if agrees[i] else 0
        runs[i] = min(streak, limit)
    return runs


def write_trace(path, pair: dict, prompts: list[PromptTrace], meta: dict | None = None) -> None:
    """JSON lines: a header (format, pair, meta), a line per prompt, an end line counting them. A
    prompt that generated nothing (no position) is left out: there is nothing of it to replay."""
    if not (prompts := [p for p in prompts if p.runs]):
        raise TraceError(f"{os.fspath(path)}: no prompt generated a token: no trace to write (raise -n)")
    lines = [{"format": TRACE_FORMAT, "version": TRACE_VERSION, "pair": pair, "max_run": MAX_RUN, **(meta or {})}]
    lines += [p.to_json() for p in prompts] + [{"end": len(prompts)}]
    Path(path).write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines), encoding="utf-8")


def read_trace(path) -> Trace:
    """A trace file, checked whole: one clear line for an empty, damaged or truncated one."""
    name = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError(f"{name}: no such trace file (write one with `ggufspec bench --record-trace FILE`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{name}: cannot read it as a trace ({getattr(exc, 'strerror', None) or exc})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise TraceError(f"{name}: the trace file is empty")
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            truncated = number == len(lines) and not text.endswith("\n")
            raise TraceError(f"{name}:{number}: " + ("the trace ends mid-line: truncated, record it again"
                             if truncated else "not JSON: a damaged trace")) from None
    header = records[0]
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise TraceError(f"{name}: not a ggufspec trace (its first line has no \"format\": \"{TRACE_FORMAT}\")")
    if header.get("version") != TRACE_VERSION:
        raise TraceError(f"{name}: trace version {header.get('version')!r}; this ggufspec reads {TRACE_VERSION}")
    end, pair = records[-1], header.get("pair") or {}
    if not isinstance(pair, dict) or not all(isinstance(m := pair.get(role, {}), dict) and _whole(m.get("size", 0))
                                             for role in ("target", "draft")):
        raise TraceError(f"{name}: its \"pair\" is not the two models' file, size and fingerprint: a damaged "
                         f"trace, record it again")
    if len(records) < 2 or not isinstance(end, dict) or "end" not in end:
        raise TraceError(f"{name}: the trace stops after {len(records) - 1} prompt(s) without its end line: "
                         f"truncated, record it again")
    prompts = [_prompt_trace(name, number, r) for number, r in enumerate(records[1:-1], 2)]
    if not _whole(end["end"]):
        raise TraceError(f"{name}: its end line's count {end['end']!r} is not a number: a damaged trace, record it again")
    if end["end"] != len(prompts):
        raise TraceError(f"{name}: the end line counts {end['end']} prompt(s) but the file holds {len(prompts)}: "
                         f"a damaged trace, record it again")
    if not (prompts := [p for p in prompts if p.runs]):  # a prompt that generated nothing: nothing to replay
        raise TraceError(f"{name}: the trace holds no generated token: record it again with a larger -n")
    meta = {k: v for k, v in header.items() if k not in ("format", "version", "pair")}
    return Trace(pair, prompts, name, meta)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_trace(name: str, number: int, record) -> PromptTrace:
    try:
        runs, p, tokens = record["runs"], record.get("p"), record.get("tokens")
        trace = PromptTrace(str(record["prompt"]), str(record.get("kind", "raw")), record["n_prompt"], runs,
                            bool(record.get("eos", False)) and bool(runs), p, tokens, record.get("n_predict", 0))
        assert isinstance(runs, list) and all(_whole(r) and 0 <= r <= MAX_RUN for r in runs)
        assert _whole(trace.n_prompt) and trace.n_prompt >= 1 and _whole(trace.n_predict)
        assert p is None or isinstance(p, list) and len(p) == len(runs) and all(
            isinstance(x, (int, float)) and 0 <= x <= 1 for x in p)
        assert tokens is None or isinstance(tokens, list) and len(tokens) == trace.n_prompt + len(runs) and all(
            _whole(t) for t in tokens)
    except (KeyError, TypeError, ValueError, AssertionError):
        raise TraceError(f"{name}:{number}: not a prompt's trace (prompt, n_prompt, runs of 0..{MAX_RUN}, "
                         f"its tokens whole numbers and p probabilities): a damaged trace, record it again") from None
    return trace


TRACE_FOLDER = "traces"  # in ggufspec's home: traces recorded on this machine, found by pair


def trace_files() -> list[Path]:
    """The traces shipped with ggufspec (its data folder: trace-*.jsonl), then those in its home."""
    from importlib import resources
    from .home import home
    shipped = Path(str(resources.files("ggufspec").joinpath("data")))
    return sorted(shipped.glob("trace-*.jsonl")) + sorted((home() / TRACE_FOLDER).glob("*.jsonl"))


def known_traces(identity: dict) -> list[Trace]:
    """Every known trace recorded on this pair (unreadable ones are passed over, said on stderr: they
    are only hints, and never stop a plan or a bench)."""
    import sys
    found = []
    for path in trace_files():
        try:
            trace = read_trace(path)
        except Exception as exc:  # noqa: BLE001  whatever is wrong with the file
            reason = str(exc).removeprefix(f"{path}: ") or type(exc).__name__
            print(f"ggufspec: passed over the known trace {path} ({reason})", file=sys.stderr)
            continue
        if same_pair(trace.pair, identity):
            found.append(trace)
    return found


def merged(traces: list[Trace]) -> Trace | None:
    """Several traces of one pair as one (all their prompts); None for none."""
    if not traces:
        return None
    if len(traces) == 1:
        return traces[0]
    return Trace(traces[0].pair, [p for t in traces for p in t.prompts], " + ".join(t.source for t in traces))


@functools.lru_cache(maxsize=8)  # the planner replays the same assumption for every option
def synthetic_trace(acceptance: float, n_positions: int = 4096, seed: int = 0) -> Trace:
    """Agreement drawn independently at each position with probability `acceptance`: the model behind
    `costmodel` (Leviathan et al.), for a pair without a recorded trace."""
    agrees = (np.random.default_rng(seed).random(n_positions) < acceptance).tolist()
    return Trace({}, [PromptTrace("assumed", "raw", 0, runs_from_agreement(agrees))], f"assumed {acceptance:.2f}")


# ---------------------------------------------------------------- what a step costs

@dataclass
class CostCurve:
    """The costs a replay charges. `costs`: T(n) (its batch_model) and a draft token (t_draft);
    `step_seconds`: the rest of a step (Python, sampling bookkeeping); `row_seconds`: reading one
    row of logits (an argmax over the vocabulary), per verified position and per draft token;
    `draft_batches`: the draft's measured time for a batch of n (its catch-up after a step);
    `remembered`: what `--draft auto`'s controller starts from on this machine (costs.json), where
    known: its decisions follow what it believes, not the curve (else it starts from the curve's
    sizes that measure_step_costs times)."""

    costs: Costs
    step_seconds: float = 0.0
    row_seconds: float = 0.0
    source: str = "estimated"
    draft_batches: dict[int, float] = field(default_factory=dict)
    remembered: Costs | None = None

    def target(self, n: int) -> float:
        return self.costs.batch_model()(n)

    @property
    def t_draft(self) -> float:
        return self.costs.t_draft

    def draft_batch(self, n: int) -> float:
        """The draft evaluating n tokens at once (catching up): measured where it was, else the
        nearest smaller measured size (a draft token at least) scaled by the target's batch curve,
        whose per-token cost stops falling past the sizes it knows. The draft's own curve can be
        far flatter than the target's (the demo pair on a 2-core Xeon: T_draft(2) = 1.06 T_draft(1),
        T(2) = 1.73 T(1)): two tokens of catch-up after every fully kept step are worth measuring."""
        if n <= 0:
            return 0.0
        if n in self.draft_batches:
            return self.draft_batches[n]
        base = max((m for m in self.draft_batches if m < n), default=1)
        base_seconds = self.draft_batches.get(base, self.t_draft)
        largest = max(MEASURED_SIZES)
        target_n = self.target(n) if n <= largest else n * self.target(largest) / largest
        return base_seconds * target_n / self.target(base)

    @property
    def alone_seconds(self) -> float:
        """The target alone, per token."""
        return self.target(1) + self.row_seconds + self.step_seconds


def curve_from_times(batch_seconds: dict[int, float], draft_seconds: float, **extra) -> CostCurve:
    """A curve through given T(n) and draft-token times (each kept as a Costs measurement)."""
    costs = Costs()
    for n, seconds in sorted(batch_seconds.items()):
        costs.add_batch(int(n), float(seconds))
    costs.draft_times.append(float(draft_seconds))
    return CostCurve(costs, **extra)


def scaled_curve(curve: CostCurve, draft_ratio: float) -> CostCurve:
    """The same target, with a draft token costing draft_ratio * T(1)."""
    times = {n: curve.target(n) for n in MEASURED_SIZES}
    scale = draft_ratio * times[1] / curve.t_draft if curve.t_draft else 0.0  # the draft's own curve, scaled
    return curve_from_times(times, draft_ratio * times[1], step_seconds=curve.step_seconds,
                            row_seconds=curve.row_seconds, source=curve.source,
                            draft_batches={n: t * scale for n, t in curve.draft_batches.items()})


# ---------------------------------------------------------------- policies and the replay

@dataclass(frozen=True)
class Policy:
    """k = 0: the target alone; k >= 1: fixed K (p_min: stop drafting when unsure); auto: `--draft auto`."""

    k: int = 0
    auto: bool = False
    p_min: float = 0.0
    k_max: int = 8

    @property
    def name(self) -> str:
        return "auto" if self.auto else ("target" if self.k == 0 else f"K={self.k}")


@dataclass
class Replay:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class _TraceDraft:
    """The draft model as the trace saw it (a stand-in for `drafting.ModelDrafter`): its proposals
    agree with the target's tokens for runs[i] positions, and it charges the curve's times for what
    the real one would evaluate: the tokens it lags behind by, then all but its last proposal."""

    CATCH_UP = ModelDrafter.CATCH_UP

    @property
    def context(self):  # what auto reads of a draft model's context: how far it has evaluated (n_past)
        return self

    def __init__(self, trace: PromptTrace, sequence: list[int], curve: CostCurve, p_min: float):
        self.trace, self.sequence, self.curve, self.p_min = trace, sequence, curve, p_min
        self.n_past = trace.n_prompt - 1  # the prompt (less its last token) is cached: bench reuses it
        self.seconds = self.catch_up_seconds = 0.0  # of the last proposal, catching up included

    def propose(self, tokens, k, params, draws, guide=None):
        length, i = len(tokens), len(tokens) - self.trace.n_prompt
        lag = length - self.n_past
        catch_up = self.curve.draft_batch(lag)
        self.catch_up_seconds = catch_up if lag > self.CATCH_UP else 0.0
        run = self.trace.runs[i] if i < len(self.trace.runs) else 0
        n = k
        if self.p_min > 0 and self.trace.p is not None:  # known while the draft's context is the target's
            n = next((j for j in range(1, min(k, run + 1, len(self.trace.p) - i)) if self.trace.p[i + j] < self.p_min), k)
        evaluated = n - 1 if n == k else n  # the last proposal is read, not evaluated (unless it stopped)
        self.n_past = length + evaluated
        self.seconds = catch_up + evaluated * self.curve.t_draft + n * self.curve.row_seconds
        kept = min(n, run)
        return self.sequence[length:length + kept] + [-1] * (n - kept)


class Process:
    """What outlives one generation in a process that serves several: what `--draft auto` has
    learned (its Costs: step times, n-gram tallies), and, where requests share one (a server,
    `shared_pool`), the n-gram pool every request adds to, so that `auto` drafts from earlier answers
    as the decoder would. Without it each generation starts from an empty pool, as a single `run`
    and each of bench's runs do."""

    def __init__(self, curve: "CostCurve", shared_pool: bool = False):
        self.pool = NgramPool() if shared_pool else None
        self.costs = Costs.from_dict(curve.remembered.to_dict()) if curve.remembered is not None else Costs()
        if not self.costs.warm:
            for n in AUTO_PROBE_SIZES * 3:  # what measure_step_costs finds before the first step
                self.costs.add_batch(n, curve.target(n))
            self.costs.draft_times.append(curve.t_draft)


def replay_prompt(trace: PromptTrace, curve: CostCurve, policy: Policy, process: Process | None = None) -> Replay:
    """One prompt's generation under `policy`, timed by `curve` (see `speculate.speculative_steps`);
    `process`: what earlier generations left (else a fresh process)."""
    if trace.tokens is None:  # unknown tokens, never repeating: a prompt of them as long as what is generated
        trace = dataclasses.replace(trace, n_prompt=min(trace.n_prompt, len(trace.runs) + 1))  # does the same
    sequence = trace.tokens or list(range(-2, -3 - trace.n_prompt - len(trace.runs), -1))
    draft = _TraceDraft(trace, sequence, curve, policy.p_min)
    drafter, controller = draft, FixedK(policy.k)
    if policy.auto:
        process = process or Process(curve)
        # copies end at an end of turn as the engine's do; the trace knows one end marker: its own last token
        ends = {trace.tokens[-1]} if trace.eos and trace.tokens else set()
        ngram = LookupDrafter(1 << 31, process.pool if process.pool is not None else NgramPool(),
                              is_end=ends.__contains__)
        drafter = controller = AutoDrafting(ngram, draft, process.costs, policy.k_max)
    params, out = SamplingParams(temperature=0.0), Replay()
    # the prompt's own batch decides the first token (speculate._prefill): the steps start after it
    pos, end = min(1, len(trace.runs)), len(trace.runs)
    limit = max(trace.n_predict, end)  # the generation could have gone on to n_predict but for the end marker
    drafting = policy.k > 0 or policy.auto
    while pos < end:
        k = controller.choose(limit - pos - 1) if drafting else 0  # a step adds up to k + 1 tokens
        length = trace.n_prompt + pos
        draft.seconds = draft.catch_up_seconds = 0.0  # the lookup drafts for free
        proposals = drafter.propose(sequence[:length], k, params, None) if k > 0 else []
        n_accepted = common_prefix_length(proposals, sequence[length:length + len(proposals)])
        verify = curve.target(len(proposals) + 1) + (len(proposals) + 1) * curve.row_seconds
        if proposals:  # both caches are cut back to what was kept
            draft.n_past = min(draft.n_past, length + n_accepted)
        if drafting:  # a catch-up after the draft sat idle is not a per-token cost (as in speculate)
            controller.observe(len(proposals), n_accepted, draft.seconds - draft.catch_up_seconds, verify)
        out.seconds += draft.seconds + verify + curve.step_seconds
        out.steps += 1
        out.drafted += len(proposals)
        out.accepted += n_accepted
        pos += n_accepted + 1
    out.tokens = trace.n_output
    return out


@dataclass
class Prediction:
    policy: str
    speedup: float              # against the target alone (see predict)
    tokens_per_second: float    # all prompts together
    acceptance: float           # accepted / drafted
    per_prompt: dict[str, float] = field(default_factory=dict)


def predict(trace: Trace, curve: CostCurve, policy: Policy, prompts: list[str] | None = None,
            repeats: int = 1) -> Prediction:
    """Replay `policy` over the trace's prompts, in order, in one process, and compare with the target alone.

    Named prompts (a bench's own, recorded in the same run): each replayed `repeats` times in a row
    as bench runs it, and the median of their speedups, as bench reports its measurement. Otherwise
    every prompt of the trace, pooled (all tokens over all seconds): the trace stands for text like
    it, and a long answer weighs more than a short one."""
    replayable = [p for p in trace.prompts if p.runs]  # a prompt that generated nothing tells nothing
    chosen = [p for p in replayable if prompts is None or p.prompt in prompts] or replayable
    per_prompt, total, alone = {}, Replay(), Replay()
    process = Process(curve) if policy.auto else None
    for p in chosen:
        by_itself = replay_prompt(p, curve, Policy(0))
        runs = [replay_prompt(p, curve, policy, process) for _ in range(repeats)]
        rate = statistics.median(r.tokens_per_second for r in runs)
        per_prompt[p.prompt] = rate / by_itself.tokens_per_second if by_itself.seconds else 0.0
        for run in runs:
            for name in ("tokens", "seconds", "drafted", "accepted", "steps"):
                setattr(total, name, getattr(total, name) + getattr(run, name))
            alone.tokens, alone.seconds = alone.tokens + by_itself.tokens, alone.seconds + by_itself.seconds
    pooled = total.tokens_per_second / alone.tokens_per_second if alone.seconds else 0.0
    speedup = statistics.median(per_prompt.values()) if prompts is not None and per_prompt else pooled
    return Prediction(policy.name, speedup, total.tokens_per_second,
                      total.accepted / total.drafted if total.drafted else 0.0, per_prompt)


def best_fixed_k(trace: Trace, curve: CostCurve, k_max: int = 8) -> Prediction:
    """The fixed K (1..k_max) with the highest predicted speedup."""
    return max((predict(trace, curve, Policy(k)) for k in range(1, k_max + 1)), key=lambda p: p.speedup)
