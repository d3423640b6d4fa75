"""Drafting with the target's own MTP block (no second model): lossless like any drafter (greedy identity with
the target alone for K = 1..5 and auto, sampling by chi-square), and the MTP head agrees with the target often.

The decoders are built as `--draft-model mtp` will build them: the target loaded with its MTP blocks
(LoadParams(load_mtp=True)), `open_mtp(decoder.target)` as the draft context, `MtpDrafter` as the drafter."""
import re
import subprocess
from pathlib import Path

import llama_cpp
import pytest

from ggufspec import SpeculativeDecoder, speculate
from ggufspec.errors import ModelFileError
from ggufspec.load import LoadParams, open_model
from ggufspec.mtp import MtpDrafter, gguf_has_mtp, has_mtp, open_mtp
from ggufspec.sampling import SamplingParams
from ggufspec.tinymodels import Shape
from ggufspec.tinymodels_mtp import make_mtp_model, make_qwen35_model, make_trunk_only
from reference import (NEAR_TIE, draw_samples, exact_first_and_next_two, prompts, sampling_pvalues,
                       same_as_target_alone, target_alone)

PROMPT = [1, 261, 262, 263]
DRAWS = 3000
LLAMACPP_SPECULATIVE = Path(__file__).parent.parent / "third_party" / "llama.cpp" / "build" / "bin" / "llama-speculative-simple"


@pytest.fixture(scope="module", params=["hy_v3", "qwen35"])
def mtp_model(request, tmp_path_factory):
    """HY V3 (a plain KV cache) and Qwen3.5 (hybrid: the target rolls back by snapshots and replays)."""
    directory = tmp_path_factory.mktemp("mtp")
    if request.param == "qwen35":
        return make_qwen35_model(directory, seed=0, shape=Shape(n_layer=3, eos_bias=4.0))
    return make_mtp_model(directory, seed=0, shape=Shape(eos_bias=4.0))


class MtpDecoder:
    """A SpeculativeDecoder over a target loaded with its MTP blocks, drafting with them."""

    def __init__(self, path, n_ctx, n_batch=512, flash_attn="off"):
        self.llm = open_model(path, "target", LoadParams(n_ctx=n_ctx, n_threads=1, n_batch=n_batch,
                                                         flash_attn=flash_attn, load_mtp=True))
        self.decoder = SpeculativeDecoder(self.llm, None, n_threads=1, flash_attn=flash_attn)
        self.decoder.draft = open_mtp(self.decoder.target)  # as SpeculativeDecoder(path, "mtp") does, with n_batch

    def __enter__(self):
        return self.decoder

    def __exit__(self, *exc):
        self.decoder.close()  # frees the MTP context before the model it runs on
        self.llm.close()


@pytest.fixture(scope="module")
def decoders(mtp_model):
    """Roomy; tight (generation stops at the context's end); small batches (prompts in chunks)."""
    with MtpDecoder(mtp_model, 256) as roomy, MtpDecoder(mtp_model, 64) as tight, \
            MtpDecoder(mtp_model, 256, n_batch=8) as chunked:
        yield {"roomy": roomy, "tight": tight, "chunked": chunked}


def test_the_file_says_whether_it_has_mtp_blocks(mtp_model, tiny_pair, tmp_path):
    assert gguf_has_mtp(mtp_model)
    assert not gguf_has_mtp(make_trunk_only(tmp_path))
    assert not gguf_has_mtp(tiny_pair[0])  # llama: no MTP blocks


def test_no_mtp_context_without_mtp_blocks_loaded(mtp_model, tmp_path):
    """Loaded without load_mtp, llama.cpp would abort on an MTP context: refused with one line instead."""
    for path, load_mtp in ((mtp_model, False), (make_trunk_only(tmp_path), True)):
        llm = open_model(path, "target", LoadParams(n_ctx=64, n_threads=1, load_mtp=load_mtp))
        try:
            assert not has_mtp(llm)
            with SpeculativeDecoder(llm, None, n_threads=1) as decoder, pytest.raises(ModelFileError, match="no MTP"):
                open_mtp(decoder.target)
        finally:
            llm.close()


@pytest.mark.parametrize("kind", ["roomy", "tight", "chunked"])
def test_greedy_equals_target_alone_for_every_k_and_auto(mtp_model, decoders, kind):
    decoder = decoders[kind]
    n_predict = -1 if kind == "tight" else 48
    near_ties, checked, reasons, accepted = 0, 0, set(), 0
    for prompt in prompts(8) + ([list(range(259, 281)) * 2] if kind == "chunked" else []):
        expected, margins, reason = target_alone(mtp_model, prompt, n_predict if n_predict > 0 else 10**6, decoder.n_ctx)
        for n_draft in (1, 2, 3, 4, 5, "auto"):
            got = decoder.generate(prompt, n_predict=n_predict, n_draft=n_draft, temperature=0)
            if not same_as_target_alone(got, expected, margins, f"{kind} K={n_draft} prompt={prompt}"):
                near_ties += 1  # reported, not failed: see NEAR_TIE
                continue
            assert got.stats.stop_reason == reason
            reasons.add(reason)
            accepted += got.stats.n_accept
            checked += 1
    print(f"{kind}: {checked} runs identical, {near_ties} skipped at a near-tie < {NEAR_TIE}")
    assert near_ties <= checked // 10
    assert reasons >= ({"context"} if kind == "tight" else {"n_predict"})
    assert accepted > 0


def test_the_mtp_head_agrees_often(decoders):
    """A copy of the target's first layer reading the token: a one-layer draft of the target."""
    stats = [decoders["roomy"].generate(p, n_predict=48, n_draft=3, temperature=0).stats for p in prompts(6, seed=4)]
    drafted, accepted = sum(s.n_drafted for s in stats), sum(s.n_accept for s in stats)
    print(f"MTP acceptance at K=3: {accepted}/{drafted}")
    assert accepted > 0.3 * drafted


def test_a_cached_mtp_context_drafts_as_a_fresh_one(mtp_model, decoders):
    """After generations that share, cut and reuse prefixes, the MTP proposes what a new one does on
    the same tokens: its entries hold the target's hidden states for the tokens it holds."""
    decoder = decoders["roomy"]
    base = [1, 260, 261, 262, 263, 264]
    for prompt in (base, base + [270, 271], base[:4] + [275], base + [270]):
        decoder.generate(prompt, n_predict=12, n_draft=4, temperature=0)
    sequence = base + [270, 271, 272]
    params = SamplingParams(temperature=0)
    with MtpDecoder(mtp_model, 256) as fresh:
        for dec in (decoder, fresh):  # both contexts as a prefill leaves them (speculate._prefill)
            dec.target.reuse_prefix(sequence[:-1])
            dec.target.decode(sequence[dec.target.n_past:-1], n_logits=0)
            dec.draft.reuse_prefix(sequence[:-1])
        reused = MtpDrafter(decoder.draft).propose(sequence, 5, params, None)
        assert reused == MtpDrafter(fresh.draft).propose(sequence, 5, params, None)
    mtp = decoder.draft  # its drafted entries read its own states: kept by no cut, even when accepted
    assert (mtp.n_true, mtp.n_past) == (len(sequence), len(sequence) + 4)
    mtp.keep(len(sequence) + 3)
    assert mtp.n_past == mtp.n_true == len(sequence)


@pytest.mark.parametrize("k", [1, 3])
def test_sampling_matches_the_target(mtp_model, decoders, k):
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    p1, x, joint = exact_first_and_next_two(mtp_model, PROMPT, params)
    samples = draw_samples(decoders["roomy"], PROMPT, params, k, DRAWS)
    assert min(sampling_pvalues(samples, p1, x, joint)) > 1e-3
    assert decoders["roomy"].last_stats.n_drafted > 0


def test_closing_the_mtp_context_leaves_the_target_alone(mtp_model):
    with MtpDecoder(mtp_model, 128) as decoder:
        prompt = prompts(1, seed=9)[0]
        expected, _, _ = target_alone(mtp_model, prompt, 24, decoder.n_ctx)
        assert decoder.generate(prompt, n_predict=24, n_draft=3, temperature=0).tokens == expected
        decoder.draft.close()
        decoder.draft = None
        assert "_decode_chunk" not in vars(decoder.target) or decoder.target._decode_chunk.__func__ is type(decoder.target)._decode_chunk
        got = decoder.generate(prompt, n_predict=24, n_draft=3, temperature=0)
        assert got.tokens == expected and got.stats.n_drafted == 0


@pytest.mark.skipif(not LLAMACPP_SPECULATIVE.exists(), reason="llama.cpp's tools are not built (scripts/build-llamacpp.sh)")
@pytest.mark.parametrize("k", [1, 3])
def test_llamacpp_drafts_the_same_with_its_mtp(mtp_model, decoders, k, monkeypatch):
    """llama.cpp's own MTP drafting (--spec-type draft-mtp) on the same file: the same output and,
    but for its last step (it stops past n_predict, ggufspec at it), the same drafts accepted.

    On the hybrid target ggufspec's re-evaluation after a rejection also decides the next token
    (llama-server's replay), which llama-speculative-simple does not do: with that off, the counts
    are llama.cpp's; with it on, the same text takes fewer verifications."""
    text = "the cat sat on the mat"
    hybrid = decoders["roomy"].target.rollback == "snapshot"
    if hybrid:
        with_replay = decoders["roomy"].generate(text, n_predict=48, n_draft=k, temperature=0)
        monkeypatch.setattr(speculate, "_replay_decides_one_more", lambda *args: False)
    run = subprocess.run([str(LLAMACPP_SPECULATIVE), "-m", str(mtp_model), "--spec-type", "draft-mtp",
                          "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "-p", text, "-n", "48",
                          "--temp", "0", "-t", "1", "-c", "256"], capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-2000:]
    theirs = dict(re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", (run.stdout + run.stderr).decode(errors="replace")))
    marker = "\u2581mat".encode()  # it prints the prompt's tokens as stored, then the output
    printed = run.stdout[run.stdout.find(marker) + len(marker):]
    ours = decoders["roomy"].generate(text, n_predict=48, n_draft=k, temperature=0)
    our_bytes = b"".join(decoders["roomy"].target_llm.detokenize([t], special=True) for t in ours.tokens)  # as it prints
    assert printed[:len(our_bytes)] == our_bytes[:len(printed)]
    print(f"K={k}: llama.cpp drafted {theirs['n_drafted']}, accepted {theirs['n_accept']}; "
          f"ggufspec {ours.stats.n_drafted}, {ours.stats.n_accept}")
    assert 0 <= int(theirs["n_accept"]) - ours.stats.n_accept <= k + 1
    assert 0 <= int(theirs["n_drafted"]) - ours.stats.n_drafted <= 2 * k + 2
    if hybrid:
        assert with_replay.tokens == ours.tokens and with_replay.stats.n_steps < ours.stats.n_steps


# ---------------------------------------------------------------- as users reach it: the API's "mtp", -m alone, -md mtp

def test_the_api_drafts_with_mtp_by_name(mtp_model):
    prompt = prompts(1, seed=9)[0]
    with SpeculativeDecoder(str(mtp_model), "mtp", n_ctx=256, n_threads=1, flash_attn="off") as decoder:
        expected, margins, _ = target_alone(mtp_model, prompt, 32, decoder.n_ctx)
        for k in (3, "auto"):
            got = decoder.generate(prompt, n_predict=32, n_draft=k, temperature=0)
            same_as_target_alone(got, expected, margins, f"mtp K={k}")  # fails on a real difference
        assert decoder.generate(prompt, n_predict=32, n_draft=3).stats.n_drafted > 0


def test_m_alone_on_an_mtp_target_drafts_with_its_mtp_blocks(mtp_model, tiny_pair):
    import json
    from click.testing import CliRunner
    from ggufspec.cli import main
    args = ["run", "-p", "the cat sat", "-n", "16", "-c", "256", "-t", "1", "--draft", "3", "--temp", "0", "--json"]
    result = CliRunner().invoke(main, args + ["-m", str(mtp_model)])
    assert result.exit_code == 0, result.output
    assert "ggufspec: draft: the target's own MTP blocks" in result.stderr
    payload = json.loads(result.stdout)
    assert payload["draft_choice"]["kind"] == "mtp" and payload["stats"]["n_drafted"] > 0
    named = CliRunner().invoke(main, args + ["-m", str(mtp_model), "-md", "mtp"])
    assert named.exit_code == 0 and json.loads(named.stdout)["text"] == payload["text"]
    refused = CliRunner().invoke(main, args + ["-m", str(tiny_pair[0]), "-md", "mtp"])
    lines = [line for line in refused.output.splitlines() if line.strip()]
    assert refused.exit_code == 2 and len(lines) == 1 and "has no MTP (nextn) blocks" in lines[0], refused.output


def test_the_mtp_heads_cache_takes_the_drafts_cache_types(mtp_model):
    """-ctkd / -ctvd reach the MTP context (the draft's cache), and its drafts stay lossless."""
    prompt = prompts(1, seed=9)[0]
    flags = {"draft": {"type_k": "f32", "type_v": "f32"}}
    with SpeculativeDecoder(str(mtp_model), "mtp", n_ctx=256, n_threads=1, flash_attn="off", load_flags=flags) as decoder:
        params = decoder.draft.llm.context_params
        assert (params.type_k, params.type_v) == (0, 0)  # GGML_TYPE_F32
        expected, margins, _ = target_alone(mtp_model, prompt, 24, decoder.n_ctx)
        same_as_target_alone(decoder.generate(prompt, n_predict=24, n_draft=3, temperature=0), expected, margins, "f32")


def test_the_mtp_head_takes_the_targets_context_settings(mtp_model):
    """llama.cpp makes the MTP context from the target's params: -fa, -nkvo, --no-op-offload and --no-perf
    reach it as they reach the target, and its drafts stay lossless under them."""
    prompt = prompts(1, seed=9)[0]
    flags = {"target": {"offload_kqv": False, "op_offload": False, "no_perf": True}}
    with SpeculativeDecoder(str(mtp_model), "mtp", n_ctx=256, n_threads=1, flash_attn="on", load_flags=flags) as decoder:
        target, head = decoder.target.llm.context_params, decoder.draft.llm.context_params
        for name in ("flash_attn_type", "offload_kqv", "op_offload", "no_perf"):
            assert getattr(head, name) == getattr(target, name), name
        assert (head.flash_attn_type, head.offload_kqv, head.op_offload, head.no_perf) == \
            (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, False, False, True)
        expected, margins, _ = target_alone(mtp_model, prompt, 24, decoder.n_ctx, flash_attn="on", offload_kqv=False)
        got = decoder.generate(prompt, n_predict=24, n_draft=3, temperature=0)
        same_as_target_alone(got, expected, margins, "fa on, -nkvo")
        assert got.stats.n_drafted > 0
