"""llama.cpp's RoPE/YaRN flags (--rope-scaling, --rope-scale, --rope-freq-base, --rope-freq-scale, --yarn-*),
--override-kv and its multi-GPU flags (-sm, -mg, -ts, -dev, -devd, --list-devices) (`ggufspec.modelflags`).

As llama.cpp's speculative tools and llama-server (common_base_params_to_speculative), both models get the
RoPE/YaRN params and the metadata overrides: each flag changes the target's and the draft's logits, to
those plain llama-cpp-python computes with the same keywords; the greedy text changes, and speculation
(a draft, K = 3 and auto, and n-gram lookup) is the target alone's text under the same flags, --strict bit
for bit. --override-kv changes what llama.cpp reads (the BOS rule, the trained context, an epsilon); the
multi-GPU flags reach llama_cpp.Llama (checked on the kwargs: this machine may have no GPU); bad values are
one line, exit code 2, before any model loads."""
import json
from dataclasses import replace

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder, placement
from ggufspec.cli import main
from ggufspec.errors import GgufspecError
from ggufspec.load import LoadParams, flags_tag, open_model
from ggufspec.modelflags import check_split, kv_overrides, rope_keywords
from ggufspec.session import ModelOptions, load_flags_by_role, open_session, planned_rpc_split
from ggufspec.tinymodels import Shape, make_pair
from clierrors import one_line_error, run_pair
from reference import greedy_runs_are_target_alone, prompts, target_alone

N_CTX = 256
# weights twice the conftest pair's: attention sharp enough that positions (and so RoPE) decide tokens
SHAPE = Shape(eos_bias=4.0, weight_scale=1.0)
LONG = [259 + i % 22 for i in range(60)]  # a prompt long enough for the positions to matter

# each flag set, as ModelOptions fields, and as llama_cpp.Llama's keywords (the reference's)
ROPE_CASES = {
    "freq-base": (dict(rope_freq_base=100.0), dict(rope_freq_base=100.0)),
    "linear": (dict(rope_scaling="linear", rope_scale=4.0), dict(rope_scaling_type=1, rope_freq_scale=0.25)),
    "yarn": (dict(rope_scaling="yarn", rope_freq_scale=0.25, yarn_orig_ctx=512, yarn_ext_factor=0.5,
                  yarn_beta_fast=16.0, yarn_beta_slow=2.0),
             dict(rope_scaling_type=2, rope_freq_scale=0.25, yarn_orig_ctx=512, yarn_ext_factor=0.5,
                  yarn_beta_fast=16.0, yarn_beta_slow=2.0)),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("rope"), seed=0, shape=SHAPE)


def loaded_logits(path, role: str, options: dict, tokens=LONG) -> np.ndarray:
    """The last row of logits of the model as ggufspec loads it under these ModelOptions fields."""
    fields = load_flags_by_role(ModelOptions(**options))[role]
    llm = open_model(path, role, replace(LoadParams(n_ctx=N_CTX, n_threads=1, flash_attn="off"), **fields))
    try:
        return last_row(llm, tokens)
    finally:
        llm.close()


def last_row(llm, tokens) -> np.ndarray:
    llm.eval(tokens)  # logits kept for the last token only (logits_all off): read from the context
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()


def plain_logits(path, tokens=LONG, **keywords) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=1, flash_attn=False, verbose=False, **keywords)
    try:
        return last_row(llm, tokens)
    finally:
        llm.close()


# ---------------------------------------------------------------- RoPE/YaRN: applied, to both models

@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_flags_change_both_models_logits_as_llamacpp_computes_them(pair, case):
    options, keywords = ROPE_CASES[case]
    for path, role in zip(pair, ("target", "draft")):
        got = loaded_logits(path, role, options)
        assert np.abs(got - plain_logits(path)).max() > 0.05, f"{case}: the {role}'s logits did not change"
        np.testing.assert_allclose(got, plain_logits(path, **keywords), atol=1e-4, err_msg=f"{case} {role}")


@pytest.mark.parametrize("flag", [dict(yarn_ext_factor=0.0), dict(yarn_beta_fast=8.0), dict(yarn_beta_slow=4.0),
                                  dict(yarn_orig_ctx=128), dict(yarn_ext_factor=0.0, yarn_attn_factor=2.0)])
def test_each_yarn_flag_is_applied(pair, flag):
    """Under YaRN scaling each --yarn-* flag moves the logits (--yarn-attn-factor where the extrapolation
    mix is 0: otherwise llama.cpp computes the attention factor itself)."""
    yarn = dict(rope_scaling="yarn", rope_scale=4.0, yarn_orig_ctx=512)
    moved = loaded_logits(pair[0], "target", {**yarn, **flag}) - loaded_logits(pair[0], "target", yarn)
    assert np.abs(moved).max() > 0.05


def test_rope_scaling_none_scales_nothing(pair):
    """As llama.cpp: scaling type none forces the frequency scale to 1, --rope-scale or not."""
    np.testing.assert_array_equal(loaded_logits(pair[0], "target", dict(rope_scaling="none", rope_scale=4.0)),
                                  loaded_logits(pair[0], "target", {}))


@pytest.fixture(scope="module", params=list(ROPE_CASES))
def rope_decoders(request, pair):
    """Batch verification (flash attention off, as the reference) and --strict, under one flag set."""
    options, keywords = ROPE_CASES[request.param]
    flags = load_flags_by_role(ModelOptions(**options))
    common = dict(n_ctx=N_CTX, n_threads=1, load_flags=flags)
    with SpeculativeDecoder(*pair, flash_attn="off", **common) as batch, \
            SpeculativeDecoder(*pair, strict=True, **common) as strict:
        yield request.param, keywords, batch, strict


RUNS = [("model", 3), ("model", "auto"), ("lookup", 3)]


def test_speculation_under_the_flags_is_the_target_alones_text_under_them(pair, rope_decoders):
    """Against plain llama-cpp-python's target alone with the same keywords (a near-tie below 1e-3 is no
    verdict), whose text the flags changed; --strict against its own target alone, bit for bit."""
    case, keywords, batch, strict = rope_decoders
    changed = []

    def expected_of(prompt):  # the target alone under the flags, and whether they changed its text
        expected = target_alone(pair[0], prompt, 32, N_CTX, **keywords)
        changed.append(expected[0] != target_alone(pair[0], prompt, 32, N_CTX)[0])
        return expected
    greedy_runs_are_target_alone(batch, strict, prompts(4, seed=11), expected_of, RUNS)
    assert sum(changed) >= 3, f"{case}: the flags hardly change the text: the identity above proves little"


def test_the_draft_and_the_mtp_head_get_the_targets_rope_params(pair, tmp_path):
    from ggufspec.tinymodels_mtp import make_mtp_model
    flags = load_flags_by_role(ModelOptions(rope_scaling="yarn", rope_scale=4.0, rope_freq_base=5000.0))
    with SpeculativeDecoder(*pair, n_ctx=N_CTX, n_threads=1, load_flags=flags) as decoder:
        contexts = [decoder.target_llm.context_params, decoder.draft_llm.context_params]
    mtp = make_mtp_model(tmp_path, seed=0, shape=Shape(eos_bias=4.0))
    with SpeculativeDecoder(str(mtp), "mtp", n_ctx=N_CTX, n_threads=1, load_flags=flags) as decoder:
        contexts.append(decoder.draft.llm.context_params)
    for params in contexts:
        assert (params.rope_scaling_type, params.rope_freq_scale, params.rope_freq_base) == (2, 0.25, 5000.0)
        assert (params.yarn_attn_factor, params.yarn_beta_fast) == (-1.0, -1.0)  # llama.cpp's: the model's own


# ---------------------------------------------------------------- --override-kv: what llama.cpp reads changes

def test_override_kv_reaches_both_models(pair):
    """add_bos_token false: neither model adds BOS (the pair still passes llama.cpp's compatibility check,
    which compares the BOS rules); a context length read from the metadata: -c 0 takes it."""
    options = dict(model=str(pair[0]), model_draft=str(pair[1]), n_threads=1, n_ctx=0,
                   override_kv=("tokenizer.ggml.add_bos_token=bool:false", "llama.context_length=int:1024"))
    with open_session(ModelOptions(**options), log=lambda line: None) as session:
        for llm in (session.decoder.target_llm, session.decoder.draft_llm):
            assert llm.tokenize(b"the cat")[0] != 1 and llm.n_ctx() == 1024
    plain = ModelOptions(**{**options, "override_kv": ()})
    with open_session(plain, log=lambda line: None) as session:
        assert session.decoder.target_llm.tokenize(b"the cat")[0] == 1 and session.decoder.target_llm.n_ctx() == 2048


def test_override_kv_changes_the_text_and_a_wrong_type_is_one_line(pair, loads):
    plain = json.loads(run_pair(pair, n_predict=16).stdout)["tokens"]
    result = run_pair(pair, "--override-kv", "llama.attention.layer_norm_rms_epsilon=float:0.5", n_predict=16)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] != plain
    assert loads[-1]["kv_overrides"] == {"llama.attention.layer_norm_rms_epsilon": 0.5}  # the draft's too
    # llama.cpp would read the file's int and say so in its log only
    one_line_error(run_pair(pair, "--override-kv", "llama.context_length=float:4096"), "llama.context_length",
                   "as int", "llama.context_length=int:VALUE")


def test_override_kv_values_as_llamacpp_parses_them():
    assert kv_overrides(["a=int:-3,b=float:0.5", "c=bool:true", 'd=str:x=y', '"e=str:a,b"']) == (
        ("a", -3), ("b", 0.5), ("c", True), ("d", "x=y"), ("e", "a,b"))
    assert kv_overrides(["a=int:1", "a=int:1"]) == (("a", 1),)  # the same twice is once
    assert type(dict(kv_overrides("f=float:1"))["f"]) is float  # a float override, though written as 1


# ---------------------------------------------------------------- several GPUs: the kwargs Llama gets

def test_split_flags_reach_both_models_llama_kwargs(pair, loads):
    result = run_pair(pair, "-sm", "row", "-mg", "1", "-ts", "3/1", "--rope-scale", "2", "--override-kv", "x.y=str:z")
    assert result.exit_code == 0, result.output
    assert len(loads) == 2
    for kwargs in loads:
        assert (kwargs["split_mode"], kwargs["main_gpu"], kwargs["tensor_split"]) == (llama_cpp.LLAMA_SPLIT_MODE_ROW,
                                                                                       1, [3.0, 1.0])
        assert (kwargs["rope_freq_scale"], kwargs["kv_overrides"]) == (0.5, {"x.y": "z"})
    assert run_pair(pair).exit_code == 0
    assert (loads[-1]["split_mode"], loads[-1]["main_gpu"], loads[-1]["tensor_split"]) == (1, 0, None)  # defaults


@pytest.mark.parametrize("flags, offloaded", [(["-dev", "none"], (True, True)), (["-devd", "none"], (False, True)),
                                              (["-dev", "none", "-ngl", "99"], (True, True))])
def test_device_none_keeps_a_model_on_the_cpu(pair, loads, flags, offloaded):
    """-dev none: an empty device list (llama.cpp's: nothing offloaded, whatever -ngl), the draft following
    it; -devd none: the draft's alone."""
    result = run_pair(pair, *flags)
    assert result.exit_code == 0, result.output
    assert len(loads) == 2
    for kwargs, none in zip(loads, offloaded):
        assert (kwargs["devices"] is not None) == none, kwargs
        if none:
            assert kwargs["n_gpu_layers"] == 0


def test_list_devices_prints_what_dev_may_name():
    result = CliRunner().invoke(main, ["run", "--list-devices"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    names = [d.name for d in placement.offload_devices()]
    assert lines[0] == "Available devices:" and len(lines) == 1 + max(len(names), 1)
    assert [line.split(":")[0].strip() for line in lines[1:]] == (names or ["(none)"])


def test_ts_on_rpc_replaces_the_planned_split_and_is_the_targets_alone():
    given = {"tensor_split": (3.0, 1.0)}  # no worker is asked: the planner's split is not needed
    assert planned_rpc_split("unused.gguf", "127.0.0.1:1", None, 0, N_CTX, given) == (-1, [3.0, 1.0])
    assert planned_rpc_split("unused.gguf", "127.0.0.1:1", 10, 0, N_CTX, given)[0] == 10
    flags = load_flags_by_role(ModelOptions(rpc="127.0.0.1:1", tensor_split="3,1"))
    assert flags["target"]["tensor_split"] == (3.0, 1.0) and "tensor_split" not in flags["draft"]
    assert load_flags_by_role(ModelOptions(tensor_split=[2, 1]))["draft"]["tensor_split"] == (2.0, 1.0)


def test_llamacpp_refusals_are_said_before_the_load(monkeypatch):
    fake = [placement.Device(1, "GPU0", "", 0, 0, placement.DEVICE_GPU)]
    monkeypatch.setattr(placement, "default_devices", lambda: fake)
    with pytest.raises(GgufspecError, match="-mg 1: there are 1 devices"):
        check_split({"split_mode": "none", "main_gpu": 1}, None)
    check_split({"split_mode": "none", "main_gpu": 0}, None)
    monkeypatch.setattr(placement, "default_devices", lambda: [])
    with pytest.raises(GgufspecError, match="-sm tensor"):
        check_split({"split_mode": "tensor"}, None)


def test_costs_are_remembered_per_placement_not_per_rope():
    def tag(**options):
        return flags_tag(load_flags_by_role(ModelOptions(**options)))
    assert tag() == tag(rope_freq_base=100.0) == tag(split_mode="layer", main_gpu=0) == ""
    assert len({tag(split_mode="row"), tag(tensor_split="3,1"), tag(override_kv="a=int:1"), tag(main_gpu=1)}) == 4


# ---------------------------------------------------------------- bad values: one line, before anything loads

@pytest.mark.parametrize("flags, words", [
    (["--rope-scaling", "cubic"], ["--rope-scaling", "cubic"]),
    (["--rope-scale", "0"], ["--rope-scale", "above 0"]),
    (["--rope-scale", "-2"], ["--rope-scale", "above 0"]),
    (["--rope-freq-scale", "nan"], ["--rope-freq-scale", "finite"]),
    (["--rope-freq-base", "0"], ["--rope-freq-base", "above 0"]),
    (["--rope-scale", "2", "--rope-freq-scale", "0.5"], ["give one of them"]),
    (["--yarn-orig-ctx", "-5"], ["--yarn-orig-ctx", "-5"]),
    (["--yarn-beta-fast", "inf"], ["--yarn-beta-fast", "finite"]),
    (["--override-kv", "foo"], ["--override-kv 'foo'", "KEY=TYPE:VALUE"]),
    (["--override-kv", "a=blob:1"], ["'a=blob:1'", "int, float, bool, str"]),
    (["--override-kv", "=int:1"], ["KEY=TYPE:VALUE"]),
    (["--override-kv", "a=int:x"], ["'x' is no int"]),
    (["--override-kv", "a=bool:yes"], ["'yes' is no bool", "true or false"]),
    (["--override-kv", "a=str:" + "x" * 128], ["no str"]),
    (["--override-kv", "a=int:1,b"], ["'b'"]),
    (["--override-kv", "a=int:1", "--override-kv", "a=int:2"], ["gives a twice"]),
    (["-sm", "diagonal"], ["--split-mode", "diagonal"]),
    (["-mg", "-1"], ["-mg/--main-gpu", "-1"]),
    (["-ts", "3,x"], ["-ts/--tensor-split", "3,x"]),
    (["-ts", "-1,1"], ["numbers >= 0"]),
    (["-ts", ",".join(["1"] * 17)], ["17 shares"]),
    (["-dev", "NOPE0"], ["-dev NOPE0", "no device 'NOPE0'", "--list-devices"]),
    (["-devd", "none,NOPE0"], ["-devd", "'none'"]),
    (["-dev", "none", "--rpc", "127.0.0.1:1"], ["-dev and --rpc"]),
])
def test_bad_values_are_one_line_before_anything_loads(pair, loads, flags, words):
    one_line_error(run_pair(pair, *flags), *words)
    assert loads == []


def test_the_python_api_checks_them_too():
    for bad in (dict(rope_scale=0), dict(rope_scaling="cubic"), dict(yarn_orig_ctx=1.5), dict(override_kv=5),
                dict(split_mode="diagonal"), dict(main_gpu=True), dict(tensor_split=["a"]), dict(device="NOPE0")):
        with pytest.raises(GgufspecError):
            load_flags_by_role(ModelOptions(**bad))
    assert rope_keywords(rope_scale=4) == (("rope_freq_scale", 0.25),)


# ---------------------------------------------------------------- --help, bench --against-llamacpp

FLAGS = ("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
         "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast", "--override-kv",
         "--split-mode", "--main-gpu", "--tensor-split", "--device", "--device-draft", "--list-devices")


@pytest.mark.parametrize("command", [["run"], ["chat"], ["serve"], ["bench"], ["eval", "humaneval"]])
def test_help_lists_them(command):
    shown = CliRunner().invoke(main, [*command, "--help"]).output
    missing = [flag for flag in FLAGS if flag not in shown]
    assert not missing, missing
    assert "both models" in shown


def test_bench_gives_them_to_llamacpps_tools():
    from ggufspec.cli.generate import llamacpp_load_args
    load = {"rope_scaling": "yarn", "rope_scale": 4.0, "yarn_ext_factor": 0.0, "yarn_orig_ctx": None,
            "override_kv": ("a=int:1", "b=bool:false"), "split_mode": "row", "main_gpu": 0, "tensor_split": "3,1",
            "device": "none", "device_draft": "CUDA1", "cache_type_k": "f16"}
    assert llamacpp_load_args(load) == (
        ("--rope-scaling", "yarn", "--rope-scale", "4.0", "--yarn-ext-factor", "0.0", "--override-kv", "a=int:1",
         "--override-kv", "b=bool:false", "-sm", "row", "-mg", "0", "-ts", "3,1", "-dev", "none"), ("-devd", "CUDA1"))
