"""Acceptance traces and the simulator: a replay follows the engine step for step, and bad traces are
one clear line each."""
import json

import numpy as np
import pytest

from ggufspec import costmodel as C
from ggufspec import drafting
from ggufspec import simulate as S
from ggufspec.traces import TraceRecorder

PROMPTS = [{"id": "cat", "prompt": "the cat"}, {"id": "abc", "prompt": "a b c d"},
           {"id": "tale", "prompt": "once upon a time"}, {"id": "x", "kind": "chat", "prompt": "x"}]
FLAT = S.curve_from_times({n: 0.01 for n in S.MEASURED_SIZES}, 0.002)                    # memory-bound
CPU = S.curve_from_times({n: 0.038 * (1 + 0.73 * (n - 1)) for n in S.MEASURED_SIZES}, 0.023)  # a 2-core CPU


@pytest.fixture(scope="module")
def recorded(tiny_decoder):
    recorder = TraceRecorder(tiny_decoder, 40)
    for item in PROMPTS:
        recorder.add(item)
    return recorder.trace()


# ---------------------------------------------------------------- the replay is the engine's loop

@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_fixed_k_replay_drafts_and_keeps_what_the_decoder_does(tiny_decoder, recorded, k):
    for item, trace in zip(PROMPTS, recorded.prompts):
        stats = tiny_decoder.generate(item["prompt"], n_predict=40, n_draft=k, chat=item.get("kind") == "chat").stats
        replay = S.replay_prompt(trace, FLAT, S.Policy(k))
        assert (replay.drafted, replay.accepted, replay.steps, replay.tokens) == \
            (stats.n_drafted, stats.n_accept, stats.n_steps, stats.n_predict), item["id"]


def test_p_min_keeps_what_the_decoder_keeps(tiny_decoder, recorded):
    for item, trace in zip(PROMPTS, recorded.prompts):
        stats = tiny_decoder.generate(item["prompt"], n_predict=40, n_draft=4, draft_p_min=0.6,
                                      chat=item.get("kind") == "chat").stats
        replay = S.replay_prompt(trace, FLAT, S.Policy(4, p_min=0.6))
        # what the draft proposes after its first wrong token is not in the trace: assumed to go on
        assert (replay.accepted, replay.steps) == (stats.n_accept, stats.n_steps)
        assert replay.drafted >= stats.n_drafted


def test_recorded_runs_are_consecutive_agreements(recorded):
    for trace in recorded.prompts:
        for run, following in zip(trace.runs, trace.runs[1:]):
            assert run == 0 or run == min(following + 1, S.MAX_RUN)
        assert len(trace.tokens) == trace.n_prompt + len(trace.runs)


def test_an_iid_trace_reproduces_the_cost_models_formula():
    trace = S.synthetic_trace(0.7, 20000)
    for k in (1, 2, 4):
        predicted = S.predict(trace, FLAT, S.Policy(k)).speedup
        assert predicted == pytest.approx(C.speedup(k, 0.7, 0.002, 0.01, 0.01), rel=0.01)


def test_auto_is_driven_by_the_engines_own_controller(monkeypatch):
    calls = []
    original = drafting.AdaptiveK.choose
    monkeypatch.setattr(drafting.AdaptiveK, "choose", lambda self, max_k: calls.append(max_k) or original(self, max_k))
    trace = S.synthetic_trace(0.8, 2000)
    flat = S.predict(trace, FLAT, S.Policy(auto=True))
    assert calls and flat.speedup > 1.5  # drafting pays on a memory-bound device: auto drafts
    cpu = S.replay_prompt(trace.prompts[0], CPU, S.Policy(auto=True))
    assert cpu.drafted == 0 and cpu.steps == cpu.tokens - 1  # here no draft could pay: it never drafts


def test_a_draft_that_lagged_behind_pays_to_catch_up():
    trace = S.synthetic_trace(1.0, 64).prompts[0]
    one = S.replay_prompt(trace, CPU, S.Policy(1))
    # every step keeps its draft token: the next one starts with a 2-token catch-up batch on the draft
    # (the first with the prompt's last token and the first token, which the prompt's batch decided);
    # the 64th token is left alone for the last step, which has no room for a draft
    expected_step = CPU.draft_batch(2) + CPU.target(2)
    assert one.seconds == pytest.approx((one.steps - 1) * expected_step + CPU.target(1))


def test_a_repeat_finds_its_first_answer_in_the_pool():
    """A process whose requests share the n-gram pool (a server): auto's second run of a prompt copies
    its first answer; a prediction (each generation from an empty pool, as bench runs them) does not."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, 300).tolist()  # an answer that never repeats itself
    trace = S.Trace({}, [S.PromptTrace("p", "raw", 20, [0] * 280, tokens=tokens, n_predict=280)])
    first, second = (S.replay_prompt(trace.prompts[0], FLAT, S.Policy(auto=True), process)
                     for process in [S.Process(FLAT, shared_pool=True)] * 2)
    assert first.accepted == 0 and second.accepted > 200 and second.steps < first.steps / 3
    repeated = S.predict(trace, FLAT, S.Policy(auto=True), ["p"], repeats=2)
    assert repeated.acceptance == 0


def test_the_best_fixed_k_and_a_scaled_draft():
    trace = S.synthetic_trace(0.8, 4000)
    cheap, dear = S.scaled_curve(FLAT, 0.05), S.scaled_curve(FLAT, 0.67)
    assert S.best_fixed_k(trace, cheap).speedup > 2 > S.best_fixed_k(trace, dear).speedup
    assert S.best_fixed_k(trace, S.scaled_curve(CPU, 0.6)).speedup < 1


# ---------------------------------------------------------------- the file: round trip and bad input

def test_a_trace_file_round_trips(recorded, tmp_path):
    path = tmp_path / "t.jsonl"
    S.write_trace(path, recorded.pair, recorded.prompts, {"n_predict": 40})
    back = S.read_trace(path)
    assert [p.to_json() for p in back.prompts] == [p.to_json() for p in recorded.prompts]
    assert back.pair == recorded.pair and back.meta["n_predict"] == 40
    assert back.acceptance == pytest.approx(recorded.acceptance)


def one_line_error(path, match):
    with pytest.raises(S.TraceError, match=match) as info:
        S.read_trace(path)
    assert "\n" not in str(info.value)


def test_bad_trace_files_are_one_line_each(recorded, tmp_path):
    good = tmp_path / "good.jsonl"
    S.write_trace(good, recorded.pair, recorded.prompts)
    lines = good.read_text().splitlines(keepends=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    one_line_error(empty, "empty")
    one_line_error(tmp_path / "missing.jsonl", "no such trace file")
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-1]))                           # stopped at a line's end
    one_line_error(cut, "without its end line: truncated")
    cut.write_text("".join(lines[:2]) + lines[2][:40])            # stopped mid-line
    one_line_error(cut, "ends mid-line: truncated")
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text(lines[0] + "{nope\n" + "".join(lines[2:]))
    one_line_error(damaged, ":2: not JSON")
    other = tmp_path / "prompts.jsonl"
    other.write_text('{"prompt": "hi"}\n')
    one_line_error(other, "not a ggufspec trace")
    bad_runs = tmp_path / "runs.jsonl"
    record = json.loads(lines[1]) | {"runs": [99]}
    bad_runs.write_text(lines[0] + json.dumps(record) + "\n" + '{"end": 1}\n')
    one_line_error(bad_runs, ":2: not a prompt's trace")


def test_a_trace_of_another_pair_is_refused_in_one_line(recorded, tiny_pair, tmp_path):
    theirs = {"target": {"file": "big.gguf", "size": 123, "fingerprint": "ab"},
              "draft": {"file": "small.gguf", "size": 45, "fingerprint": "cd"}}
    trace = S.Trace(theirs, recorded.prompts, "other.jsonl")
    with pytest.raises(S.TraceError, match=r"other.jsonl: recorded on big.gguf .* not on this pair") as info:
        trace.check_pair(S.pair_identity(*tiny_pair))
    assert "\n" not in str(info.value)
    recorded.check_pair(S.pair_identity(*tiny_pair))  # its own pair passes
    renamed = dict(recorded.pair["target"], file="renamed.gguf")
    assert S.same_pair({"target": renamed, "draft": recorded.pair["draft"]}, recorded.pair)  # names are not identity


def test_shipped_traces_are_the_demo_pairs_and_readable():
    files = [f for f in S.trace_files() if f.name.startswith("trace-demo-")]
    assert {f.stem for f in files} >= {"trace-demo-code", "trace-demo-chat"}
    for path in files:
        trace = S.read_trace(path)
        assert trace.pair["target"]["file"] == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
        assert trace.pair["draft"]["file"] == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        assert 0.3 < trace.acceptance < 1 and path.stat().st_size < 200_000


@pytest.mark.slow
def test_shipped_traces_match_the_installed_demo_pair():
    from conftest import demo_pair_paths
    found = S.known_traces(S.pair_identity(*demo_pair_paths()))
    assert {S.Path(t.source).stem for t in found} >= {"trace-demo-code", "trace-demo-chat"}
