"""A Mixture-of-Experts model's experts kept on the CPU: llama.cpp's -ot/--override-tensor, -cmoe/--cpu-moe,
-ncmoe/--n-cpu-moe and the draft's -otd, -cmoed, -ncmoed (`ggufspec.placement`).

The model is a tiny Mixtral-style MoE written here (llama architecture with 4 experts, 2 used a token).
Speculation on it is the target alone's text; each flag puts exactly the tensors llama.cpp's own regexes
pick on the CPU (read back from llama.cpp's load log, `-v`), the target's flags on the target, the draft's
on the draft, and the text does not change; bad values are one line; the plan counts the experts kept on
the CPU in host memory, not in the layers it offloads."""
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder
from ggufspec import plan as P
from ggufspec import session
from ggufspec.cli import main
from ggufspec.errors import GgufspecError
from ggufspec.tinymodels import Shape, make_moe_pair
from reference import differs_at_near_tie, first_difference, prompts, target_alone

N_LAYER, N_EXPERT, N_CTX = 3, 4, 256
SHAPE = Shape(n_layer=N_LAYER, eos_bias=4.0)
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
LOADED = re.compile(r"loaded meta data with .* from (\S+)")


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """(target: 3 MoE layers, draft: its first layer)."""
    return make_moe_pair(tmp_path_factory.mktemp("moe"), seed=0, n_expert=N_EXPERT, shape=SHAPE)


def experts(*layers: int) -> set[str]:
    return {f"blk.{i}.{name}" for i in layers for name in EXPERT_TENSORS}


def run(pair, *flags, verbose=True):
    """`ggufspec run` on the pair, K = 3, llama.cpp's log on stderr (-v)."""
    target, draft = pair
    return CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the cat sat", "-n", "12",
                                     "-c", str(N_CTX), "-t", "1", "--temp", "0", "--draft", "3", "--json",
                                     *(["-v"] if verbose else []), *flags], input="")


def overridden(result) -> dict[str, set[str]]:
    """Model file name -> the tensors its load log says went to the CPU buffer (`-v` prints llama.cpp's log)."""
    assert result.exit_code == 0, result.output
    found: dict[str, set[str]] = {}
    model = None
    for line in result.stderr.splitlines():
        if loaded := LOADED.search(line):
            model = Path(loaded[1]).name
            found[model] = set()
        elif (moved := OVERRIDDEN.search(line)) and moved[2] == "CPU":
            found[model].add(moved[1])
    return found


# ---------------------------------------------------------------- the tiny MoE: loads, generates, speculates

@pytest.fixture(scope="module")
def decoders(moe_pair):
    """Batch verification (flash attention off, as the reference), --strict, and the target as its own draft:
    every one with --cpu-moe on the target and -cmoed on the draft (on a CPU the same placement)."""
    target, draft = moe_pair
    flags = session.load_flags_by_role(session.ModelOptions(cpu_moe=True, cpu_moe_draft=True))
    options = dict(n_ctx=N_CTX, n_threads=1, load_flags=flags)
    with SpeculativeDecoder(target, draft, flash_attn="off", **options) as batch, \
            SpeculativeDecoder(target, draft, strict=True, **options) as strict, \
            SpeculativeDecoder(target, target, flash_attn="off", **options) as itself:
        yield {"batch": batch, "strict": strict, "itself": itself}


def test_the_tiny_moe_loads_with_its_experts_and_generates(moe_pair, decoders):
    target_llm = decoders["batch"].target_llm
    assert target_llm.metadata["llama.expert_count"] == str(N_EXPERT)
    assert target_llm.metadata["llama.expert_used_count"] == "2"
    out = decoders["batch"].generate(prompts(1, seed=5)[0], n_predict=16, n_draft=0, temperature=0)
    assert len(out.tokens) == 16


RUNS = [("batch", "model", 3), ("batch", "model", "auto"), ("batch", "lookup", 3), ("itself", "model", 3)]


def test_speculation_on_the_moe_is_the_target_alones_greedy_text(moe_pair, decoders):
    """Against plain llama-cpp-python's target alone (no overrides; a near-tie below 1e-3 is no verdict),
    and --strict against its own target alone, bit for bit."""
    decided = near_ties = accepted = 0
    for prompt in prompts(5, seed=11):
        expected, margins, _ = target_alone(moe_pair[0], prompt, 32, N_CTX)
        strict_alone = decoders["strict"].generate(prompt, n_predict=32, n_draft=0, temperature=0).tokens
        for name, drafter, k in RUNS:
            got = decoders[name].generate(prompt, n_predict=32, n_draft=k, drafter=drafter, temperature=0)
            if differs_at_near_tie(got.tokens, expected, margins):
                near_ties += 1
            else:
                assert got.tokens == expected, f"{name} {drafter} K={k}: {first_difference(got.tokens, expected)}"
                decided += 1
            accepted += got.stats.n_accept
        for drafter, k in (("model", 3), ("model", "auto"), ("lookup", 3)):
            strict = decoders["strict"].generate(prompt, n_predict=32, n_draft=k, drafter=drafter, temperature=0)
            assert strict.tokens == strict_alone, f"--strict {drafter} K={k}: {first_difference(strict.tokens, strict_alone)}"
            accepted += strict.stats.n_accept
    assert decided >= 0.8 * (decided + near_ties), (decided, near_ties)
    assert accepted > 0  # drafts were kept, not only rejected


# ---------------------------------------------------------------- the flags: llama.cpp's load log says where

@pytest.fixture(scope="module")
def plain_tokens(moe_pair):
    result = run(moe_pair)
    assert result.exit_code == 0, result.output
    assert not any(overridden(result).values())  # without the flags nothing is overridden
    return json.loads(result.stdout)["tokens"]


@pytest.mark.parametrize("flags, target_cpu, draft_cpu", [
    (["--cpu-moe"], experts(0, 1, 2), set()),
    (["--n-cpu-moe", "1"], experts(0), set()),
    (["-ot", r"blk\.0\.ffn_.*_exps\.=CPU"], experts(0), set()),
    (["-ot", r"blk\.1\.ffn_up_exps=CPU,blk\.2\.ffn_down_exps=CPU"], {"blk.1.ffn_up_exps.weight",
                                                                     "blk.2.ffn_down_exps.weight"}, set()),
    (["-cmoed"], set(), experts(0)),
    (["--spec-draft-n-cpu-moe", "1", "-ncmoe", "2"], experts(0, 1), experts(0)),
    (["-otd", r"ffn_gate_exps=CPU"], set(), {"blk.0.ffn_gate_exps.weight"}),
])
def test_each_flag_overrides_exactly_its_models_expert_tensors_and_the_text_stays(moe_pair, plain_tokens, flags,
                                                                                   target_cpu, draft_cpu):
    result = run(moe_pair, *flags)
    assert overridden(result) == {"moe-target.gguf": target_cpu, "moe-draft.gguf": draft_cpu}
    assert json.loads(result.stdout)["tokens"] == plain_tokens


def test_ot_comes_first_in_the_list_llamacpp_gets(moe_pair):
    """The first matching override decides: -ot's are tried before --n-cpu-moe's and --cpu-moe's, whatever
    the order on the command line, so an -ot exception (one layer's experts on CUDA0) takes effect. On a
    CPU build every override is CPU: the log says --cpu-moe's set with an -ot among it."""
    from ggufspec.placement import EXPERTS_REGEX, tensor_overrides
    assert tensor_overrides([r"blk\.1\.=CUDA0"], cpu_moe=True, n_cpu_moe=1) == (
        (r"blk\.1\.", "CUDA0"), (rf"blk\.0{EXPERTS_REGEX}", "CPU"), (EXPERTS_REGEX, "CPU"))
    assert overridden(run(moe_pair, "--cpu-moe", "-ot", r"blk\.1\.ffn_up_exps=CPU"))["moe-target.gguf"] == experts(0, 1, 2)


# ---------------------------------------------------------------- bad values: one line

@pytest.mark.parametrize("flags, words", [
    (["-ot", "foo"], ["-ot 'foo'", "PATTERN=BUFFER_TYPE"]),
    (["-ot", "x=NOPE"], ["unknown buffer type 'NOPE'", "CPU"]),
    (["-ot", "([=CPU"], ["'([' is no regular expression"]),
    (["-ot", r"blk\.0\.=CPU,oops"], ["'oops'"]),
    (["-ot", r"(?P<x>blk)\.0\.=CPU"], ["ECMAScript"]),  # Python's re takes it, llama.cpp's std::regex not
    (["--n-cpu-moe", "-1"], ["--n-cpu-moe", "-1"]),
    (["-otd", "x=NOPE"], ["-otd", "unknown buffer type 'NOPE'"]),
    (["-ncmoed", "-2"], ["--n-cpu-moe-draft", "-2"]),
])
def test_bad_values_are_one_line(moe_pair, flags, words):
    result = run(moe_pair, *flags, verbose=False)
    line = result.stderr.strip()
    assert result.exit_code == 2 and line.startswith("ggufspec: error:") and "\n" not in line, result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in line, line


def test_the_python_api_checks_them_too(moe_pair):
    for bad in (dict(n_cpu_moe=-1), dict(n_cpu_moe_draft=1.5), dict(override_tensor=("nope",)),
                dict(override_tensor_draft="x=NOPE")):
        with pytest.raises(GgufspecError):
            session.load_flags_by_role(session.ModelOptions(**bad))
    flags = session.load_flags_by_role(session.ModelOptions(override_tensor="a=CPU,b=CPU", n_cpu_moe_draft=1))
    assert flags["target"]["tensor_overrides"] == (("a", "CPU"), ("b", "CPU"))
    assert len(flags["draft"]["tensor_overrides"]) == 1


def test_bench_gives_them_to_llamacpps_tools_in_the_same_order():
    from ggufspec.cli.generate import llamacpp_load_args
    load = {"override_tensor": ("a=CPU", "b=CPU"), "cpu_moe": True, "n_cpu_moe": 2, "override_tensor_draft": (),
            "cpu_moe_draft": False, "n_cpu_moe_draft": 1}
    assert llamacpp_load_args(load) == (("-ot", "a=CPU", "-ot", "b=CPU", "-ncmoe", "2", "-cmoe"), ("-ncmoed", "1"))


# ---------------------------------------------------------------- the plan: experts on the CPU are not the GPU's

RAM = P.DeviceMemory("cpu", "RAM", 64 << 30, 64 << 30, 40.0, cores=8)


def test_the_plan_counts_experts_kept_on_the_cpu_in_host_memory(moe_pair, monkeypatch):
    target = str(moe_pair[0])

    def loaded(**moe):
        flags = session.load_flags_by_role(session.ModelOptions(**moe))["target"]
        return flags, session._as_loaded(target, flags)
    _, shape = loaded()
    expert_bytes = N_EXPERT * SHAPE.n_ff * SHAPE.n_embd * 4 * 3  # a layer's three F32 expert tensors
    assert sum(size for name, size in P.read_tensor_sizes(target) if "_exps." in name) == N_LAYER * expert_bytes
    every = loaded(cpu_moe=True)[1]
    assert [a - b for a, b in zip(shape.layer_bytes, every.layer_bytes)] == [expert_bytes] * N_LAYER
    assert every.weight_bytes == shape.weight_bytes  # still loaded: in host memory
    assert [a - b for a, b in zip(shape.layer_bytes, loaded(n_cpu_moe=1)[1].layer_bytes)] == [expert_bytes, 0, 0]
    # a GPU that holds everything but the experts: the planned -ngl offloads every layer with --cpu-moe only
    needed = P.placement(every, N_LAYER + 1, N_CTX).gpu_bytes
    free = int((needed + P.GPU_OVERHEAD) / (1 - P.MARGIN)) + 1
    monkeypatch.setattr(P, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(session, "memory_devices", lambda *args: (P.DeviceMemory("cuda", "GPU", free, free, 1000.0), RAM))

    def planned(**moe):
        return session.planned_offload(target, None, N_CTX, 3, None, None, lambda line: None,
                                       flags={"target": loaded(**moe)[0]})[0]
    assert planned(cpu_moe=True) == N_LAYER + 1 > planned()


def test_plan_takes_the_flags_too(moe_pair):
    """`plan -m MOE --cpu-moe` on a GPU (--vram) that holds all but the experts: every layer offloaded."""
    target = str(moe_pair[0])
    every = session._as_loaded(target, session.load_flags_by_role(session.ModelOptions(cpu_moe=True))["target"])
    vram = int((P.placement(every, N_LAYER + 1, N_CTX).gpu_bytes + P.GPU_OVERHEAD) / (1 - P.MARGIN)) + 1

    def planned(*flags):
        result = CliRunner().invoke(main, ["plan", "-m", target, "-c", str(N_CTX), "--vram", f"{vram}B", "--json",
                                           *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["ngl"]
    assert planned("--cpu-moe") == planned("-ot", r"ffn_.*_exps=CPU") == N_LAYER + 1 > planned()
    bad = CliRunner().invoke(main, ["plan", "-m", target, "-ot", "x=NOPE"])
    assert bad.exit_code == 2 and "unknown buffer type 'NOPE'" in bad.stderr and "\n" not in bad.stderr.strip()
