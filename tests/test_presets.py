"""llama.cpp's preset flags (--fim-qwen-7b-spec, --gpt-oss-20b-default, --spec-default...) on serve, run
and chat: each is the ggufspec flags it amounts to (the models by -hf/-hff/-hfd, then -c, -b, -ub,
--port, -np, the sampling defaults), a flag given winning over the preset's value; the presets ggufspec
has no use for (images, embeddings), two model presets, a preset with another model and a preset of
llama-server's on run or chat are one line each. The models come from a Hugging Face-compatible server
on 127.0.0.1 holding the tiny pair under the presets' own repository and file names."""
import json

import httpx
import pytest
from click.testing import CliRunner

from clierrors import one_line_error
from ggufspec.cli import main
from ggufspec.cli.hub_flags import apply_hub_flags
from ggufspec.cli.presets import PRESETS, apply_presets, explicit_params
from serverproc import serving

CODER_7B = ("ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF", "qwen2.5-coder-7b-q8_0.gguf")
CODER_05B = ("ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF", "qwen2.5-coder-0.5b-q8_0.gguf")
GPT_OSS_20B = ("ggml-org/gpt-oss-20b-GGUF", "gpt-oss-20b-mxfp4.gguf")
SHOWN = ("model", "model_draft", "port", "parallel", "n_ctx", "n_batch", "n_ubatch", "temperature", "top_p", "top_k",
         "min_p", "spec_type", "alias")


pytestmark = pytest.mark.usefixtures("hub_settings_restored")


@pytest.fixture
def hub_files(tiny_pair):
    """What conftest's `hub` holds: the tiny pair under the presets' own repository and file names."""
    target, draft = (path.read_bytes() for path in tiny_pair)
    return {CODER_7B: target, CODER_05B: draft, GPT_OSS_20B: target}


def resolved(command: str, *args: str) -> dict:
    """The options `command ARGS` runs with once its presets and download flags are applied (nothing
    loaded, no port bound): those of SHOWN, where the command has them."""
    ctx = main.commands[command].make_context(command, list(args))
    with ctx:
        opts = dict(ctx.params)
        apply_presets(opts, command, explicit_params(ctx))
        apply_hub_flags(opts)
    return {name: opts[name] for name in SHOWN if name in opts}


def hf(repo_file: tuple[str, str]) -> str:
    return "hf://{}/{}".format(*repo_file)


# ---------------------------------------------------------------- what each preset amounts to

def test_a_fim_preset_is_its_model_its_batch_its_context_and_its_port():
    got = resolved("serve", "--fim-qwen-1.5b-default")
    repo = "ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF"
    assert got == {**resolved("serve"), "model": f"hf://{repo}/qwen2.5-coder-1.5b-q8_0.gguf", "alias": repo,
                   "port": 8012, "n_batch": 1024, "n_ubatch": 1024, "n_ctx": 0}


def test_a_spec_preset_names_the_draft_in_its_repository():
    got = resolved("serve", "--fim-qwen-7b-spec")
    assert (got["model"], got["model_draft"], got["port"]) == (hf(CODER_7B), hf(CODER_05B), 8012)


def test_flags_given_win_wherever_they_stand():
    before = resolved("serve", "--port", "0", "-c", "512", "-ub", "64", "--fim-qwen-7b-default")
    after = resolved("serve", "--fim-qwen-7b-default", "--port", "0", "-c", "512", "-ub", "64")
    assert before == after
    assert (after["port"], after["n_ctx"], after["n_ubatch"], after["n_batch"]) == (0, 512, 64, 1024)
    sampled = resolved("run", "--gpt-oss-20b-default", "--temp", "0.5", "--top-k", "40")
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (0.5, 40, 1.0, 0.01)
    given_default = resolved("serve", "--fim-qwen-7b-default", "--port", "8080")  # given, even at the default
    assert given_default["port"] == 8080


def test_gpt_oss_is_two_slots_on_serve_and_one_sequences_share_on_run_and_chat():
    served = resolved("serve", "--gpt-oss-20b-default")
    assert {k: served[k] for k in ("port", "parallel", "n_ctx", "n_batch", "n_ubatch", "temperature", "top_p", "top_k",
                                   "min_p")} == {"port": 8013, "parallel": 2, "n_ctx": 262144, "n_batch": 32768,
                                                 "n_ubatch": 2048, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                 "min_p": 0.01}
    for command in ("run", "chat"):
        got = resolved(command, "--gpt-oss-120b-default")
        assert (got["model"], got["n_ctx"], "port" in got) == ("hf://ggml-org/gpt-oss-120b-GGUF", 131072, False)


@pytest.mark.parametrize("flags, draft", [
    ([], hf(CODER_05B)),
    (["-md", "mine.gguf"], "mine.gguf"),                           # the draft given wins
    (["-hfd", "org/other-GGUF"], "hf://org/other-GGUF"),
    (["-hfd", "org/other-GGUF", "-md", "d.gguf"], "hf://org/other-GGUF/d.gguf"),
    (["--no-draft"], None),                                         # no draft model wanted: none fetched
    (["--lookup"], None),
    (["--spec-type", "draft-mtp"], None),                           # -md mtp, set by --spec-type itself
    (["--spec-type", "draft-simple,ngram-mod"], hf(CODER_05B)),
])
def test_a_spec_presets_draft_gives_way_to_the_drafting_given(flags, draft):
    assert resolved("serve", "--fim-qwen-14b-spec", *flags)["model_draft"] == draft


@pytest.mark.parametrize("flags, spec_type", [
    ([], "ngram-mod"),
    (["-md", "d.gguf"], "draft-simple,ngram-mod"),                  # a draft model and n-grams: --hybrid
    (["--fim-qwen-7b-spec"], "draft-simple,ngram-mod"),
    (["--fim-qwen-7b-default"], "ngram-mod"),
    (["--spec-type", "draft-simple"], "draft-simple,ngram-mod"),    # llama.cpp's --spec-type adds to the list
    (["--spec-type", "ngram-cache"], "ngram-cache"),
    (["--spec-type", "none"], "none"),                              # the drafting given wins
    (["--no-draft"], None),
    (["--lookup"], None),
    (["--hybrid"], None),
])
def test_spec_default_is_ngram_mod_as_spec_type_takes_it(flags, spec_type):
    model = [] if any(flag.startswith("--fim") for flag in flags) else ["-m", "t.gguf"]
    assert resolved("serve", "--spec-default", *model, *flags)["spec_type"] == spec_type


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.target and not p.refused], ids=lambda p: p.flag)
def test_every_preset_names_its_models_as_the_download_flags_take_them(preset):
    for command in preset.commands:
        got = resolved(command, preset.flag)
        assert got["model"].startswith(f"hf://{preset.target[0]}")
        assert (got["model_draft"] is not None) == (preset.draft is not None)


# ---------------------------------------------------------------- the models fetched, and generating

def run(*flags):
    return CliRunner().invoke(main, ["run", "-n", "8", "-t", "1", "--json", "-p", "the cat", *flags])


def test_run_gpt_oss_fetches_its_file_and_generates_the_targets_text(hub, tiny_pair):
    preset = run("--gpt-oss-20b-default", "-c", "256", "--temp", "0", "--no-draft")
    assert preset.exit_code == 0, preset.output
    fetched = [path for _, path, _ in hub.state.requests if "/resolve/" in path]
    assert fetched and all(GPT_OSS_20B[1] in path for path in fetched)
    alone = run("-m", str(tiny_pair[0]), "-c", "256", "--temp", "0", "--no-draft")
    assert json.loads(preset.stdout)["tokens"] == json.loads(alone.stdout)["tokens"] != []


def test_serve_spec_preset_fetches_target_and_draft_and_serves_with_its_settings(hub, tmp_path, tiny_pair):
    alone = json.loads(run("-m", str(tiny_pair[0]), "-n", "6", "-c", "256", "--temp", "0", "--no-draft").stdout)
    with serving(tmp_path, "--fim-qwen-7b-spec", "--no-warmup") as server:  # --port 0 given: it wins over 8012
        props = httpx.get(server.url + "/props", timeout=10).json()
        assert props["model"] == CODER_7B[0]
        assert (props["target"]["file"], props["draft"]["file"]) == (CODER_7B[1], CODER_05B[1])
        assert props["n_ctx"] == 2048  # -c 0: the tiny model's own
        assert (props["target"]["load"]["n_batch"], props["target"]["load"]["n_ubatch"]) == (1024, 1024)
        answer = server.client().completions.create(model=CODER_7B[0], prompt="the cat", max_tokens=6, temperature=0)
        assert answer.choices[0].text == alone["text"] != ""  # speculative with the preset's draft: the target's text
    fetched = {path.rsplit("/", 1)[-1] for _, path, _ in hub.state.requests if "/resolve/" in path}
    assert fetched == {CODER_7B[1], CODER_05B[1]}


# ---------------------------------------------------------------- refused, in one line

@pytest.mark.parametrize("args, words", [
    (["serve", "--vision-gemma-4b-default"], ["--vision-gemma-4b-default is not supported", "text models",
                                              "-hf ggml-org/gemma-3-4b-it-qat-GGUF"]),
    (["chat", "--vision-gemma-12b-default"], ["--vision-gemma-12b-default is not supported", "images"]),
    (["serve", "--embd-gemma-default"], ["--embd-gemma-default is not supported", "embeddings"]),
    (["run", "--fim-qwen-7b-spec"], ["llama-server's preset", "ggufspec serve", f"-hfd {CODER_05B[0]}"]),
    (["chat", "--fim-qwen-1.5b-default"], ["llama-server's preset"]),
    (["serve", "--fim-qwen-7b-default", "--gpt-oss-20b-default"], ["--fim-qwen-7b-default and --gpt-oss-20b-default",
                                                                   "one preset"]),
    (["serve", "--fim-qwen-7b-default", "-m", "x.gguf"], ["names the target model", "-m another", "-c 0"]),
    (["run", "--gpt-oss-20b-default", "-hf", "org/x-GGUF"], ["-hf another", "give one of them"]),
    (["run", "--gpt-oss-20b-default", "-hff", "x.gguf"], ["-hff another"]),
    (["serve", "--fim-qwen-3b-default", "-mu", "http://127.0.0.1:1/a.gguf"], ["-mu another"]),
    (["serve", "tiny", "--fim-qwen-3b-default"], ["PAIR another"]),
])
def test_what_a_preset_cannot_be_is_one_line(args, words):
    one_line_error(CliRunner().invoke(main, args, input=""), *words)


def test_help_lists_the_presets_each_command_has():
    usable = [p.flag for p in PRESETS if not p.refused]
    refused = [p.flag for p in PRESETS if p.refused]
    served = CliRunner().invoke(main, ["serve", "--help"], terminal_width=400).output
    assert all(flag in served for flag in usable) and not any(flag in served for flag in refused)
    assert "--port 8012" in served and "--cache-reuse 256 left out" in served and "flags given win" in served
    assert "ngram-mod sizes are not ggufspec's knobs" in served
    for command in ("run", "chat"):
        shown = CliRunner().invoke(main, [command, "--help"], terminal_width=400).output
        assert [flag for flag in usable if flag in shown] == ["--gpt-oss-20b-default", "--gpt-oss-120b-default",
                                                              "--spec-default"]
        line = next(line for line in shown.splitlines() if "--gpt-oss-20b-default" in line)
        assert "-c 131072" in line and "--port" not in line
