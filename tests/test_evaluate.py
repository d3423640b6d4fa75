"""HumanEval parity with tiny models: the structure, the real checker, greedy identity across modes.

Tiny random models write garbage, so pass@1 is 0 here; the checker itself is shown to pass a
canonical solution and to time out an endless loop.
"""
import json

import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.errors import GgufspecError
from ggufspec.evaluate import (Completion, check_all, load_problems, markdown, near_tie_margin, pass_at_1,
                               run_humaneval, total_steps, truncate_at_stop)


@pytest.fixture(scope="module")
def eval_decoder(tiny_pair):
    # HumanEval prompts are a few hundred byte tokens in the tiny vocabulary
    with SpeculativeDecoder(*tiny_pair, n_ctx=1024, n_threads=1) as decoder:
        yield decoder


class Counter:
    def __init__(self):
        self.n = 0

    def update(self, n):
        self.n += n


def test_greedy_run_checks_every_completion_and_modes_agree(eval_decoder):
    progress = Counter()
    result = run_humaneval(eval_decoder, limit=3, n_draft=3, temperature=0, n_predict=16, progress=progress)
    assert progress.n == total_steps(3, 1) == 12
    assert result["n_problems"] == 3 and [p["task_id"] for p in result["problems"]] == \
        ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    for mode in ("target", "speculative"):
        summary = result[mode]
        assert summary["n_completions"] == summary["n_checked"] == 3
        assert summary["pass@1"] == 0.0 and summary["n_passed"] == 0  # garbage code fails its tests
        assert summary["n_tokens"] > 0 and summary["decode_tps"] > 0
    for problem in result["problems"]:
        for mode in ("target", "speculative"):
            (c,) = problem[mode]
            assert c["result"].startswith(("failed", "timed out")), c  # the checker ran it
            assert c["passed"] is False and len(c["tokens"]) == c["n_tokens"] <= 16
    assert result["target"]["n_drafted"] == 0 and result["speculative"]["n_drafted"] > 0
    assert 0 <= result["speculative"]["acceptance"] <= 1 and result["speedup"] > 0
    greedy = result["greedy"]
    assert greedy["n_token_differ"] == 0 and greedy["n_differ"] == 0 and greedy["differ"] == []
    for problem in result["problems"]:  # the same tokens, the same completion
        assert problem["target"][0]["tokens"] == problem["speculative"][0]["tokens"]
        assert problem["target"][0]["completion"] == problem["speculative"][0]["completion"]
    json.dumps(result)  # --json prints it as is
    table = markdown(result)
    assert "| target alone | 0.0% ± 0.0 | 0/3 |" in table and "| speculative |" in table
    assert "identical in both modes on all 3 problems" in table


def test_sampled_run_counts_samples_per_problem(eval_decoder):
    result = run_humaneval(eval_decoder, limit=2, n_draft="auto", temperature=0.8, samples=2, n_predict=8, seed=5)
    assert result["greedy"] is None
    for mode in ("target", "speculative"):
        assert result[mode]["n_completions"] == result[mode]["n_checked"] == 4
    seeds = [c["seed"] for p in result["problems"] for c in p["target"]]
    assert seeds == [5, 6, 7, 8]
    assert "temperature 0.8, 2 samples per problem" in markdown(result)


def test_a_problem_longer_than_the_context_is_skipped_and_the_rest_kept(eval_decoder):
    first, second, third = load_problems(3)
    too_long = {**second, "prompt": second["prompt"] * 10}  # thousands of byte tokens: past n_ctx 1024
    progress = Counter()
    result = run_humaneval(eval_decoder, problems=[first, too_long, third], n_draft=3, n_predict=8, progress=progress)
    assert [p["task_id"] for p in result["problems"]] == ["HumanEval/0", "HumanEval/2"]
    assert result["n_problems"] == 2 and result["target"]["n_checked"] == 2 and not result["interrupted"]
    (skipped,) = result["skipped"]
    assert skipped["task_id"] == "HumanEval/1" and "the context holds 1024" in skipped["reason"]
    assert progress.n == total_steps(3)  # the bar ends full
    assert "Skipped 1: HumanEval/1 (the prompt is" in markdown(result)


def test_ctrl_c_keeps_the_problems_completed_in_both_modes(eval_decoder, monkeypatch):
    import ggufspec.evaluate as E
    real, calls = E.complete, []

    def interrupted_at_the_fourth(*args, **kwargs):  # problem 1's second mode
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(E, "complete", interrupted_at_the_fourth)
    result = run_humaneval(eval_decoder, limit=3, n_draft=3, n_predict=8)
    assert result["interrupted"] and [p["task_id"] for p in result["problems"]] == ["HumanEval/0"]
    assert result["target"]["n_checked"] == result["speculative"]["n_checked"] == 1
    assert "Interrupted" in markdown(result)
    assert eval_decoder.generate("def f():", n_predict=4, n_draft=3).stats.n_predict == 4  # still usable


def test_a_random_seed_is_drawn_once_and_said(eval_decoder):
    result = run_humaneval(eval_decoder, limit=2, temperature=0.8, samples=2, n_predict=4, seed=-1)
    seeds = [c["seed"] for p in result["problems"] for c in p["target"]]
    assert result["seed"] >= 0 and seeds == [result["seed"] + i for i in range(4)]


def test_checker_passes_a_canonical_solution_and_times_out_a_loop():
    problems = load_problems(limit=2)
    right = Completion(problems[0]["task_id"], "target", 0, 1, problems[0]["canonical_solution"], [], 0, 0.0, 0, 0, "stop")
    loop = Completion(problems[1]["task_id"], "target", 0, 1, "    while True:\n        pass\n", [], 0, 0.0, 0, 0, "stop")
    wrong = Completion(problems[1]["task_id"], "speculative", 0, 1, "    return []\n", [], 0, 0.0, 0, 0, "stop")
    check_all(problems, [right, loop, wrong], timeout=1.0)
    assert right.passed and right.result == "passed"
    assert not loop.passed and loop.result == "timed out"
    assert not wrong.passed and wrong.result.startswith("failed")


def test_stop_sequences_end_a_completion():
    body = "    return sorted(x)\n"
    for stop in ("\ndef helper():", "\nclass A:", "\nif __name__ == '__main__':", "\nprint(f(1))", "\n# test"):
        assert truncate_at_stop(body + stop + "\n    pass") == body
    assert truncate_at_stop(body) == body


def test_pass_at_1_is_the_unbiased_estimator_with_its_standard_error():
    score, stderr = pass_at_1([(4, 1), (4, 3)])  # per problem 0.25 and 0.75
    assert score == pytest.approx(0.5) and stderr == pytest.approx(0.25)
    assert pass_at_1([(1, 1)]) == (1.0, 0.0)


def test_bad_inputs_are_one_line_errors(eval_decoder):
    with pytest.raises(GgufspecError, match="--samples > 1 needs --temp > 0"):
        run_humaneval(eval_decoder, limit=1, temperature=0, samples=3)
    with pytest.raises(GgufspecError, match="--limit must be >= 1"):
        run_humaneval(eval_decoder, limit=0)


def test_near_tie_margin_is_the_targets_logit_gap_at_the_parting_token(eval_decoder):
    prompt = load_problems(limit=1)[0]["prompt"]
    alone = eval_decoder.generate(prompt, n_predict=6, temperature=0, n_draft=0)
    prefix, chosen = alone.tokens[:3], alone.tokens[3]
    others = [t for t in range(300) if t != chosen]
    margins = [near_tie_margin(eval_decoder, prompt, prefix, chosen, other) for other in others[:20]]
    assert min(margins) >= 0  # the target's greedy choice beats every other token
    assert near_tie_margin(eval_decoder, prompt, prefix, others[0], chosen) == pytest.approx(-margins[0], abs=1e-3)
    again = eval_decoder.generate(prompt, n_predict=6, temperature=0, n_draft=0)
    assert again.tokens == alone.tokens  # measuring left the decoder as it was


def test_markdown_names_the_differing_problems_and_their_margins():
    mode = {"pass@1": 0.5, "pass@1_stderr": 0.1, "n_passed": 20, "n_completions": 40, "n_tokens": 4000,
            "decode_tps": 20.0, "acceptance": 0.0}
    result = {"n_problems": 40, "samples": 1, "temperature": 0.0, "n_predict": 512, "n_draft": "auto",
              "target": mode, "speculative": {**mode, "decode_tps": 30.0, "acceptance": 0.7}, "speedup": 1.5,
              "greedy": {"n_differ": 1, "n_token_differ": 1, "only_target_passed": 0, "only_speculative_passed": 0,
                         "differ": [{"task_id": "HumanEval/12", "first_diff_token": 31, "margin": 0.0123}]}}
    table = markdown(result)
    assert "| speculative | 50.0% ± 10.0 | 20/40 | 4000 | 30.00 | 1.50x | 70.0% |" in table
    assert "HumanEval/12 from token 31 (logit margin 0.012)" in table
