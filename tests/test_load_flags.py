"""llama.cpp's load flags (-b, -ub, -tb, -td, -tbd, --mlock, --no-mmap, -ctk, -ctv, -ctkd, -ctvd): they
reach both models as llama.cpp gives them (read back from each llama_cpp.Llama and its context), bad
values are one line and exit code 2, and speculative decoding under them is still the target alone's
text under the same flags (a quantized cache, a micro-batch smaller than a step's K + 1)."""
import json

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.load import LoadParams, micro_batch
from ggufspec.session import ModelOptions, open_session
from ggufspec.tinymodels import Shape, make_pair
from clierrors import one_line_error
from reference import NEAR_TIE, first_difference, prompts

TYPE_ID = {"f16": 1, "q4_0": 2, "q5_0": 6, "q8_0": 8}  # ggml's type ids
MMAP, MLOCK, MMAP_MLOCK, NO_MMAP = (llama_cpp.LLAMA_LOAD_MODE_MMAP, llama_cpp.LLAMA_LOAD_MODE_MLOCK,
                                    llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK, llama_cpp.LLAMA_LOAD_MODE_NONE)


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """A tiny pair whose attention heads are 32 wide: a quantized cache stores blocks of 32 elements
    (the conftest pair's heads are 16 wide, which llama.cpp refuses a quantized cache for)."""
    return make_pair(tmp_path_factory.mktemp("wide"), seed=0, shape=Shape(n_embd=64, n_head=2, n_head_kv=1, eos_bias=4.0))


@pytest.fixture
def loaded(monkeypatch):
    """What each llama_cpp.Llama a command opens was given and its context applied, in load order
    (the target, then the draft)."""
    seen = []

    class Recording(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ctx = self._ctx.ctx
            seen.append({"n_batch": llama_cpp.llama_n_batch(ctx), "n_ubatch": llama_cpp.llama_n_ubatch(ctx),
                         "n_threads": llama_cpp.llama_n_threads(ctx),
                         "n_threads_batch": llama_cpp.llama_n_threads_batch(ctx),
                         "type_k": self.context_params.type_k, "type_v": self.context_params.type_v,
                         "load_mode": self.model_params.load_mode})
    monkeypatch.setattr(llama_cpp, "Llama", Recording)
    return seen


def run(pair, *flags, command="run"):
    target, draft = pair
    return CliRunner().invoke(main, [command, "-m", str(target), "-md", str(draft), "-n", "4", "-c", "128", "-t", "1",
                                     *(["-p", "the cat"] if command == "run" else []), *flags], input="")


def tokens_of(result) -> list[int]:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


# ---------------------------------------------------------------- the flags reach llama.cpp

def test_every_flag_reaches_both_models(wide_pair, loaded):
    result = run(wide_pair, "-b", "64", "-ub", "8", "-tb", "2", "-td", "1", "-tbd", "3", "--no-mmap", "-fa", "on",
                 "-ctk", "q8_0", "-ctv", "q4_0", "-ctkd", "q5_0", "-ctvd", "q8_0")
    assert result.exit_code == 0, result.output
    target, draft = loaded
    assert target == {"n_batch": 64, "n_ubatch": 8, "n_threads": 1, "n_threads_batch": 2, "type_k": TYPE_ID["q8_0"],
                      "type_v": TYPE_ID["q4_0"], "load_mode": NO_MMAP}
    assert draft == {"n_batch": 64, "n_ubatch": 8, "n_threads": 1, "n_threads_batch": 3, "type_k": TYPE_ID["q5_0"],
                     "type_v": TYPE_ID["q8_0"], "load_mode": NO_MMAP}


def test_the_drafts_defaults_are_llamacpps(wide_pair, loaded):
    """The draft's threads follow the target's (-td: -t; -tbd: -tb), its cache types are its own (f16),
    and both models share -b and -ub (default 512 each, the context capping -b)."""
    result = run(wide_pair, "-t", "2", "-tb", "3", "-ctk", "q8_0", "-ctv", "q8_0", "-c", "1024")
    assert result.exit_code == 0, result.output
    target, draft = loaded
    assert (target["n_threads"], target["n_threads_batch"], target["type_k"]) == (2, 3, TYPE_ID["q8_0"])
    assert (draft["n_threads"], draft["n_threads_batch"], draft["type_k"], draft["type_v"]) == (2, 3, 1, 1)
    assert all((m["n_batch"], m["n_ubatch"], m["load_mode"]) == (512, 512, MMAP) for m in loaded)


def test_a_draft_thread_count_alone_leaves_its_batches_the_targets(wide_pair, loaded):
    assert run(wide_pair, "-t", "2", "-td", "1").exit_code == 0
    assert [(m["n_threads"], m["n_threads_batch"]) for m in loaded] == [(2, 2), (1, 2)]


@pytest.mark.parametrize("flags, batches", [(["-b", "2048"], (2048, 512)),   # -ub keeps llama.cpp's 512
                                            (["-ub", "1024"], (1024, 1024)),  # -b grows to hold it
                                            (["-b", "256", "-ub", "512"], (256, 256))])  # capped, as llama.cpp
def test_batch_sizes(wide_pair, loaded, flags, batches):
    assert run(wide_pair, *flags, "-c", "4096").exit_code == 0
    assert {(m["n_batch"], m["n_ubatch"]) for m in loaded} == {batches}


@pytest.mark.parametrize("flags, mode", [(["--mlock"], MMAP_MLOCK), (["--mlock", "--no-mmap"], MLOCK)])
def test_mlock(wide_pair, loaded, flags, mode):
    assert run(wide_pair, *flags).exit_code == 0
    assert [m["load_mode"] for m in loaded] == [mode, mode]


@pytest.mark.parametrize("mode, expected", [("auto", "MMAP"), ("none", "NONE"), ("mmap", "MMAP"), ("mlock", "MLOCK"),
                                            ("mmap+mlock", "MMAP_MLOCK")])
def test_load_mode_is_llama_cpps_newer_spelling(wide_pair, loaded, mode, expected):
    assert run(wide_pair, "-lm", mode).exit_code == 0
    assert [m["load_mode"] for m in loaded] == [getattr(llama_cpp, f"LLAMA_LOAD_MODE_{expected}")] * 2


@pytest.mark.parametrize("flags, words", [(["-lm", "dio"], "no DirectIO"),
                                          (["-lm", "mmap", "--no-mmap"], "contradict each other"),
                                          (["--load-mode", "none", "--mlock"], "contradict each other")])
def test_a_load_mode_it_cannot_honour_is_one_line(wide_pair, flags, words):
    one_line_error(run(wide_pair, *flags), words)


def test_strict_keeps_the_target_token_by_token(wide_pair, loaded):
    assert run(wide_pair, "--strict", "-ub", "8").exit_code == 0
    assert [m["n_ubatch"] for m in loaded] == [1, 8]


def test_exact_and_strict_micro_batches():
    assert micro_batch(LoadParams(n_ubatch=64, exact=True)) == 32  # EXACT_UBATCH: the tiled kernels start at 64
    assert micro_batch(LoadParams(n_ubatch=8, exact=True)) == 8
    assert micro_batch(LoadParams(n_ubatch=8), strict=True) == 1
    assert micro_batch(LoadParams(n_batch=16, n_ubatch=64)) == 16
    assert micro_batch(LoadParams(n_batch=64)) == 64  # the Python API's default: n_ubatch = n_batch


def test_a_quantized_v_cache_with_fa_auto_turns_flash_attention_on(wide_pair):
    """llama.cpp switches -fa auto on for a quantized V cache (llama_init_from_model): the same text as -fa on."""
    auto = tokens_of(run(wide_pair, "-ctv", "q8_0", "--json", "-n", "16", "--temp", "0"))
    on = tokens_of(run(wide_pair, "-ctv", "q8_0", "-fa", "on", "--json", "-n", "16", "--temp", "0"))
    assert auto == on


def test_props_report_how_each_model_loaded(wide_pair):
    props = pytest.importorskip("ggufspec.server.props")
    target, draft = wide_pair
    options = ModelOptions(model=str(target), model_draft=str(draft), n_ctx=256, n_threads=1, n_batch=32, n_ubatch=16,
                           cache_type_k="q8_0", cache_type_v="q8_0", use_mmap=False, n_threads_draft=2)
    with open_session(options, log=lambda line: None) as session:
        shown = props.pair_props(session.decoder, session.name, {})
    assert shown["target"]["load"] == {"n_batch": 32, "n_ubatch": 16, "n_threads": 1, "n_threads_batch": 1,
                                       "cache_type_k": "q8_0", "cache_type_v": "q8_0", "mmap": False, "mlock": False}
    assert shown["draft"]["load"]["cache_type_k"] == "f16" and shown["draft"]["load"]["n_threads"] == 2


# ---------------------------------------------------------------- bad values: one line, exit code 2

@pytest.mark.parametrize("flags, words", [
    (["-ctk", "q7_0"], ["-ctk", "q7_0"]),
    (["-ctvd", "q9"], ["-ctvd", "q9"]),
    (["-ub", "0"], ["-ub"]),
    (["-b", "0"], ["-b"]),
    (["-tb", "0"], ["-tb"]),
    (["-td", "0"], ["-td"]),
    (["-tbd", "-1"], ["-tbd"]),
    (["-b", "1"], ["-b 1", "--spec-draft-n-max 8", "raise -b to 9"]),
    (["-b", "4", "--draft", "4"], ["-b 4", "--draft 4", "raise -b to 5"]),
    (["-ctv", "q8_0", "-fa", "off"], ["-ctv q8_0", "flash attention", "-fa on"]),
    (["-ctvd", "q4_0", "-fa", "off"], ["-ctvd q4_0", "flash attention"]),
])
def test_bad_values_are_one_line(wide_pair, flags, words):
    one_line_error(run(wide_pair, *flags), *words)


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_refuse_the_same(wide_pair, command):
    extra = ["--port", "0"] if command == "serve" else []
    one_line_error(run(wide_pair, "-ctv", "q8_0", "-fa", "off", *extra, command=command), "-ctv q8_0")
    one_line_error(run(wide_pair, "-b", "2", "--draft", "3", *extra, command=command), "raise -b to 4")


@pytest.mark.parametrize("flag", ["-ctk", "-ctv", "-ctkd", "-ctvd"])
def test_heads_too_narrow_for_a_quantized_cache(tiny_pair, flag):
    """The conftest pair's heads are 16 wide: llama.cpp would refuse the context (or fail every decode)."""
    one_line_error(run(tiny_pair, flag, "q8_0", "-fa", "on"), flag, "16 wide", "32")


def test_a_batch_below_k_is_fine_without_drafting(wide_pair):
    assert run(wide_pair, "-b", "1", "--no-draft").exit_code == 0


# ---------------------------------------------------------------- lossless under the flags

QUANTIZED = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
TEXTS = ["the cat sat on the mat", "def x ( y ) : return x + y", "a dog ran and the cat"]


@pytest.mark.parametrize("text", TEXTS)
def test_strict_speculative_text_is_the_target_alones_bit_for_bit(wide_pair, text):
    """--strict under a quantized cache and -b 16 -ub 8 (the draft's micro-batches): every K gives the
    target alone's tokens under the same flags, with no near-tie allowance."""
    flags = [*QUANTIZED, "-b", "16", "-ub", "8", "--strict", "-p", text, "-n", "40", "--temp", "0", "--json", "-c", "256"]
    alone = tokens_of(run(wide_pair, *flags, "--no-draft"))
    accepted = 0
    for k in ("1", "3", "8", "auto"):
        result = run(wide_pair, *flags, "--draft", k)
        assert tokens_of(result) == alone, f"K={k}: first difference at {first_difference(tokens_of(result), alone)}"
        accepted += json.loads(result.stdout)["stats"]["n_accept"]
    assert accepted > 0  # the drafts were kept, not only rejected


def target_alone_under(path, prompt, n_predict, n_ctx, n_batch, n_ubatch):
    """The target alone through plain llama-cpp-python with a q8_0 cache, flash attention and these
    batch sizes: one token per eval after the prompt, and each step's top-2 margin."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, logits_all=True, verbose=False,
                          flash_attn=True, type_k=TYPE_ID["q8_0"], type_v=TYPE_ID["q8_0"], n_batch=n_batch,
                          n_ubatch=n_ubatch)
    llm.eval(prompt)
    out, margins = [], []
    while len(out) < n_predict:
        logits = np.array(llm.scores[llm.n_tokens - 1])
        token = int(np.argmax(logits))
        if token == llm.token_eos():
            break
        top2 = np.sort(logits)[-2:]
        out.append(token)
        margins.append(float(top2[1] - top2[0]))
        llm.eval([token])
    llm.close()
    return out, margins


def test_batched_speculative_text_is_the_target_alones_with_a_small_micro_batch(wide_pair):
    """Without --strict: a step's K + 1 rows (up to 9) split into micro-batches of 8 over a q8_0 cache,
    against plain llama-cpp-python under the same flags; only a near-tie may differ (reference.NEAR_TIE)."""
    target, draft = wide_pair
    options = ModelOptions(model=str(target), model_draft=str(draft), n_ctx=256, n_threads=1, flash_attn="on",
                           n_batch=16, n_ubatch=8, cache_type_k="q8_0", cache_type_v="q8_0")
    checked = near_ties = accepted = 0
    with open_session(options, log=lambda line: None) as session:
        decoder = session.decoder
        assert (decoder.target.n_batch, decoder.target.n_ubatch) == (16, 8)
        for prompt in prompts(6, seed=3):
            expected, margins = target_alone_under(target, prompt, 40, 256, 16, 8)
            for k in [1, 2, 4, 8, "auto"]:
                result = decoder.generate(prompt, n_predict=40, n_draft=k, temperature=0)
                got, accepted = result.tokens, accepted + result.stats.n_accept
                diff = first_difference(got, expected)
                if diff is not None and diff < len(margins) and margins[diff] < NEAR_TIE:
                    near_ties += 1
                    continue
                assert got == expected, f"K={k} prompt={prompt}: first difference at {diff}"
                checked += 1
    print(f"{checked} runs identical, {near_ties} at a near-tie < {NEAR_TIE}")
    assert near_ties <= checked // 10, (checked, near_ties)
    assert accepted > 0


def test_bench_takes_the_load_flags_and_gives_them_to_llamacpps_tools(wide_pair, loaded):
    """bench opens its decoder with them too, and --against-llamacpp's tools get the same ones."""
    from ggufspec.bench import NativeSettings
    from ggufspec.cli.generate import llamacpp_load_args
    target, draft = wide_pair
    result = CliRunner().invoke(main, ["bench", "-m", str(target), "-md", str(draft), "--draft", "1", "-n", "4",
                                       "--limit", "1", "-t", "1", "-c", "512", "-ctk", "q8_0", "-ctv", "q8_0",
                                       "-ub", "64", "--json"])
    assert result.exit_code == 0, result.output
    assert (loaded[0]["type_k"], loaded[0]["type_v"], loaded[0]["n_ubatch"]) == (TYPE_ID["q8_0"], TYPE_ID["q8_0"], 64)
    load = {"n_batch": None, "n_ubatch": 64, "n_threads_batch": None, "cache_type_k": "q8_0", "cache_type_v": "f16",
            "n_threads_draft": 2, "n_threads_batch_draft": None, "cache_type_k_draft": "q4_0", "cache_type_v_draft": "f16"}
    target_args, draft_args = llamacpp_load_args(load)
    assert (target_args, draft_args) == (("-ub", "64", "-ctk", "q8_0"), ("-td", "2", "-ctkd", "q4_0"))
    native = NativeSettings(1, "auto", 0, 0, target_args, draft_args)
    assert native.args(draft=False) == ["-t", "1", "-ngl", "0", "-fa", "auto", "-ub", "64", "-ctk", "q8_0"]
    assert native.args(draft=True)[-6:] == ["-ngld", "0", "-td", "2", "-ctkd", "q4_0"]


def test_bench_refuses_a_batch_smaller_than_a_step(wide_pair):
    target, draft = wide_pair
    result = CliRunner().invoke(main, ["bench", "-m", str(target), "-md", str(draft), "--draft", "4", "-b", "3"])
    line = result.stderr.strip()
    assert result.exit_code == 2 and "-b 3 is smaller than a step" in line and "\n" not in line, result.stderr


@pytest.mark.parametrize("fields,expected", [
    ({}, "off"), ({"flash_attn": "on"}, "on"), ({"flash_attn": "off"}, "off"), ({"device_names": ()}, "off"),
    ({"exact": True}, "auto"), ({"type_v": "q8_0"}, "auto"), ({"n_gpu_layers": 3}, "auto"),
    ({"device_names": ("CUDA0",)}, "auto"), ({"devices": ("rpc",)}, "auto")])
def test_flash_attention_auto_is_off_where_this_cpu_computes_every_layer(fields, expected):
    """Measured (docs/benchmarks.md, round 29): at depth, llama.cpp's CPU flash attention makes the small
    batches a verification is 1.3-1.5x dearer. Left to llama.cpp where it is needed or a GPU computes."""
    from ggufspec.load import LoadParams, resolved_flash_attn
    assert resolved_flash_attn(LoadParams(**fields)) == expected


def test_an_explicit_flash_attention_remembers_its_own_step_costs():
    from ggufspec.load import flags_tag
    assert flags_tag({"target": {"flash_attn": "auto"}}) == ""
    assert len({flags_tag({"target": {"flash_attn": fa}}) for fa in ("auto", "on", "off")}) == 3
