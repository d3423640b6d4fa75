"""`ggufspec bench`: prompt files, and llama.cpp's tools run with the decoder's own settings."""
import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec import bench as B
from ggufspec.cli import main
from ggufspec.errors import GgufspecError

LLAMACPP_BIN = Path(__file__).parent.parent / "third_party" / "llama.cpp" / "build" / "bin"


# ---------------------------------------------------------------- prompt files

def test_a_missing_prompts_file_is_one_line(tmp_path):
    with pytest.raises(GgufspecError, match="MISSING.jsonl does not exist"):
        B.load_prompts(str(tmp_path / "MISSING.jsonl"))


def test_a_malformed_prompts_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": 3}\n')
    with pytest.raises(GgufspecError, match=r"bad.jsonl:3: expected a JSON object"):
        B.load_prompts(str(bad))
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(GgufspecError, match=r"bad.jsonl:2:"):
        B.load_prompts(str(bad))
    bad.write_text('{"prompt": "fine"}\n{"prompt": ""}\n')
    with pytest.raises(GgufspecError, match=r"bad.jsonl:2: the prompt is empty"):
        B.load_prompts(str(bad))


def test_bench_cli_with_a_missing_prompts_file_exits_2_without_a_traceback(tiny_pair, tmp_path):
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]),
                                       "--prompts", str(tmp_path / "MISSING.jsonl")])
    assert result.exit_code == 2, result.output
    assert "MISSING.jsonl does not exist" in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------- llama.cpp's tools get the same settings

FAKE_SPECULATIVE = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/speculative.args"
echo "encoded    5 tokens in    0.010 seconds, speed:  500.000 t/s" >&2
echo "decoded    8 tokens in    0.020 seconds, speed:  400.000 t/s" >&2
echo "n_drafted = 6" >&2
echo "n_accept  = 4" >&2
"""

FAKE_COMPLETION = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/completion.args"
echo "the text"
echo "llama_perf_context_print: prompt eval time =      10.00 ms /     5 tokens (    2.00 ms per token,   500.00 tokens per second)" >&2
echo "llama_perf_context_print:        eval time =      35.00 ms /     7 runs   (    5.00 ms per token,   200.00 tokens per second)" >&2
"""


def fake_build(folder: Path, completion: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tools = {"llama-speculative-simple": FAKE_SPECULATIVE, **({"llama-completion": FAKE_COMPLETION} if completion else {})}
    for name, script in tools.items():
        (folder / name).write_text(script)
        (folder / name).chmod(0o755)
    return folder / "llama-speculative-simple"


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_llamacpp_runs_get_the_decoders_offload_and_flash_attention(tiny_decoder, tmp_path, flash_attn):
    binary = fake_build(tmp_path / "bin")
    configs = B.parse_configs("2", against_llamacpp=str(binary))
    assert [c.name for c in configs] == ["target", B.LLAMACPP_TARGET, "K=2", "llama.cpp K=2"]
    result = B.run_bench(tiny_decoder, [{"id": "p", "prompt": "the cat"}], configs, n_predict=8, llamacpp=str(binary),
                         n_threads=1, flash_attn=flash_attn, n_gpu_layers=5, n_gpu_layers_draft=3)
    speculative = (tmp_path / "bin" / "speculative.args").read_text().splitlines()
    alone = (tmp_path / "bin" / "completion.args").read_text().splitlines()
    assert (option(speculative, "-ngl"), option(speculative, "-ngld"), option(speculative, "-fa")) == ("5", "3", flash_attn)
    assert (option(alone, "-ngl"), option(alone, "-fa"), option(alone, "-t")) == ("5", flash_attn, "1")
    assert "-ngld" not in alone and "-no-cnv" in alone and option(alone, "-p") == "the cat"
    rows = {s["config"]: s for s in result.summary}
    assert rows[B.LLAMACPP_TARGET]["decode_tps"] == pytest.approx(200.0)  # 7 runs in 35 ms
    assert rows[B.LLAMACPP_TARGET]["prompt_tps"] == pytest.approx(500.0)
    assert rows["llama.cpp K=2"]["decode_tps"] == pytest.approx(400.0)


def test_offload_defaults_to_none_on_the_gpu_for_both(tiny_decoder, tmp_path):
    """llama.cpp's tools default to -ngl -1 (everything on the GPU): the bench always says what it uses."""
    binary = fake_build(tmp_path / "bin")
    B.run_bench(tiny_decoder, [{"id": "p", "prompt": "the cat"}], B.parse_configs("1", against_llamacpp=str(binary)),
                n_predict=4, llamacpp=str(binary), n_threads=1)
    speculative = (tmp_path / "bin" / "speculative.args").read_text().splitlines()
    # -fa auto as the decoder resolved it on a CPU (off), not llama.cpp's auto (on)
    assert (option(speculative, "-ngl"), option(speculative, "-ngld"), option(speculative, "-fa")) == ("0", "0", "off")


def test_no_target_alone_tool_next_to_the_binary_says_how_to_build_it(tiny_decoder, tmp_path):
    binary = fake_build(tmp_path / "bin", completion=False)
    with pytest.raises(GgufspecError, match="build-llamacpp.sh"):
        B.run_bench(tiny_decoder, [{"id": "p", "prompt": "x"}], B.parse_configs("1", against_llamacpp=str(binary)),
                    n_predict=4, llamacpp=str(binary), n_threads=1)


def test_a_bad_flash_attention_setting_is_refused(tiny_decoder):
    with pytest.raises(GgufspecError, match="on, off or auto"):
        B.run_bench(tiny_decoder, [], B.parse_configs("1"), flash_attn="yes")


def test_a_tool_whose_log_lost_its_timings_is_run_again(tmp_path):
    """llama.cpp's logger writes from its own thread, which a quick run's exit can cut short: exit 0 without
    the line expected is run again (at most three times), a failure is not."""
    from ggufspec.llamacpp_tools import run_tool
    tool = tmp_path / "tool"  # the first run cut short after the prompt's timing line, before the decode's
    tool.write_text('#!/bin/sh\necho run >> "$0.runs"\necho "prompt eval time = 1.0 ms / 3 tokens" >&2\n'
                    '[ "$(wc -l < "$0.runs")" -ge 2 ] && echo "       eval time = 2.0 ms / 7 runs" >&2\nexit 0\n')
    tool.chmod(0o755)
    assert "7 runs" in run_tool([str(tool)], "llama-completion", B.DECODE_TIME)
    assert (tmp_path / "tool.runs").read_text().count("run") == 2
    tool.write_text('#!/bin/sh\necho run >> "$0.runs"\necho "no such model" >&2\nexit 1\n')
    with pytest.raises(GgufspecError, match=r"llama-completion failed \(1\): no such model"):
        run_tool([str(tool)], "llama-completion", B.DECODE_TIME)
    assert (tmp_path / "tool.runs").read_text().count("run") == 3


@pytest.mark.skipif(not (LLAMACPP_BIN / "llama-speculative-simple").exists() or
                    not (LLAMACPP_BIN / "llama-completion").exists(),
                    reason="llama.cpp's tools are not built (scripts/build-llamacpp.sh)")
def test_real_llamacpp_tools_on_the_tiny_pair(tiny_decoder):
    binary = str(LLAMACPP_BIN / "llama-speculative-simple")
    result = B.run_bench(tiny_decoder, [{"id": "p", "prompt": "the cat sat"}], B.parse_configs("2", against_llamacpp=binary),
                         n_predict=16, llamacpp=binary, n_threads=1, flash_attn="off")
    rows = {s["config"]: s for s in result.summary}
    print(json.dumps(rows, indent=1))
    assert rows[B.LLAMACPP_TARGET]["decode_tps"] > 0 and rows["llama.cpp K=2"]["decode_tps"] > 0


# ---------------------------------------------------------------- traces and the predicted column

def test_record_trace_then_predict_every_configuration_from_it(tiny_pair, tmp_path):
    from ggufspec import simulate as S
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "the cat"}\n{"id": "b", "kind": "chat", "prompt": "hi"}\n')
    args = ["bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "--prompts", str(prompts), "-n", "24",
            "--draft", "1,3,auto", "-c", "256", "-t", "1", "--json"]
    result = CliRunner().invoke(main, args + ["--record-trace", str(tmp_path / "t.jsonl")])
    assert result.exit_code == 0, result.output
    trace = S.read_trace(tmp_path / "t.jsonl")
    assert [p.prompt for p in trace.prompts] == ["a", "b"] and trace.meta["prompts"] == "p.jsonl"
    trace.check_pair(S.pair_identity(*tiny_pair))
    data = json.loads(result.output[result.output.index("{"):])
    model = data["cost_model"]
    assert set(model["predicted"]) == {"K=1", "K=3", "auto"} and model["acceptance_from"].endswith("t.jsonl")
    assert all(p["predicted_speedup"] > 0 for p in model["predicted"].values())
    # the replay keeps as many draft tokens per step as the runs did: the same acceptance, recorded or measured
    for name in ("K=1", "K=3"):
        measured = statistics.median(s["acceptance"] for s in data["summary"] if s["config"] == name)
        assert model["predicted"][name]["acceptance_per_token"] == pytest.approx(measured, abs=0.15)
    again = CliRunner().invoke(main, args + ["--trace", str(tmp_path / "t.jsonl"), "--draft", "2"])
    assert again.exit_code == 0, again.output


def test_the_readmes_trace_recording_runs_the_target_alone(tiny_pair, tmp_path):
    """README: `bench --draft "" --prompts P --record-trace T` (no draft setting to measure: a trace only)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "the cat"}\n')
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "--draft", "",
                                       "--prompts", str(prompts), "-n", "8", "-c", "256", "-t", "1",
                                       "--record-trace", str(tmp_path / "t.jsonl")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "t.jsonl").exists() and "| a | target |" in result.output


def test_a_prompt_past_the_context_is_skipped_with_its_name_and_the_rest_measured(tiny_pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "short", "prompt": "the cat"}\n' + json.dumps({"id": "long", "prompt": "x" * 400})
                       + "\n")
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "--draft", "2",
                                       "--prompts", str(prompts), "-n", "8", "-c", "256", "-t", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert "prompt long skipped: it is" in result.output and "the context holds 256" in result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert {run["prompt"] for run in data["runs"]} == {"short"}


def test_streams_refuses_the_options_it_would_ignore(tiny_pair):
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_pair[0]), "--streams", "1,2", "--repeat", "3",
                                       "--temp", "0.8"])
    assert result.exit_code == 2 and "--repeat, --temp do not apply" in result.output, result.output


@pytest.mark.parametrize("flag, value", [("--spec-draft-p-min", "1"), ("--spec-draft-n-max", "-1"),
                                         ("--spec-draft-n-min", "-2")])
def test_draft_flags_out_of_range_are_refused_before_loading(tiny_pair, flag, value):
    for command in (["bench"], ["run", "-p", "x"]):
        if command == ["bench"] and flag != "--spec-draft-p-min":
            continue  # bench has only the gate of the three
        result = CliRunner().invoke(main, [*command, "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), flag, value])
        assert result.exit_code == 2 and flag in result.output, result.output


def test_a_trace_of_another_pair_or_an_empty_one_is_refused_before_running(tiny_pair, tmp_path):
    from ggufspec import simulate as S
    other = {"target": {"file": "big.gguf", "size": 1, "fingerprint": "ab"}, "draft": {"file": "s.gguf", "size": 2}}
    S.write_trace(tmp_path / "other.jsonl", other, [S.PromptTrace("p", "raw", 3, [1, 0])])
    (tmp_path / "empty.jsonl").write_text("")
    for name, message in (("other.jsonl", "recorded on big.gguf"), ("empty.jsonl", "the trace file is empty")):
        result = CliRunner().invoke(main, ["bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-n", "4",
                                           "--draft", "1", "--limit", "1", "--trace", str(tmp_path / name)])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_the_predicted_column_without_a_trace_uses_this_runs_acceptance(tiny_decoder):
    configs = B.parse_configs("2,auto")
    result = B.run_bench(tiny_decoder, [{"id": "p", "prompt": "the cat"}], configs, n_predict=16)
    costs = B.measure_costs(tiny_decoder, repeats=2)
    B.add_cost_model(result, costs, configs)
    assert set(result.cost_model["predicted"]) == {"K=2"}  # auto's acceptance depends on its own choices
    assert "i.i.d." in result.cost_model["acceptance_from"]
    assert set(costs) >= {f"target_{n}" for n in range(1, 10)} | {"draft_1", "row"}


def test_costs_are_sampled_between_the_runs_and_leave_the_caches_as_the_runs_need(tiny_decoder):
    """A round after each prompt's configurations (the same moments as the runs), appended to what
    the caches hold and cut off again; the draft holds each prompt before its runs."""
    prompts = [{"id": "p", "prompt": "the cat"}, {"id": "q", "prompt": "a b c d"}]
    sampler = B.CostSampler(tiny_decoder)
    B.run_bench(tiny_decoder, prompts, B.parse_configs("2"), n_predict=8, repeat=2, cost_sampler=sampler)
    assert sampler.rounds == 4 and all(len(times) == 4 for times in sampler.samples.values())  # a warm-up first, untimed
    held = list(tiny_decoder.target.tokens)
    costs = sampler.costs(min_rounds=5)
    assert sampler.rounds == 5 and tiny_decoder.target.tokens == held
    assert set(costs) >= {f"target_{n}" for n in (*range(1, 10), 13, 17)} | {f"draft_{n}" for n in range(1, 5)} | {"row"}
    prompt = tiny_decoder.tokenize("a b c d")
    B._prefill_draft(tiny_decoder, {"prompt": "a b c d"})
    assert tiny_decoder.draft.tokens == prompt[:-1]


class SwitchingContext:
    """A context whose batch costs 1 ms a token, plus 3 ms when the size differs from the last batch's
    (as CUDA rebuilds a graph: an H200 timed T(2) at 5.35 ms between other sizes, llama-bench 2.97)."""

    def __init__(self, clock):
        self.clock, self.tokens, self.n_ctx, self.last = clock, [1, 2, 3], 512, None

    n_past = property(lambda self: len(self.tokens))

    def decode(self, tokens, n_logits=1):
        self.clock[0] += 1e-3 * len(tokens) + (3e-3 if len(tokens) != self.last else 0.0)
        self.tokens, self.last = self.tokens + list(tokens), len(tokens)

    def synchronize(self):
        pass

    def keep(self, n):
        self.tokens = self.tokens[:n]


def test_each_batch_size_is_timed_as_a_fixed_k_loop_meets_it_after_a_run_of_the_same_size(monkeypatch):
    from ggufspec import stepcosts
    clock = [0.0]
    monkeypatch.setattr(stepcosts.time, "perf_counter", lambda: clock[0])
    decoder = type("D", (), {"target": SwitchingContext(clock), "draft": None, "tokenize": lambda self, text: [1, 2]})()
    sampler = stepcosts.CostSampler(decoder, k_max=3)
    sampler.sample(2)
    medians = {key: statistics.median(times) for key, times in sampler.samples.items()}
    assert medians == pytest.approx({"target_1": 1e-3, "target_2": 2e-3, "target_3": 3e-3, "target_4": 4e-3,
                                     "target_13": 13e-3, "target_17": 17e-3})
