"""LoRA adapters on the target, as llama.cpp's --lora / --lora-scaled (`ggufspec.lora`).

The adapter (written here with the gguf package, as convert_lora_to_gguf.py writes one) changes the
target's text; speculation with the adapter on the target alone is still the adapted target's text
(greedy: the reference is plain llama-cpp-python's own `Llama(lora_path=...)`, one token per eval;
sampled: a chi-square test against that reference's distribution); scale 0 is no adapter; bad input
is one line; and `serve` lists the adapters in llama-server's shape, behind the key, its answers
the same as `run`'s."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import SamplingParams, SpeculativeDecoder
from ggufspec.cli import main
from ggufspec.errors import GgufspecError
from ggufspec.lora import adapters_of
from ggufspec.tinymodels import Shape, write_lora
from reference import (differs_at_near_tie, draw_samples, exact_first_and_next_two, first_difference,
                       greedy_runs_are_target_alone, prompts, sampling_pvalues, target_alone)
from serverproc import serving

SHAPE = Shape(eos_bias=4.0)  # conftest's tiny_pair
N_CTX = 256


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters for the tiny target (seeds 1 and 2), and one for a model of another width."""
    folder = tmp_path_factory.mktemp("lora")
    return {"one": write_lora(folder / "one.gguf", SHAPE, seed=1),
            "two": write_lora(folder / "two.gguf", SHAPE, seed=2, task_name="tiny-task"),
            "other": write_lora(folder / "other.gguf", Shape(n_embd=32, eos_bias=4.0), seed=1)}


@pytest.fixture(scope="module")
def decoders(tiny_pair, adapters):
    """The tiny pair with adapter one on the target: batch verification (flash attention off, as the
    reference), and --strict (every row computed alone)."""
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=N_CTX, n_threads=1, flash_attn="off", lora=[adapters["one"]]) as batch, \
            SpeculativeDecoder(target, draft, n_ctx=N_CTX, n_threads=1, strict=True, lora=[adapters["one"]]) as strict:
        yield {"batch": batch, "strict": strict}


def adapted_alone(tiny_pair, adapter, prompt, n_predict=32):
    """The adapted target alone through plain llama-cpp-python (its own single-adapter support)."""
    return target_alone(tiny_pair[0], prompt, n_predict, N_CTX, lora_path=str(adapter))


# ---------------------------------------------------------------- the adapter is applied, to the target only

def test_the_adapter_changes_the_targets_text_and_the_draft_has_none(tiny_pair, adapters, decoders):
    decoder = decoders["batch"]
    assert [a.path for a in adapters_of(decoder.target_llm)] == [str(adapters["one"])]
    assert adapters_of(decoder.draft_llm) == ()
    changed = 0
    for prompt in prompts(6, seed=3):
        plain, _, _ = target_alone(tiny_pair[0], prompt, 32, N_CTX)
        adapted, margins, _ = adapted_alone(tiny_pair, adapters["one"], prompt)
        got = decoder.generate(prompt, n_predict=32, n_draft=0, temperature=0).tokens
        assert got == adapted or differs_at_near_tie(got, adapted, margins), first_difference(got, adapted)
        changed += plain != adapted
    assert changed >= 4, "the adapter hardly changes the text: the identity tests below would prove little"


# ---------------------------------------------------------------- greedy: the adapted target's text

def test_greedy_speculation_is_the_adapted_target_alone(tiny_pair, adapters, decoders):
    """Batch verification against llama-cpp-python's adapted target (a near-tie, below 1e-3, is no
    verdict); --strict against its own target alone, bit for bit."""
    greedy_runs_are_target_alone(decoders["batch"], decoders["strict"], prompts(5, seed=11),
                                 lambda prompt: adapted_alone(tiny_pair, adapters["one"], prompt))


def test_parallel_slots_share_the_adapted_context(tiny_pair, adapters):
    """Slots are sequences of the one llama context the adapter is set on."""
    target, draft = tiny_pair
    chosen = prompts(3, seed=13)
    with SpeculativeDecoder(target, draft, n_ctx=N_CTX, n_threads=1, strict=True, n_parallel=3,
                            lora=[adapters["one"]]) as decoder:
        alone = [decoder.generate(p, n_predict=24, n_draft=0, temperature=0).tokens for p in chosen]
        together = decoder.generate_many(chosen, n_predict=24, n_draft=3, temperature=0)
    assert [g.tokens for g in together] == alone


def test_mtp_heads_draft_under_the_adapter_and_the_text_is_the_adapted_targets(tmp_path, monkeypatch):
    """The MTP head's context is one more over the target's model: it gets the adapter too (one that
    reaches the MTP block changes its drafts), and the text is still the adapted target alone's."""
    import ggufspec.mtp as mtp
    from ggufspec.tinymodels_mtp import ARCH, make_mtp_model
    model = make_mtp_model(tmp_path, seed=0, shape=SHAPE)
    adapter = write_lora(tmp_path / "mtp-lora.gguf", SHAPE, seed=1, arch=ARCH, n_blocks=SHAPE.n_layer + 1)

    def drafts(chosen) -> list[tuple]:
        with SpeculativeDecoder(model, "mtp", n_ctx=N_CTX, n_threads=1, strict=True, lora=[adapter]) as decoder:
            seen = []
            for prompt in chosen:
                alone = decoder.generate(prompt, n_predict=24, n_draft=0, temperature=0).tokens
                for k in (1, 3, "auto"):
                    got = decoder.generate(prompt, n_predict=24, n_draft=k, temperature=0)
                    assert got.tokens == alone, f"MTP K={k}: first difference at {first_difference(got.tokens, alone)}"
                    if k != "auto":  # auto's K follows timings: only fixed K's drafts compare across runs
                        seen.append((got.stats.n_drafted, got.stats.n_accept))
            return seen
    chosen = prompts(4, seed=3)
    with_adapter = drafts(chosen)
    assert sum(accepted for _, accepted in with_adapter) > 0
    monkeypatch.setattr(mtp, "set_lora", lambda ctx, adapters: None)  # an MTP context left without it
    assert drafts(chosen) != with_adapter


def test_the_python_api_sets_other_scales_on_a_loaded_decoder(tiny_pair, adapters):
    """`slots.set_lora`: the text is then a decoder's loaded with those scales (the same prompts again:
    nothing cached under the old ones is reused)."""
    target, draft = tiny_pair
    chosen = prompts(3, seed=17)

    def greedy(decoder) -> list:
        return [decoder.generate(prompt, n_predict=24, n_draft=3, temperature=0).tokens for prompt in chosen]
    with SpeculativeDecoder(target, draft, n_ctx=N_CTX, n_threads=1, strict=True, lora=[(adapters["one"], 0.5)]) as half:
        at_half = greedy(half)
    with SpeculativeDecoder(target, draft, n_ctx=N_CTX, n_threads=1, strict=True, lora=[adapters["one"]]) as decoder:
        assert greedy(decoder) != at_half
        decoder.slots.set_lora([0.5])
        assert [a.scale for a in adapters_of(decoder.target_llm)] == [0.5]
        assert greedy(decoder) == at_half
        with pytest.raises(GgufspecError, match="^2 LoRA scales for 1 adapters$"):
            decoder.slots.set_lora([0.5, 1.0])


def test_other_scales_reach_the_mtp_heads_context_too(tmp_path):
    """A generation under other scales (a server request's `lora`) sets them on the MTP head's context
    as well: its drafts are those of a decoder loaded with those scales."""
    from ggufspec.tinymodels_mtp import ARCH, make_mtp_model
    model = make_mtp_model(tmp_path, seed=0, shape=SHAPE)
    adapter = write_lora(tmp_path / "mtp-lora.gguf", SHAPE, seed=1, arch=ARCH, n_blocks=SHAPE.n_layer + 1)

    def generated(scale, asked=None) -> list[tuple]:
        with SpeculativeDecoder(model, "mtp", n_ctx=N_CTX, n_threads=1, strict=True, lora=[(adapter, scale)]) as decoder:
            seen = []
            for prompt in prompts(3, seed=5):
                tokens = decoder.tokenize(prompt)
                with decoder.slots.use(tokens, lora=asked) as view:
                    got = view.generate(tokens, n_predict=24, n_draft=3, temperature=0)
                seen.append((got.tokens, got.stats.n_drafted, got.stats.n_accept))
            return seen
    at_half = generated(0.5)
    assert generated(1.0) != at_half
    assert generated(1.0, asked=(0.5,)) == at_half


# ---------------------------------------------------------------- sampling: chi-square

PROMPT = [1, 261, 262, 263]
DRAWS = 600


def test_sampling_with_the_adapter_is_the_adapted_targets_distribution(tiny_pair, adapters, decoders):
    params = SamplingParams(temperature=1.5, top_k=4, top_p=1.0, min_p=0.0)
    p1, x, joint = exact_first_and_next_two(tiny_pair[0], PROMPT, params, lora_path=str(adapters["one"]))
    samples = draw_samples(decoders["batch"], PROMPT, params, 3, DRAWS)
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3
    plain_p1, plain_x, plain_joint = exact_first_and_next_two(tiny_pair[0], PROMPT, params)
    assert min(sampling_pvalues(samples, plain_p1, plain_x, plain_joint)) < 1e-6  # the test tells them apart


# ---------------------------------------------------------------- scale 0 is no adapter

def test_scale_zero_is_no_adapter(tiny_pair, adapters, tiny_decoder):
    with SpeculativeDecoder(tiny_pair[0], None, n_ctx=N_CTX, n_threads=1, lora=[(adapters["one"], 0.0)]) as zero:
        for prompt in prompts(3, seed=17):
            expected = tiny_decoder.generate(prompt, n_predict=24, n_draft=0, temperature=0).tokens
            assert zero.generate(prompt, n_predict=24, n_draft=0, temperature=0).tokens == expected
        zero.target.keep(0)
        zero.target.decode(PROMPT)
        tiny_decoder.target.keep(0)
        tiny_decoder.target.decode(PROMPT)
        assert np.array_equal(zero.target.logits(0), tiny_decoder.target.logits(0))  # bit for bit


# ---------------------------------------------------------------- the command line

def run(tiny_pair, *flags):
    target, draft = tiny_pair
    return CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-c", str(N_CTX), "-t", "1", "-n", "16",
                                     "--temp", "0", "--json", "-p", "the cat sat", *flags], input="")


def tokens_of(result) -> list[int]:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


def test_run_with_lora_is_the_adapted_target_alone(tiny_pair, adapters):
    one, two = adapters["one"], adapters["two"]
    alone = tokens_of(run(tiny_pair, "--strict", "--no-draft", "--lora", str(one)))
    assert alone != tokens_of(run(tiny_pair, "--strict", "--no-draft"))
    assert tokens_of(run(tiny_pair, "--strict", "--draft", "3", "--lora", str(one))) == alone
    assert tokens_of(run(tiny_pair, "--strict", "--no-draft", "--lora-scaled", f"{one}:1")) == alone
    # several at once, llama.cpp's ways: a comma-separated list, the flag repeated; scale 0 leaves one out
    assert tokens_of(run(tiny_pair, "--strict", "--no-draft", "--lora-scaled", f"{one}:1,{two}:0")) == alone
    both = tokens_of(run(tiny_pair, "--strict", "--no-draft", "--lora", f"{one},{two}"))
    assert both != alone
    assert tokens_of(run(tiny_pair, "--strict", "--draft", "auto", "--lora", str(one), "--lora", str(two))) == both


BAD = [
    (["--lora", "missing.gguf"], "LoRA adapter not found: missing.gguf"),
    (["--lora", "NOTGGUF"], "is not a GGUF file"),
    (["--lora", "MODEL"], "is not a LoRA adapter: its general.type is missing"),
    (["--lora", "OTHER"], "tensor 'blk.0.attn_q.weight' has incorrect shape (hint: maybe wrong base model?)"),
    (["--lora-scaled", "ONE:abc"], "the scale 'abc' is not a number"),
    (["--lora-scaled", "ONE:inf"], "the scale must be a finite number"),
    (["--lora-scaled", "ONE", "0.5"], "--lora-scaled takes FNAME:SCALE in one argument"),  # no two-argument form
    (["--lora", "ONE,"], "an empty file name"),
]


@pytest.mark.parametrize("flags, says", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_bad_adapters_are_one_line(tiny_pair, adapters, tmp_path, flags, says):
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model\n")
    names = {"ONE": str(adapters["one"]), "OTHER": str(adapters["other"]), "MODEL": str(tiny_pair[1]),
             "NOTGGUF": str(not_gguf)}
    result = run(tiny_pair, *[next((flag.replace(k, v) for k, v in names.items() if k in flag), flag) for flag in flags])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith("ggufspec: error:") and "\n" not in line and says in line, result.stderr


@pytest.mark.skipif(b"LLAMAFILE = 1" not in llama_cpp.llama_print_system_info(), reason="a build without llamafile")
def test_exact_with_an_adapter_is_refused_for_strict(tiny_pair, adapters):
    result = run(tiny_pair, "--exact", "--lora", str(adapters["one"]))
    assert result.exit_code == 2 and "use --strict" in result.stderr, result.output


@pytest.mark.parametrize("command", [["run"], ["chat"], ["serve"], ["bench"], ["eval", "humaneval"]])
def test_every_command_that_loads_a_target_takes_the_flags(command):
    shown = CliRunner().invoke(main, [*command, "--help"]).output
    assert "--lora FNAME" in shown and "--lora-scaled FNAME:SCALE" in shown


def test_the_python_api_refuses_bad_adapters_in_one_line(tiny_pair, adapters):
    target = tiny_pair[0]
    for lora, says in (([(adapters["one"], "1")], "the scale must be a finite number"),
                       ([(adapters["one"], 1.0, 2)], "a path or a (path, scale) pair")):
        with pytest.raises(GgufspecError, match=re.escape(says)):
            SpeculativeDecoder(target, None, n_ctx=64, n_threads=1, lora=lora)
    llm = llama_cpp.Llama(model_path=str(target), n_ctx=64, n_threads=1, verbose=False)
    try:
        with pytest.raises(GgufspecError, match="give its path, not a Llama"):
            SpeculativeDecoder(llm, None, lora=[adapters["one"]])
    finally:
        llm.close()


def test_bench_races_llamacpps_tools_with_the_same_adapters(decoders, adapters, tmp_path):
    from ggufspec import bench
    from test_bench import fake_build, option
    binary = fake_build(tmp_path / "bin")
    bench.run_bench(decoders["batch"], [{"id": "p", "prompt": "the cat"}],
                    bench.parse_configs("2", against_llamacpp=str(binary)), n_predict=4, llamacpp=str(binary),
                    n_threads=1, flash_attn="off")
    for tool in ("speculative", "completion"):
        args = (tmp_path / "bin" / f"{tool}.args").read_text().splitlines()
        assert option(args, "--lora-scaled") == f"{adapters['one']}:1.0", tool


# ---------------------------------------------------------------- serve

def test_the_system_fingerprint_follows_the_adapters(tiny_pair, adapters):
    props = pytest.importorskip("ggufspec.server.props")

    def fingerprint(**options):
        with SpeculativeDecoder(tiny_pair[0], None, n_ctx=64, n_threads=1, **options) as decoder:
            return props.system_fingerprint(decoder)
    adapted = fingerprint(lora=[adapters["one"]])
    assert adapted == fingerprint(lora=[adapters["one"]])
    assert adapted not in (fingerprint(), fingerprint(lora=[(adapters["one"], 0.5)]))
    with SpeculativeDecoder(tiny_pair[0], None, n_ctx=64, n_threads=1, lora=[adapters["one"]]) as decoder:
        # an answer under other scales (a request's `lora`): the fingerprint of a server started with them
        assert props.system_fingerprint(decoder, lora=(0.5,)) == fingerprint(lora=[(adapters["one"], 0.5)])
        assert props.system_fingerprint(decoder, lora=(1.0,)) == adapted


KEY = "sesame"


def test_serve_lists_the_adapters_behind_the_key_and_answers_as_run(tiny_pair, adapters, tmp_path):
    target, draft = tiny_pair
    one, two = str(adapters["one"]), str(adapters["two"])
    flags = ["--strict", "--lora", one, "--lora-scaled", f"{two}:0.5"]
    expected = tokens_of(run(tiny_pair, *flags, "--no-draft"))
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", str(N_CTX), "-np", "2", "--api-key", KEY,
                 *flags) as server:
        keyed = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(server.url + "/lora-adapters", timeout=10).status_code == 401
        listed = httpx.get(server.url + "/lora-adapters", headers=keyed, timeout=10)
        assert listed.status_code == 200 and listed.json() == [
            {"id": 0, "path": one, "scale": 1.0, "task_name": "", "prompt_prefix": ""},
            {"id": 1, "path": two, "scale": 0.5, "task_name": "tiny-task", "prompt_prefix": ""}]

        def complete(**extra):
            body = {"prompt": "the cat sat", "n_predict": 16, "temperature": 0, "draft": 3, "return_tokens": True, **extra}
            return httpx.post(server.url + "/completion", json=body, headers=keyed, timeout=60)
        assert complete().json()["tokens"] == expected
        same = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]
        assert complete(lora=same).json()["tokens"] == expected
        assert httpx.post(server.url + "/lora-adapters", json=same, headers=keyed, timeout=10).json() == {"success": True}
        for refused, says in ((complete(lora=[{"id": 7, "scale": 1}]), "lora: no LoRA adapter has id 7"),
                              (httpx.post(server.url + "/lora-adapters", json=[{"id": 0, "scale": "high"}],
                                          headers=keyed, timeout=10), "body: the scale of adapter 0 must be"),
                              (httpx.post(server.url + "/lora-adapters", json={"id": 0}, headers=keyed, timeout=10),
                               'body must be a list of {"id": N, "scale": S} objects')):
            assert refused.status_code == 400, refused.text
            message = refused.json()["error"]["message"]
            assert message.startswith(says) and "\n" not in message, message


# each request's scales as llama-server's `lora` field gives them; None: the server's (as POST set them last)
ASKED = {"both": None, "one": [{"id": 0, "scale": 1.0}], "two": [{"id": 1, "scale": 0.5}], "none": []}
STRONG = [{"id": 0, "scale": 4.0}, {"id": 1, "scale": -4.0}]  # cells computed under it differ the most


def test_each_request_runs_under_its_own_lora_scales_and_post_sets_the_default(tiny_pair, adapters, tmp_path):
    """A request's `lora` and POST /lora-adapters (llama-server's): each answer is `run`'s with those scales
    alone, one after another on the same prompt (no cell cached under other scales is reused) and four at
    once in two slots (generations under other scales wait until the slots are free, then the scales change)."""
    target, draft = tiny_pair
    one, two = str(adapters["one"]), str(adapters["two"])
    started = ["--lora", one, "--lora-scaled", f"{two}:0.5"]
    alone = {"both": started, "one": ["--lora", one], "two": ["--lora-scaled", f"{two}:0.5"], "none": []}
    expected = {name: tokens_of(run(tiny_pair, "--strict", "--no-draft", *flags)) for name, flags in alone.items()}
    assert len({tuple(tokens) for tokens in expected.values()}) == 4  # four different texts
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", str(N_CTX), "-np", "2", "--strict",
                 *started) as server:
        def complete(name):
            body = {"prompt": "the cat sat", "n_predict": 16, "temperature": 0, "draft": 3, "return_tokens": True}
            if name is not None and ASKED[name] is not None:
                body["lora"] = ASKED[name]
            answer = httpx.post(server.url + "/completion", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            return answer.json()["tokens"]
        order = ["one", "both", "two", "none", "both", "one", "one"]
        assert [complete(name) for name in order] == [expected[name] for name in order]
        with ThreadPoolExecutor(4) as pool:
            order = ["one", "two", "both", "none", "two", "both", "one", "none"]
            assert list(pool.map(complete, order)) == [expected[name] for name in order]
        posted = httpx.post(server.url + "/lora-adapters", json=ASKED["one"], timeout=10)
        assert posted.json() == {"success": True}
        assert [a["scale"] for a in httpx.get(server.url + "/lora-adapters", timeout=10).json()] == [1.0, 0.0]
        assert complete(None) == expected["one"]  # a request without `lora`: the scales posted
        assert complete("two") == expected["two"]
        answer = httpx.post(server.url + "/completion", json={"prompt": "the cat", "n_predict": 2, "lora": ASKED["two"]},
                            timeout=60).json()
        assert answer["generation_settings"]["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]


def test_lora_init_without_apply_serves_without_the_adapters_until_post_sets_them(tiny_pair, adapters, tmp_path):
    target, draft = tiny_pair
    one = str(adapters["one"])
    bare, adapted = (tokens_of(run(tiny_pair, "--strict", "--no-draft", *flags)) for flags in ([], ["--lora", one]))
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", str(N_CTX), "--strict", "--lora", one,
                 "--lora-init-without-apply") as server:
        def complete(**extra):
            body = {"prompt": "the cat sat", "n_predict": 16, "temperature": 0, "return_tokens": True, **extra}
            return httpx.post(server.url + "/completion", json=body, timeout=60).json()["tokens"]
        assert [a["scale"] for a in httpx.get(server.url + "/lora-adapters", timeout=10).json()] == [0.0]
        assert complete() == bare
        assert complete(lora=[{"id": 0, "scale": 1.0}]) == adapted
        def fingerprints():  # /props's, and an answer's to a request without `lora`
            answer = httpx.post(server.url + "/v1/completions", json={"prompt": "the", "max_tokens": 1}, timeout=60)
            return httpx.get(server.url + "/props", timeout=10).json()["system_fingerprint"], \
                answer.json()["system_fingerprint"]
        bare_prints = fingerprints()
        assert httpx.post(server.url + "/lora-adapters", json=[{"id": 0, "scale": 1}], timeout=10).status_code == 200
        assert complete() == adapted
        adapted_prints = fingerprints()  # /props's follows the scales posted, as the answers' do
        slots = httpx.get(server.url + "/slots", timeout=10).json()
        assert slots and all(slot["lora"] == [{"id": 0, "scale": 1.0}] for slot in slots)
        assert bare_prints[0] == bare_prints[1] != adapted_prints[0] == adapted_prints[1]


def test_in_the_unified_cache_no_prompt_is_reused_across_scales(tiny_pair, adapters, tmp_path):
    """Batch verification, one cache shared by three slots (prefixes shared between them): after each change
    of scales the prompt is evaluated whole (every cell computed under the old ones dropped, in every slot),
    under the same scales again it is cached, and each answer is the one those scales gave before."""
    target, draft = tiny_pair
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", str(3 * N_CTX), "-np", "3", "--lora",
                 str(adapters["one"]), "--lora-scaled", f"{adapters['two']}:0.5") as server:
        asked = {**ASKED, "strong": STRONG}

        def complete(name):
            body = {"prompt": "the cat sat on", "n_predict": 16, "temperature": 0, "draft": 3, "return_tokens": True}
            if asked[name] is not None:
                body["lora"] = asked[name]
            return httpx.post(server.url + "/completion", json=body, timeout=60).json()
        first = {name: complete(name) for name in asked}
        assert len({tuple(answer["tokens"]) for answer in first.values()}) == len(asked)
        before = "strong"
        for name in ("one", "strong", "both", "both", "strong", "two", "none", "strong", "one", "none", "none"):
            again = complete(name)
            assert again["tokens"] == first[name]["tokens"], name
            # after a change the prompt is evaluated whole; under the same scales again, all but its last token cached
            assert again["timings"]["cache_n"] == (0 if name != before else again["tokens_evaluated"] - 1), name
            before = name
