"""Odd inputs to `plan` and the simulator, as a QA pass found them: damaged GGUF metadata, an
nvidia-smi that reports no memory, malformed sizes, a damaged costs.json, damaged trace files.
Each is one line and exit 2 (or a hint passed over with one line), never a traceback or a NaN."""
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import plan as P
from ggufspec import simulate as S
from ggufspec.cli import main
from ggufspec.costs import Costs
from ggufspec.errors import GgufspecError
from ggufspec.plan import devices as D
from ggufspec.plan import measured as M


def one_line_exit_2(result, *needles):
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, text
    return text


# ---------------------------------------------------------------- 1. the GGUF header's sizes

def odd_gguf(path, n_layer=2, n_tensors=None, arch="llama", **keys):
    """A small GGUF with the usual shape keys; keys: name -> (writer method, value) replacing or
    adding one (None: left out). n_tensors: how many blk.N tensors (default n_layer)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    usual = {"block_count": ("add_uint32", n_layer), "embedding_length": ("add_uint32", 8),
             "attention.head_count": ("add_uint32", 2), "attention.head_count_kv": ("add_uint32", 1),
             "feed_forward_length": ("add_uint32", 16), "context_length": ("add_uint32", 64)}
    for key, spec in (usual | keys).items():
        if spec is not None:
            getattr(w, spec[0])(f"{arch}.{key}", spec[1])
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    for i in range(n_layer if n_tensors is None else n_tensors):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((8, 8), np.float32))
    w.add_tensor("output.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def plan_json(path, *more):
    return CliRunner().invoke(main, ["plan", "-m", str(path), "--vram", "8GiB", "--ram", "16GiB", "--json", *more])


@pytest.mark.parametrize("case, keys, needle", [
    ("string", {"block_count": ("add_string", "2")}, "llama.block_count is '2'"),
    ("float", {"block_count": ("add_float32", 2.0)}, "llama.block_count is 2.0"),
    ("negative", {"block_count": ("add_int32", -3)}, "llama.block_count is -3"),
    ("absurd", {"block_count": ("add_uint32", 4_000_000_000)}, "llama.block_count is 4000000000"),
    ("zero", {"block_count": ("add_uint32", 0)}, "llama.block_count is 0"),
    ("nan width", {"embedding_length": ("add_float32", float("nan"))}, "llama.embedding_length is nan"),
    ("string width", {"embedding_length": ("add_string", "8")}, "llama.embedding_length is '8'"),
    ("negative kv heads", {"attention.head_count_kv": ("add_int32", -4)}, "llama.attention.head_count_kv is -4"),
    ("string heads", {"attention.head_count": ("add_string", "2")}, "llama.attention.head_count is '2'"),
    ("string window", {"attention.sliding_window": ("add_string", "x")}, "llama.attention.sliding_window is 'x'"),
    ("negative vocabulary", {"vocab_size": ("add_int64", -10**12)}, "llama.vocab_size is -1000000000000"),
])
def test_damaged_header_sizes_are_one_line_naming_the_key(tmp_path, case, keys, needle):
    n_tensors = 0 if case in ("negative", "absurd", "zero") else 2
    result = plan_json(odd_gguf(tmp_path / "odd.gguf", n_tensors=n_tensors, **keys))
    one_line_exit_2(result, needle, "convert it again")


def test_a_layer_tensor_past_block_count_is_one_line(tmp_path):
    result = plan_json(odd_gguf(tmp_path / "beyond.gguf", n_layer=2, n_tensors=4))
    one_line_exit_2(result, "blk.2.attn_q.weight", "llama.block_count")


def test_a_sliding_window_pattern_shorter_than_the_layers_is_one_line(tmp_path):
    path = odd_gguf(tmp_path / "swa.gguf", n_layer=4, arch="gemma2",
                    **{"attention.sliding_window": ("add_uint32", 16),
                       "attention.sliding_window_pattern": ("add_array", [True, False])})
    one_line_exit_2(plan_json(path), "gemma2.attention.sliding_window_pattern", "4 layers")


def test_sound_odd_headers_still_plan_with_valid_json(tmp_path):
    """Per-layer head counts with a 0, no KV heads, an int window pattern: odd but sound."""
    for name, keys in (("list", {"attention.head_count": ("add_array", [0, 2]),
                                 "attention.head_count_kv": ("add_array", [0, 1])}),
                       ("kv0", {"attention.head_count_kv": ("add_uint32", 0)}),
                       ("swa", {"attention.sliding_window": ("add_uint32", 16),
                                "attention.sliding_window_pattern": ("add_uint32", 1)})):
        result = plan_json(odd_gguf(tmp_path / f"{name}.gguf", **keys))
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
        assert plan["predicted_tps"] > 0 and math.isfinite(plan["predicted_tps"])


def test_a_damaged_remembered_shape_is_read_again(tmp_path):
    path = odd_gguf(tmp_path / "m.gguf")
    shape = P.read_shape(path)
    with pytest.raises(P.PlanError, match="impossible model shape"):
        P.ModelShape(**{**shape.__dict__, "n_layer": 5})  # 5 layers, 2 sized: what a damaged cache would give


# ---------------------------------------------------------------- 2. GPUs whose memory is not reported

GB10 = "NVIDIA GB10, [N/A], [N/A]"


def test_nvidia_smi_without_memory_figures_leaves_that_gpu_out():
    assert D.parse_nvidia_smi(GB10) == []
    found = D.parse_nvidia_smi(f"{GB10}\nNVIDIA H100 80GB HBM3, 81559, 80000\ngarbage")
    assert [d.name for d in found] == ["NVIDIA H100 80GB HBM3"] and found[0].free == 80000 * P.MiB


def fake_tools(nvidia_smi: str):
    def run(cmd):
        return nvidia_smi if cmd[0] == "nvidia-smi" else None
    return run


def no_nvml():
    raise RuntimeError("NVML: not supported")


def test_detect_gpus_survives_an_unreadable_answer(monkeypatch):
    monkeypatch.setattr(D, "_nvml_devices", no_nvml)
    monkeypatch.setattr(D, "_run", fake_tools(GB10))
    assert D.detect_gpus() == []

    def broken(text):
        raise IndexError("another form")
    monkeypatch.setattr(D, "parse_nvidia_smi", broken)
    assert D.detect_gpus() == []


def test_plan_on_a_unified_memory_gpu_runs(tiny_pair, monkeypatch):
    monkeypatch.setattr(D, "_nvml_devices", no_nvml)
    monkeypatch.setattr(D, "_run", fake_tools(GB10))
    result = CliRunner().invoke(main, ["plan", "-m", str(tiny_pair[0])])
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- 3. sizes

@pytest.mark.parametrize("text", ["1.2.3GiB", ".GiB", ".", "1..5GiB", "1" * 400 + "GiB"])
def test_malformed_sizes_are_the_usual_one_line(text):
    with pytest.raises(P.PlanError, match="cannot read the size"):
        P.parse_size(text)


def test_malformed_vram_on_the_command_line_is_one_line(tiny_pair):
    result = CliRunner().invoke(main, ["plan", "-m", str(tiny_pair[0]), "--vram", "1.2.3GiB"])
    one_line_exit_2(result, "cannot read the size '1.2.3GiB'")
    assert P.parse_size(".5GiB") == P.GiB // 2 and P.parse_size("5.GiB") == 5 * P.GiB


# ---------------------------------------------------------------- 4. a damaged costs.json

def remember(tiny_pair, model: dict):
    from ggufspec.home import read_json, write_json
    data = read_json(M.COSTS_FILE)
    data[M.costs_key(*tiny_pair, None, 0, 0)] = {"model": {"build": M.build_id(), **model}}
    write_json(M.COSTS_FILE, data)


@pytest.mark.parametrize("bad", [0.0, -0.01, float("nan"), float("inf"), "0.01", True])
def test_remembered_times_that_are_not_times_are_refused(bad):
    with pytest.raises(ValueError):
        Costs.from_dict({"batch": {"1": [bad], "2": [0.02]}, "draft": [0.001]})
    with pytest.raises(ValueError):
        Costs.from_dict({"batch": {"1": [0.01], "2": [0.02]}, "draft": [bad]})


@pytest.mark.parametrize("bad", [0.0, -0.01, float("nan")])
def test_plan_passes_over_damaged_measured_costs_with_one_warning(tiny_pair, monkeypatch, bad):
    monkeypatch.setattr(P, "detect_gpus", lambda: [])
    remember(tiny_pair, {"batch": {"1": [bad], "2": [bad], "4": [bad]}, "draft": [0.001]})
    assert M.measured_curve(*tiny_pair, None, 0, 0) is None
    result = CliRunner().invoke(main, ["plan", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "--json"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    warnings = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and "estimating instead" in warnings[0]
    plan = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert plan["estimated"] is True and plan["predicted_tps"] > 0


def test_a_partial_sampled_block_does_not_flatten_the_measured_curve(tiny_pair):
    batches = {str(n): [0.01 * n] for n in range(1, 10)}
    remember(tiny_pair, {"batch": batches, "draft": [0.002], "sampled": {"target_1": 0.01, "draft_1": 0.002}})
    curve = M.measured_curve(*tiny_pair, None, 0, 0)
    assert curve.target(4) == pytest.approx(0.04)  # the remembered T(n), not T(1) for every n
    remember(tiny_pair, {"batch": batches, "draft": [0.002], "step_seconds": float("nan"),
                         "sampled": {"target_1": 0.01, "target_2": -1.0, "draft_1": 0.002}})
    notes = []
    curve = M.measured_curve(*tiny_pair, None, 0, 0, notes.append)
    assert curve.target(2) == pytest.approx(0.02) and curve.step_seconds == 0.0 and len(notes) == 1


def test_batch_model_of_no_measurement_is_a_clear_error():
    with pytest.raises(GgufspecError, match="no target batch has been timed"):
        Costs().batch_model()


# ---------------------------------------------------------------- 5. trace files

IDENTITY = {"target": {"file": "t.gguf", "size": 10, "fingerprint": "ab"},
            "draft": {"file": "d.gguf", "size": 5, "fingerprint": "cd"}}
GOOD = {"prompt": "p", "kind": "raw", "n_prompt": 3, "runs": [2, 1, 0, 0, 3, 2, 1, 0]}


def trace_file(path, pair=IDENTITY, prompts=(GOOD,), end=None):
    header = {"format": S.TRACE_FORMAT, "version": S.TRACE_VERSION, "pair": pair, "max_run": S.MAX_RUN}
    lines = [header, *prompts, {"end": len(prompts) if end is None else end}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def one_line_trace_error(path, match):
    with pytest.raises(S.TraceError, match=match) as info:
        S.read_trace(path)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("pair", ["x", [1, 2], {"target": "a.gguf", "draft": 5}, {"target": {"size": "big"}}])
def test_a_pair_that_is_not_two_identities_is_one_line(tmp_path, pair):
    one_line_trace_error(trace_file(tmp_path / "t.jsonl", pair=pair), '"pair" is not')


@pytest.mark.parametrize("change", [{"tokens": {str(i): i for i in range(11)}}, {"tokens": ["a"] * 11},
                                    {"runs": "1234"}, {"runs": [1.9, 0.5]}, {"p": ["x"] * 8},
                                    {"p": [float("nan")] * 8}, {"n_prompt": "3"}])
def test_prompt_records_of_the_wrong_types_are_one_line(tmp_path, change):
    one_line_trace_error(trace_file(tmp_path / "t.jsonl", prompts=[GOOD | change]), ":2: not a prompt's trace")


def test_a_huge_n_prompt_without_tokens_replays_quickly_and_alike(tmp_path):
    import time
    small = S.read_trace(trace_file(tmp_path / "a.jsonl"))
    huge = S.read_trace(trace_file(tmp_path / "b.jsonl", prompts=[GOOD | {"n_prompt": 3 * 10**6}]))
    curve = S.curve_from_times({n: 0.01 * (1 + 0.1 * n) for n in range(1, 10)}, 0.002)
    t0 = time.perf_counter()
    for policy in (S.Policy(3), S.Policy(auto=True)):
        assert S.predict(huge, curve, policy).speedup == S.predict(small, curve, policy).speedup
    assert time.perf_counter() - t0 < 5


def test_end_counts_say_what_is_wrong(tmp_path):
    message = one_line_trace_error(trace_file(tmp_path / "s.jsonl", end="1"), "is not a number")
    assert "holds 1" not in message
    message = one_line_trace_error(trace_file(tmp_path / "z.jsonl", prompts=()), "no generated token")
    assert "counts 0" not in message


def test_a_bad_known_trace_is_passed_over_with_one_line(tmp_path, tiny_pair, ggufspec_home, monkeypatch, capsys):
    folder = ggufspec_home / S.TRACE_FOLDER
    folder.mkdir(parents=True)
    trace_file(folder / "pairstr.jsonl", pair="x")
    identity = S.pair_identity(*tiny_pair)
    trace_file(folder / "good.jsonl", pair=identity)
    assert [S.Path(t.source).name for t in S.known_traces(identity)] == ["good.jsonl"]
    assert capsys.readouterr().err.count("passed over the known trace") == 1

    real = S.read_trace

    def unexpected(path):
        if path.name == "good.jsonl":
            raise RecursionError("deeply nested")
        return real(path)
    monkeypatch.setattr(S, "read_trace", unexpected)
    assert S.known_traces(identity) == []
    monkeypatch.setattr(S, "read_trace", real)
    monkeypatch.setattr(P, "detect_gpus", lambda: [])
    result = CliRunner().invoke(main, ["plan", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1])])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "acceptance: from traces of this pair: good" in result.output


def test_what_the_writer_writes_the_reader_reads(tmp_path):
    prompts = [S.PromptTrace("a", "raw", 9, [], p=[], tokens=list(range(9))),
               S.PromptTrace("b", "raw", 2, [2, 1, 0], p=[0.9, 0.8, 0.1], tokens=[1, 2, 3, 4, 5])]
    S.write_trace(tmp_path / "t.jsonl", IDENTITY, prompts)
    back = S.read_trace(tmp_path / "t.jsonl")
    assert [p.prompt for p in back.prompts] == ["b"]
    with pytest.raises(S.TraceError, match="no prompt generated a token"):
        S.write_trace(tmp_path / "none.jsonl", IDENTITY, prompts[:1])
    # a file an older writer left, with a prompt that generated nothing: read, that prompt passed over
    older = trace_file(tmp_path / "older.jsonl", prompts=[prompts[0].to_json(), prompts[1].to_json()])
    assert [p.prompt for p in S.read_trace(older).prompts] == ["b"]
    curve = S.curve_from_times({n: 0.01 for n in range(1, 10)}, 0.001)
    assert S.predict(S.Trace(IDENTITY, prompts), curve, S.Policy(2), ["a", "b"]).speedup > 0


def test_a_recorder_given_an_empty_generation_writes_a_readable_trace(tiny_decoder, tmp_path):
    from ggufspec.traces import TraceRecorder
    recorder = TraceRecorder(tiny_decoder, 16)
    recorder.add({"id": "nothing", "prompt": "the cat"}, generated=[])
    recorder.add({"id": "cat", "prompt": "the cat"})
    recorder.write(tmp_path / "r.jsonl")
    assert [p.prompt for p in S.read_trace(tmp_path / "r.jsonl").prompts] == ["cat"]
