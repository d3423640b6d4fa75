"""Control vectors on the target, as llama.cpp's --control-vector, --control-vector-scaled and
--control-vector-layer-range (`ggufspec.cvec`).

The vectors (GGUF files of direction.N tensors, written here with the gguf package as
llama-cvector-generator writes them) reach llama.cpp: the target's logits are plain llama-cpp-python's
with the same directions summed and set by hand (llama_set_adapter_cvec), and not the unsteered ones;
scales, sums and layer ranges too. The draft has none; speculation is the steered target alone's text
(greedy: K=1, 3, auto, lookup, hybrid, MTP; --strict bit for bit; sampled: a chi-square test against the
steered target's distribution). Bad input is one line, exit code 2. run, serve and RPC workers take them;
bench --against-llamacpp gives llama.cpp's tools the same flags."""
import ctypes
import json
import subprocess

import gguf
import httpx
import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

import reference
from ggufspec import SamplingParams, cvec
from ggufspec.cli import main
from ggufspec.errors import GgufspecError
from ggufspec.session import ModelOptions, open_session
from ggufspec.tinymodels import Shape, make_weights, write_model
from clierrors import one_line_error
from reference import (draw_samples, exact_first_and_next_two, first_difference, greedy_runs_are_target_alone,
                       prompts, sampling_pvalues, target_alone)
from serverproc import GGUFSPEC, serving

N_EMBD = 64  # conftest's tiny_pair: 2 layers, so direction.1 is the one llama.cpp applies
N_CTX = 256
PROMPT = [1, 261, 262, 263]


def write_vector(path, directions: dict, dtype=np.float32):
    """A control vector file as llama-cvector-generator writes one: direction.N tensors (N: a layer, or
    any tensor name given as a string)."""
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(directions))
    for layer, values in directions.items():
        writer.add_tensor(layer if isinstance(layer, str) else f"direction.{layer}", np.asarray(values, dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def direction(seed: int, n: int = N_EMBD, scale: float = 0.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    """Directions for the tiny target (by name: its file and its {layer: values}), a deeper model with its
    vector, and files llama.cpp refuses."""
    folder = tmp_path_factory.mktemp("cvec")
    good = {"one": {1: direction(1)}, "two": {1: direction(2)}, "deep": {n: direction(10 + n) for n in (1, 2, 3, 4)}}
    files = {name: write_vector(folder / f"{name}.gguf", dirs) for name, dirs in good.items()}
    bad = {"wide": {1: direction(1, 32)}, "layer0": {0: direction(1)}, "named": {"blk.1.weight": direction(1)},
           "twod": {1: np.ones((2, 32), np.float32)}, "uneven": {1: direction(1), 2: direction(2, 32)},
           "beyond": {5: direction(1)}, "huge": {100_000: direction(1)}, "empty": {}}
    files.update({name: write_vector(folder / f"{name}.gguf", dirs) for name, dirs in bad.items()})
    files["f16"] = write_vector(folder / "f16.gguf", {1: direction(1)}, np.float16)
    shape = Shape(n_layer=4, eos_bias=4.0)
    files["deep_model"] = write_model(folder / "deep-target.gguf", shape, make_weights(shape, seed=5))
    return {"files": files, "dirs": good}


def by_hand(*scaled) -> np.ndarray:
    """llama.cpp's buffer for ({layer: values}, scale) pairs: layer 1's n_embd floats first, summed."""
    n_layers = max(layer for dirs, _ in scaled for layer in dirs)
    data = np.zeros(n_layers * N_EMBD, np.float32)
    for dirs, scale in scaled:
        for layer, values in dirs.items():
            data[(layer - 1) * N_EMBD:layer * N_EMBD] += values * np.float32(scale)
    return data


def steered_llama(data: np.ndarray, start: int, end: int):
    """llama_cpp.Llama, the control vector set by hand on each one made (reference.Llama's stand-in)."""
    def make(**options):
        llm = llama_cpp.Llama(**options)
        pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        assert llama_cpp.llama_set_adapter_cvec(llm._ctx.ctx, pointer, data.size, N_EMBD, start, end) == 0
        return llm
    return make


@pytest.fixture
def steered_reference(monkeypatch):
    """reference.py's helpers over a steered target: steered_reference(data, start=1, end=2)."""
    return lambda data, start=1, end=2: monkeypatch.setattr(reference, "Llama", steered_llama(data, start, end))


def last_logits(path, data=None, start=1, end=2) -> np.ndarray:
    make = steered_llama(data, start, end) if data is not None else llama_cpp.Llama
    llm = make(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(PROMPT)
        return np.array(llm.scores[len(PROMPT) - 1])
    finally:
        llm.close()


def opened(target, draft=None, **fields):
    """A Session over the target (and draft) with ModelOptions `fields` (control_vector=..., ...)."""
    options = dict(n_ctx=N_CTX, n_threads=1, flash_attn="off", no_draft=draft is None)
    return open_session(ModelOptions(model=str(target), model_draft=draft and str(draft), **{**options, **fields}),
                        log=lambda line: None)


def target_logits(decoder) -> np.ndarray:
    target = decoder.target
    target.keep(0)
    target.decode(PROMPT)
    return np.array(target.logits(0))  # a copy: the view dies with the context


@pytest.fixture(scope="module")
def decoders(tiny_pair, vectors):
    """The tiny pair steered by vector one: batch verification (flash attention off, as the reference) and --strict."""
    target, draft = tiny_pair
    one = (str(vectors["files"]["one"]),)
    with opened(target, draft, control_vector=one) as batch, opened(target, draft, control_vector=one, strict=True) as strict:
        yield {"batch": batch.decoder, "strict": strict.decoder}


# ---------------------------------------------------------------- the vector reaches llama.cpp, the target's alone

def test_the_target_is_steered_as_by_hand_and_the_draft_is_not(tiny_pair, vectors, decoders):
    decoder = decoders["batch"]
    assert cvec.applied_to(decoder.target_llm) == cvec.Applied(((str(vectors["files"]["one"]), 1.0),), 1, 2)
    assert cvec.applied_to(decoder.draft_llm) is None
    steered = last_logits(tiny_pair[0], by_hand((vectors["dirs"]["one"], 1.0)))
    got = target_logits(decoders["strict"])
    assert np.allclose(got, steered, atol=1e-4)
    assert np.abs(got - last_logits(tiny_pair[0])).max() > 0.5


def test_scaled_and_summed_vectors_are_llamacpps_sum(tiny_pair, vectors):
    files, dirs = vectors["files"], vectors["dirs"]
    expected = last_logits(tiny_pair[0], by_hand((dirs["one"], 0.5), (dirs["two"], -1.5), (dirs["one"], 1.0)))
    # --control-vector's first, then --control-vector-scaled's, a comma-separated list as one value
    with opened(tiny_pair[0], control_vector=(str(files["one"]),),
                control_vector_scaled=(f"{files['one']}:0.5,{files['two']}:-1.5",)) as session:
        assert np.allclose(target_logits(session.decoder), expected, atol=1e-4)
    with opened(tiny_pair[0], control_vector_scaled=[(files["one"], 1.5), (files["two"], -1.5)]) as session:
        assert np.allclose(target_logits(session.decoder), expected, atol=1e-4)


def test_scale_zero_steers_nothing(tiny_pair, vectors):
    with opened(tiny_pair[0], control_vector_scaled=(f"{vectors['files']['one']}:0",)) as zero, \
            opened(tiny_pair[0]) as plain:
        assert np.array_equal(target_logits(zero.decoder), target_logits(plain.decoder))  # bit for bit


@pytest.mark.parametrize("given, start, end", [(None, 1, 4), ((0, 0), 1, 4), ((2, 3), 2, 3), ((3, -1), 3, 4), ((0, 1), 1, 1)])
def test_the_layer_range_is_llamacpps(vectors, given, start, end):
    """A 4-layer model: directions 1 to 3 apply (direction.4 has no layer: llama.cpp skips it), within the range."""
    model, dirs = vectors["files"]["deep_model"], vectors["dirs"]["deep"]
    with opened(model, control_vector=(str(vectors["files"]["deep"]),), control_vector_layer_range=given) as session:
        applied = cvec.applied_to(session.decoder.target_llm)
        assert (applied.start, applied.end) == (start, end)
        got = target_logits(session.decoder)
    assert np.allclose(got, last_logits(model, by_hand((dirs, 1.0)), start, end), atol=1e-4)
    if given not in (None, (0, 0)):
        assert np.abs(got - last_logits(model, by_hand((dirs, 1.0)), 1, 4)).max() > 1e-2  # the range mattered


# ---------------------------------------------------------------- greedy: the steered target's text

def test_greedy_speculation_is_the_steered_target_alone(tiny_pair, vectors, decoders, steered_reference):
    """Batch verification against plain llama-cpp-python steered by hand (a near-tie, below 1e-3, is no
    verdict); --strict against its own target alone, bit for bit."""
    steered_reference(by_hand((vectors["dirs"]["one"], 1.0)))
    greedy_runs_are_target_alone(decoders["batch"], decoders["strict"], prompts(5, seed=11),
                                 lambda prompt: target_alone(tiny_pair[0], prompt, 32, N_CTX))


def test_the_vector_changes_the_text(tiny_pair, vectors, decoders):
    """So that the identity tests above prove something: the steered text is not the plain one."""
    changed = 0
    for prompt in prompts(5, seed=11):
        plain = target_alone(tiny_pair[0], prompt, 32, N_CTX)[0]
        changed += decoders["strict"].generate(prompt, n_predict=32, n_draft=0, temperature=0).tokens != plain
    assert changed >= 4


def test_parallel_slots_share_the_steered_context(tiny_pair, vectors):
    chosen = prompts(3, seed=13)
    with opened(*tiny_pair, control_vector=(str(vectors["files"]["one"]),), strict=True, n_parallel=3) as session:
        decoder = session.decoder
        alone = [decoder.generate(p, n_predict=24, n_draft=0, temperature=0).tokens for p in chosen]
        together = decoder.generate_many(chosen, n_predict=24, n_draft=3, temperature=0)
    assert [g.tokens for g in together] == alone


def test_mtp_drafts_for_the_steered_target(tmp_path, vectors):
    """The MTP head reads the target's steered states (its own context gets no vector, as llama.cpp's): the
    text is the steered target alone's, and drafts are kept."""
    from ggufspec.tinymodels_mtp import make_mtp_model
    model = make_mtp_model(tmp_path, seed=0, shape=Shape(eos_bias=4.0))
    with opened(model, "mtp", control_vector=(str(vectors["files"]["one"]),), strict=True, no_draft=False) as session:
        decoder, accepted = session.decoder, 0
        assert session.draft_choice["kind"] == "mtp" and cvec.applied_to(decoder.target_llm) is not None
        for prompt in prompts(3, seed=3):
            alone = decoder.generate(prompt, n_predict=24, n_draft=0, temperature=0).tokens
            for k in (1, 3, "auto"):
                got = decoder.generate(prompt, n_predict=24, n_draft=k, temperature=0)
                assert got.tokens == alone, f"MTP K={k}: first difference at {first_difference(got.tokens, alone)}"
                accepted += got.stats.n_accept
    assert accepted > 0


# ---------------------------------------------------------------- sampling: chi-square

def test_sampling_is_the_steered_targets_distribution(tiny_pair, vectors, decoders, steered_reference):
    params = SamplingParams(temperature=1.5, top_k=4, top_p=1.0, min_p=0.0)
    plain = exact_first_and_next_two(tiny_pair[0], PROMPT, params)
    steered_reference(by_hand((vectors["dirs"]["one"], 1.0)))
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], PROMPT, params)
    samples = draw_samples(decoders["batch"], PROMPT, params, 3, 600)
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3
    assert min(sampling_pvalues(samples, *plain)) < 1e-6  # the test tells them apart


# ---------------------------------------------------------------- the command line

def run(tiny_pair, *flags, target=None):
    return CliRunner().invoke(main, ["run", "-m", str(target or tiny_pair[0]), "-md", str(tiny_pair[1]), "-c", str(N_CTX),
                                     "-t", "1", "-n", "16", "--temp", "0", "--json", "-p", "the cat sat", *flags], input="")


def tokens_of(result) -> list[int]:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


def test_run_with_control_vectors_is_the_steered_target_alone(tiny_pair, vectors):
    one, two = (str(vectors["files"][name]) for name in ("one", "two"))
    alone = tokens_of(run(tiny_pair, "--strict", "--no-draft", "--control-vector", one))
    assert alone != tokens_of(run(tiny_pair, "--strict", "--no-draft"))
    assert tokens_of(run(tiny_pair, "--strict", "--draft", "3", "--control-vector", one)) == alone
    assert tokens_of(run(tiny_pair, "--strict", "--lookup", "--control-vector-scaled", f"{one}:1")) == alone
    assert tokens_of(run(tiny_pair, "--strict", "--no-draft", "--control-vector", one,
                         "--control-vector-layer-range", "1", "1")) == alone  # layer 1: the tiny target's one
    both = tokens_of(run(tiny_pair, "--strict", "--no-draft", "--control-vector", f"{one},{two}"))
    assert both not in (alone, tokens_of(run(tiny_pair, "--strict", "--no-draft", "--control-vector", two)))
    assert tokens_of(run(tiny_pair, "--strict", "--draft", "auto", "--control-vector", one,
                         "--control-vector-scaled", f"{two}:1")) == both


BAD = [
    (["--control-vector", "missing.gguf"], "control vector not found: missing.gguf"),
    (["--control-vector", "FOLDER"], "is a folder: give a .gguf file"),
    (["--control-vector", "NOTGGUF"], "is not a GGUF file"),
    (["--control-vector", "MODEL"], "is not a direction.N (N: a layer); is it a control vector?"),
    (["--control-vector", "empty"], "has no direction tensors"),
    (["--control-vector", "named"], "its tensor 'blk.1.weight' is not a direction.N"),
    (["--control-vector", "layer0"], "direction.0 is for layer 0, which llama.cpp never steers"),
    (["--control-vector", "f16"], "direction.1 is F16; llama.cpp reads F32 directions only"),
    (["--control-vector", "twod"], "direction.1 has the shape [32, 2], not one dimension"),
    (["--control-vector", "uneven"], "direction.2 has 32 elements and the directions before it 64"),
    (["--control-vector", "wide"], "is 32 wide, but the target target.gguf is 64 (n_embd)"),
    (["--control-vector", "one,wide"], "is 32 wide, but"),
    (["--control-vector", "beyond"], "steer no layer: their directions are for layers 5 to 5"),
    (["--control-vector", "one", "--control-vector-layer-range", "2", "4"], "steer no layer"),
    (["--control-vector", "one", "--control-vector-layer-range", "2", "1"], "START is past END"),
    (["--control-vector-layer-range", "1", "2"], "--control-vector-layer-range says where control vectors apply"),
    (["--control-vector-layer-range", "1"], "requires 2 arguments"),
    (["--control-vector", "one", "--control-vector-layer-range", "1", str(2 ** 31)], "two whole numbers (layers)"),
    (["--control-vector", "huge"], "direction.100000 is for layer 100000, past any model's"),
    (["--control-vector-scaled", "one:abc"], "the scale 'abc' is not a number"),
    (["--control-vector-scaled", "one:nan"], "the scale must be a finite number"),
    (["--control-vector-scaled", "one", "0.5"], "--control-vector-scaled takes FNAME:SCALE in one argument"),
    (["--control-vector", "one,"], "an empty file name"),
]


@pytest.mark.parametrize("flags, says", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_bad_control_vectors_are_one_line(tiny_pair, vectors, tmp_path, flags, says):
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a vector\n")
    names = {**{name: str(path) for name, path in vectors["files"].items()}, "MODEL": str(tiny_pair[1]),
             "NOTGGUF": str(not_gguf), "FOLDER": str(tmp_path)}
    swapped = [",".join(names.get(part, part) for part in flag.split(",")) for flag in flags]
    swapped = [":".join([names.get(flag.split(":")[0], flag.split(":")[0]), *flag.split(":")[1:]]) for flag in swapped]
    one_line_error(run(tiny_pair, *swapped), says)


def test_an_architecture_llamacpp_never_steers_is_refused(tiny_pair, vectors, monkeypatch):
    """plamo2, hy_v4...: their llama.cpp graphs add no vector, so it would be silently ignored (here the
    tiny llama stands in for one)."""
    monkeypatch.setattr(cvec, "UNSTEERED_ARCHITECTURES", frozenset({"llama"}))
    one_line_error(run(tiny_pair, "--control-vector", str(vectors["files"]["one"])),
                   "a llama model: llama.cpp's graph for llama adds none")


@pytest.mark.parametrize("command", [["run"], ["chat"], ["serve"], ["bench"], ["eval", "humaneval"]])
def test_every_command_that_loads_a_target_takes_the_flags(command):
    shown = CliRunner().invoke(main, [*command, "--help"]).output
    for flag in ("--control-vector FNAME", "--control-vector-scaled FNAME:SCALE,...",
                 "--control-vector-layer-range START END"):
        assert flag in shown, (command, flag)


def test_the_python_api_refuses_bad_vectors_in_one_line(tiny_pair, vectors):
    one = vectors["files"]["one"]
    for fields, says in (({"control_vector_scaled": [(one, "1")]}, "the scale must be a finite number"),
                         ({"control_vector_scaled": [(one, 1.0, 2)]}, "a (path, scale) pair"),
                         ({"control_vector": [3]}, "takes file names"),
                         ({"control_vector": [one], "control_vector_layer_range": (1,)}, "START END, two whole numbers")):
        with pytest.raises(GgufspecError) as raised:
            opened(tiny_pair[0], **fields)
        assert says in str(raised.value) and "\n" not in str(raised.value)


def test_bench_gives_llamacpps_tools_the_same_flags():
    """llama.cpp's tools set them on the target alone too (the draft's context never gets them)."""
    from ggufspec.cli.generate import llamacpp_load_args
    load = {"control_vector": ("a.gguf,b.gguf",), "control_vector_scaled": ("c.gguf:0.5", "d.gguf:-1"),
            "control_vector_layer_range": (2, 5)}
    assert llamacpp_load_args(load) == (("--control-vector", "a.gguf,b.gguf", "--control-vector-scaled", "c.gguf:0.5",
                                         "--control-vector-scaled", "d.gguf:-1", "--control-vector-layer-range", "2",
                                         "5"), ())
    assert llamacpp_load_args({"control_vector": (), "control_vector_layer_range": None}) == ((), ())


# ---------------------------------------------------------------- serve, RPC workers

def test_serve_answers_as_run_does(tiny_pair, vectors, tmp_path):
    one = str(vectors["files"]["one"])
    expected = tokens_of(run(tiny_pair, "--strict", "--no-draft", "--control-vector", one))
    with serving(tmp_path, "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "-c", str(N_CTX), "--strict",
                 "--control-vector", one) as server:
        body = {"prompt": "the cat sat", "n_predict": 16, "temperature": 0, "draft": 3, "return_tokens": True}
        assert httpx.post(server.url + "/completion", json=body, timeout=60).json()["tokens"] == expected


def test_a_target_on_rpc_workers_is_steered_alike(needs_rpc, tiny_pair, vectors, tmp_path):
    from rpcworkers import Worker
    one = str(vectors["files"]["one"])
    expected = tokens_of(run(tiny_pair, "--strict", "--no-draft", "--control-vector", one))
    worker = Worker(tmp_path)
    try:
        done = subprocess.run([GGUFSPEC, "run", "-m", str(tiny_pair[0]), "--no-draft", "-c", str(N_CTX), "-t", "1",
                               "-n", "16", "--temp", "0", "--json", "-p", "the cat sat", "--strict", "--rpc",
                               f"127.0.0.1:{worker.port}", "--control-vector", one],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        worker.stop()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == expected


def test_the_servers_fingerprint_names_the_vectors(tiny_pair, vectors):
    """OpenAI's system_fingerprint changes with what changes the target's logits: the vectors and their scales."""
    from ggufspec.server.props import system_fingerprint
    one = str(vectors["files"]["one"])
    prints = []
    for fields in ({}, {"control_vector": (one,)}, {"control_vector_scaled": (f"{one}:0.5",)}):
        with opened(tiny_pair[0], **fields) as session:
            prints.append(system_fingerprint(session.decoder))
    assert len(set(prints)) == 3, prints
