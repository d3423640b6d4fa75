"""llama.cpp's CPU, memory and loading flags (`ggufspec.cpuflags`, `cli.cpu_flags`): -kvo/-nkvo, --op-offload,
--repack/-nr, --no-host, --check-tensors, --numa, -lzm, -ncffn, -fit, --perf, the CPU placement flags (-C,
-Cr, --prio and their batch and draft variants), and those taken at their does-nothing value or refused
(--cpu-strict, --poll, -dt, -bs, --spec-draft-backend-sampling, -fitt, -fitc).

Each honoured flag is read back where llama.cpp took it (the Llama objects' model and context params, the
process's CPU affinity and nice value); each refusal is one line, exit code 2, before anything loads; the
planner counts -nkvo's KV cache in host memory; speculation under -nkvo, --no-op-offload and -nr (Q4_0
weights, which llama.cpp repacks by default) is the target alone's text under the same flag, --strict bit
for bit, at K = 3, auto and n-gram lookup."""
import ctypes
import json
import os
import subprocess
import sys

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder, placement
from ggufspec import plan as P
from ggufspec.cli import main
from ggufspec.cpuflags import cpu_set
from ggufspec.errors import GgufspecError
from ggufspec.load import flags_tag
from ggufspec.modelflags import offload_given
from ggufspec.session import ModelOptions, _as_loaded, load_flags_by_role
from ggufspec.tinymodels import Shape, make_weights, write_model
from clierrors import one_line_error, run_pair
from reference import prompts

N_CTX = 256


# ---------------------------------------------------------------- honoured: read back where llama.cpp took them

def test_the_switches_reach_both_models_params(tiny_pair, loads):
    result = run_pair(tiny_pair, "-nkvo", "--no-op-offload", "-nr", "--no-host", "--check-tensors", "-lzm", "off",
                      "--no-perf", "--numa", "isolate")
    assert result.exit_code == 0, result.output
    assert [g["numa"] for g in loads] == [llama_cpp.GGML_NUMA_STRATEGY_ISOLATE] * 2
    result = run_pair(tiny_pair, "-nkvo", "--no-op-offload", "-nr", "--no-host", "--check-tensors", "-lzm", "off",
                      "--no-perf", "-C", "0x1", "-Cr", "1-1", "--prio", "1", "-Cd", "3", "--prio-draft", "1", "-Cbd",
                      "0x3", "--prio-batch", "1")
    assert result.exit_code == 0, result.output
    assert len(loads) == 4
    for got in loads:
        assert (got["offload_kqv"], got["op_offload"], got["no_perf"]) == (False, False, True)
        assert (got["use_extra_bufts"], got["no_host"], got["check_tensors"]) == (False, True, True)
        assert got["lazy_mode"] == llama_cpp.LLAMA_LAZY_MODE_OFF
    # -C 0x1 and -Cr 1-1 together (as far as this machine has CPUs); the draft's and the batches' the same: taken
    assert [g["process"] for g in loads[2:]] == [(cpu_set("0x1", "1-1"), 1)] * 2
    assert run_pair(tiny_pair, "-kvo", "--op-offload", "--repack", "--perf", "-lzm", "on").exit_code == 0
    for got in loads[4:]:
        assert (got["offload_kqv"], got["op_offload"], got["no_perf"], got["use_extra_bufts"]) == (True, True, False,
                                                                                                     True)
        assert got["lazy_mode"] == llama_cpp.LLAMA_LAZY_MODE_ON and got["process"] == (None, 0)
    assert run_pair(tiny_pair).exit_code == 0  # llama.cpp's defaults
    assert [(g["offload_kqv"], g["no_host"], g["check_tensors"], g["lazy_mode"], g["numa"]) for g in loads[6:]] \
        == [(True, False, False, llama_cpp.LLAMA_LAZY_MODE_AUTO, 0)] * 2


def test_exact_loads_the_target_unrepacked_and_repack_beside_it_is_refused(tiny_pair):
    flags = load_flags_by_role(ModelOptions(exact=True, repack=False))
    assert flags["target"]["repack"] is False and flags["draft"]["repack"] is False
    with pytest.raises(GgufspecError, match="--repack and --exact"):
        load_flags_by_role(ModelOptions(exact=True, repack=True))


def test_n_cpu_ffn_keeps_the_targets_dense_ffn_on_the_cpu(tiny_pair, loads):
    overrides = load_flags_by_role(ModelOptions(override_tensor="x=CPU", cpu_moe=True, n_cpu_ffn=2))["target"][
        "tensor_overrides"]
    assert overrides[0] == ("x", "CPU") and overrides[-2:] == (("blk\\.0\\.ffn_(up|down|gate)\\.", "CPU"),
                                                               ("blk\\.1\\.ffn_(up|down|gate)\\.", "CPU"))
    assert len(overrides) == 4  # -ot's first, then --cpu-moe's, then -ncffn's (llama.cpp's ffn block regex)
    assert run_pair(tiny_pair, "-ncffn", "1").exit_code == 0
    assert [g["overrides"] for g in loads] == [True, False]  # the target's only, as llama.cpp's
    sizes = dict(P.read_tensor_sizes(tiny_pair[0]))
    shape = P.kept_on_host(P.read_shape(tiny_pair[0]), tiny_pair[0], overrides[2:])
    assert shape.other_bytes - P.read_shape(tiny_pair[0]).other_bytes == sum(
        size for name, size in sizes.items() if name.startswith(("blk.0.ffn_", "blk.1.ffn_")) and "norm" not in name)


PLACED = """
import json, os, sys
from ggufspec.session import ModelOptions, open_session
options = ModelOptions(model=sys.argv[1], model_draft=sys.argv[2], n_ctx=256, n_threads=2, cpu_mask="0x1", prio=-1)
with open_session(options, log=lambda line: None) as session:
    session.decoder.generate([1, 260, 261], n_predict=4, n_draft=3, temperature=0)
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    print(json.dumps({"cpus": sorted({c for t in tids for c in os.sched_getaffinity(t)}),
                      "nice": sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids})}))
"""


def test_cpu_mask_and_priority_are_the_whole_processs(tiny_pair):
    """In a process of its own: every thread (llama.cpp's OpenMP pool included) on -C's CPUs, at --prio's nice."""
    done = subprocess.run([sys.executable, "-c", PLACED, *map(str, tiny_pair)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["cpus"] == [0] and got["nice"] == [5], got  # llama.cpp's low: nice 5


def test_a_priority_the_process_may_not_take_is_one_line(monkeypatch):
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "setpriority", refused)
    with pytest.raises(GgufspecError, match="--prio 2: could not set the process's nice value to -10: Operation "
                                            "not permitted; raising the priority needs root or CAP_SYS_NICE"):
        placement.apply_process_placement(None, 2)


def test_numa_is_set_once_per_process(monkeypatch):
    monkeypatch.setattr(placement, "_numa_in_effect", [])
    assert placement.numa_strategy(None) == 0
    assert placement.numa_strategy("numactl") == placement.numa_strategy("numactl") \
        == llama_cpp.GGML_NUMA_STRATEGY_NUMACTL
    with pytest.raises(GgufspecError, match="already runs with --numa numactl"):
        placement.numa_strategy("distribute")


def test_numa_in_a_run_of_its_own(tiny_pair):
    command = ["run", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-p", "the cat", "-n", "4", "-c", str(N_CTX),
               "-t", "1", "--temp", "0", "--json", "--numa", "distribute"]
    done = subprocess.run([sys.executable, "-m", "ggufspec.cli", *command], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 4


def test_check_tensors_refuses_a_nan_weight(tmp_path):
    shape = Shape(eos_bias=4.0)
    weights = make_weights(shape, 0)
    weights["blk.1.ffn_up.weight"][3, 5] = np.nan
    model = write_model(tmp_path / "nan.gguf", shape, weights)
    flags = ["run", "-m", str(model), "--no-draft", "-p", "the", "-n", "2", "-c", str(N_CTX), "-t", "1", "--temp", "0"]
    assert CliRunner().invoke(main, flags).exit_code == 0  # loaded as it is, without the check
    one_line_error(CliRunner().invoke(main, [*flags, "--check-tensors"]), "could not load the target model",
                   "--check-tensors", "NaN")


def test_fit_off_offloads_every_unset_layer_where_there_is_a_gpu(monkeypatch):
    gpu = [placement.Device(1, "GPU0", "", 0, 0, placement.DEVICE_GPU)]
    monkeypatch.setattr(placement, "default_devices", lambda: gpu)
    assert offload_given(ModelOptions(fit="off")) == (-1, -1)
    assert offload_given(ModelOptions(fit="0", n_gpu_layers=5)) == (5, -1)
    assert offload_given(ModelOptions(fit="off", device_draft="none", n_gpu_layers=5)) == (5, 0)
    assert offload_given(ModelOptions(fit="on")) == offload_given(ModelOptions()) == (None, None)  # the planner's
    monkeypatch.setattr(placement, "default_devices", lambda: [])
    assert offload_given(ModelOptions(fit="off")) == (None, None)  # nothing to offload to: the CPU, as without it


# ---------------------------------------------------------------- the plan and the step costs' key

def test_the_plan_counts_a_no_kv_offload_cache_in_host_memory(tiny_pair):
    shape = P.read_shape(tiny_pair[0])
    kept = _as_loaded(str(tiny_pair[0]), load_flags_by_role(ModelOptions(kv_offload=False))["target"])
    assert kept.kv_offload is False  # what session hands the planner
    assert _as_loaded(str(tiny_pair[0]), load_flags_by_role(ModelOptions())["target"]).kv_offload
    on_gpu, on_host = P.placement(shape, shape.n_layer + 1, 4096), P.placement(kept, shape.n_layer + 1, 4096)
    assert on_gpu.kv_gpu == shape.kv_bytes(4096) > 0 and on_host.kv_gpu == 0
    assert on_host.gpu_bytes == on_gpu.gpu_bytes - shape.kv_bytes(4096)
    assert on_host.cpu_bytes == on_gpu.cpu_bytes + shape.kv_bytes(4096)
    # a GPU that holds every layer's weights but not their cache: -nkvo offloads all of them
    budget = on_host.gpu_bytes + shape.kv_bytes(4096) // 2
    assert P.max_layers(kept, 4096, budget) == shape.n_layer + 1 > P.max_layers(shape, 4096, budget)
    shares, _ = P.split_across_hosts(kept, 4096, [("w:1", 1 << 30)])
    assert shares[0].bytes >= shape.kv_bytes(4096)  # the cache stays on this machine, off the worker


def test_costs_are_remembered_per_flag_that_changes_them():
    def tag(**options):
        return flags_tag(load_flags_by_role(ModelOptions(**options)))
    assert tag() == tag(check_tensors=True) == tag(perf=False) == tag(kv_offload=True, repack=True, fit="off") == ""
    changing = [dict(kv_offload=False), dict(op_offload=False), dict(repack=False), dict(no_host=True),
                dict(lazy_mode="on"), dict(numa="distribute"), dict(cpu_mask="0x1"), dict(prio=-1)]
    assert len({tag(**options) for options in changing}) == len(changing) and "" not in {tag(**o) for o in changing}


# ---------------------------------------------------------------- refused, or taken at their does-nothing value

@pytest.mark.parametrize("flags, words", [
    (["--cpu-strict", "1"], ["--cpu-strict", "give 0"]),
    (["--cpu-strict-batch-draft", "1"], ["--cpu-strict-batch-draft", "give 0"]),
    (["--poll", "0"], ["--poll", "give 50"]),
    (["--spec-draft-poll-batch", "100"], ["--poll-batch-draft", "give 50"]),
    (["--poll", "101"], ["--poll", "101"]),
    (["-bs"], ["--backend-sampling", "host"]),
    (["--spec-draft-backend-sampling"], ["--spec-draft-backend-sampling", "--no-spec-draft-backend-sampling"]),
    (["-fitt", "1024"], ["--fit-target", "-ngl"]),
    (["-fitc", "4096"], ["--fit-ctx", "-c N"]),
    (["-fit", "maybe"], ["--fit", "maybe"]),
    (["-Cb", "0x2"], ["-Cb 0x2", "one set of CPUs", "-C/-Cr"]),
    (["-C", "0x1", "-Crd", "0-1"], ["-Crd 0-1", "CPUs 0"]),
    (["-C", "0x1", "-Cbd", "0x2"], ["-Cbd 0x2"]),
    (["-C", "0x10000"], ["-C 0x10000", "no CPU of this machine"]),
    (["-C", "0xg"], ["-C 0xg", "hex"]),
    (["-Cr", "3-1"], ["-Cr 3-1", "lo <= hi"]),
    (["-Cr", "5"], ["-Cr '5'", "lo-hi"]),
    (["-Cr", "0-600"], ["below 512"]),
    (["--prio", "4"], ["--prio", "4"]),
    (["--prio", "1", "--prio-batch", "2"], ["--prio-batch 2", "--prio sets (now 1)"]),
    (["--spec-draft-prio", "2"], ["--prio-draft 2", "now 0"]),
    (["--prio-draft", "-1"], ["--prio-draft", "-1"]),
    (["--numa", "mirror"], ["--numa", "mirror"]),
    (["-lzm", "lazy"], ["--lazy-mode", "lazy"]),
    (["-ncffn", "-1"], ["--n-cpu-ffn", "-1"]),
    (["--repack", "--exact"], ["--repack and --exact"]),
    (["--numa", "distribute", "-Cr", "0-0"], ["--numa distribute and -C/-Cr"]),
])
def test_bad_values_are_one_line_before_anything_loads(tiny_pair, loads, flags, words):
    one_line_error(run_pair(tiny_pair, *flags), *words)
    assert loads == []


def test_does_nothing_values_are_taken(tiny_pair, loads):
    result = run_pair(tiny_pair, "--cpu-strict", "0", "--cpu-strict-batch", "0", "--spec-draft-cpu-strict", "0",
                      "--poll", "50", "--poll-batch", "50", "--poll-draft", "50", "--poll-batch-draft", "50",
                      "--no-spec-draft-backend-sampling", "-fit", "on", "-dt", "0.1", "-C", "", "--prio", "0")
    assert result.exit_code == 0, result.output
    assert "--defrag-thold is deprecated" in result.stderr  # as llama.cpp says it
    assert [g["process"] for g in loads] == [(None, 0)] * 2


def test_the_python_api_checks_them_too():
    for bad in (dict(cpu_mask="zz"), dict(prio=5), dict(prio_draft=True), dict(numa="x"), dict(lazy_mode="x"),
                dict(fit="maybe"), dict(n_cpu_ffn=-1), dict(kv_offload="no"), dict(perf=1), dict(cpu_range="a-b")):
        with pytest.raises(GgufspecError):
            load_flags_by_role(ModelOptions(**bad))
    assert cpu_set("0x5", "-1") == tuple(c for c in (0, 1, 2) if c < os.cpu_count())  # a mask and a range: their union
    assert cpu_set("", None) is None and cpu_set("0", None) is None  # llama.cpp's empty mask: as started


# ---------------------------------------------------------------- greedy identity under the flags that could change it

@pytest.fixture(scope="module")
def q4_pair(tiny_pair, tmp_path_factory):
    """The tiny pair in Q4_0, whose weights llama.cpp repacks for its tiled kernels (-nr: not)."""
    folder = tmp_path_factory.mktemp("q4")
    made = []
    for path in tiny_pair:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, 1
        out = folder / path.name
        assert llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)) == 0
        made.append(out)
    return tuple(made)


IDENTITY = {"-nkvo": (dict(kv_offload=False), "offload_kqv", False), "--no-op-offload": (dict(op_offload=False),
            "op_offload", False), "-nr": (dict(repack=False), "use_extra_bufts", False)}
RUNS = [("model", 3), ("model", "auto"), ("lookup", 3)]


@pytest.mark.parametrize("case", IDENTITY)
def test_speculation_under_the_flag_is_the_target_alones_text(tiny_pair, q4_pair, case):
    options, field, value = IDENTITY[case]
    pair = q4_pair if case == "-nr" else tiny_pair
    flags = load_flags_by_role(ModelOptions(**options))
    accepted = 0
    with SpeculativeDecoder(*pair, n_ctx=N_CTX, n_threads=1, strict=True, load_flags=flags) as decoder:
        for llm in (decoder.target_llm, decoder.draft_llm):
            params = llm.model_params if field == "use_extra_bufts" else llm.context_params
            assert getattr(params, field) == value
        for prompt in prompts(4, seed=7):
            alone = decoder.generate(prompt, n_predict=24, n_draft=0, temperature=0).tokens
            for drafter, k in RUNS:
                got = decoder.generate(prompt, n_predict=24, n_draft=k, drafter=drafter, temperature=0)
                assert got.tokens == alone, f"{case} {drafter} K={k}"
                accepted += got.stats.n_accept
    assert accepted > 0


# ---------------------------------------------------------------- --help

FLAGS = ("--kv-offload", "--no-kv-offload", "-nkvo", "--op-offload", "--repack", "-nr", "--no-host", "--check-tensors",
         "--numa", "--lazy-mode", "--n-cpu-ffn", "--fit", "--perf", "--cpu-mask", "--cpu-range", "--prio",
         "--cpu-mask-batch", "--cpu-range-batch", "--prio-batch", "--cpu-mask-draft", "--spec-draft-cpu-range",
         "--prio-draft", "--cpu-mask-batch-draft", "--cpu-range-batch-draft", "--prio-batch-draft", "--cpu-strict",
         "--poll", "--poll-batch-draft", "--defrag-thold", "--backend-sampling", "--spec-draft-backend-sampling",
         "--fit-target", "--fit-ctx")


@pytest.mark.parametrize("command", [["run"], ["chat"], ["serve"], ["bench"], ["eval", "humaneval"]])
def test_help_lists_them(command):
    shown = CliRunner().invoke(main, [*command, "--help"]).output
    missing = [flag for flag in FLAGS if flag not in shown]
    assert not missing, missing


def test_bench_gives_llamacpps_tools_the_same_flags():
    """bench --against-llamacpp: llama.cpp's tools load as ggufspec did (the draft takes them from the target's)."""
    from ggufspec.cli.generate import llamacpp_load_args
    load = {"kv_offload": False, "op_offload": True, "repack": False, "no_host": True, "check_tensors": False,
            "numa": "distribute", "n_cpu_ffn": 2, "prio": -1, "cpu_range": "0-1", "perf": None}
    target, draft = llamacpp_load_args(load)
    assert target == ("--no-host", "--numa", "distribute", "-ncffn", "2", "-Cr", "0-1", "--prio", "-1", "-nkvo",
                      "--op-offload", "-nr") and draft == ()
