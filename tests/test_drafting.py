"""Drafters and the K controller: lossless under every drafter; K=0 for a useless draft, large K for a perfect one."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder
from ggufspec.cli import main
from ggufspec.costs import Costs
from ggufspec.drafting import AdaptiveK, LookupDrafter
from ggufspec.sampling import SamplingParams
from reference import prompts, target_alone
from ggufspec.tinymodels import Shape, make_weights, write_model

COPY_PROMPT = [1] + [260, 261, 262, 263, 264, 265, 266, 267, 268, 269] * 3


def chosen_ks(decoder, prompt, **options):
    """The K the controller chose at each step, recorded by wrapping its choose()."""
    import ggufspec.drafting as drafting
    import ggufspec.speculate as speculate
    seen = []
    real = speculate.AdaptiveK

    class Recording(real):  # with a draft model, auto has two (lookup, model): both are recorded
        def choose(self, max_k):
            k = super().choose(max_k)
            seen.append(k)
            return k
    speculate.AdaptiveK = drafting.AdaptiveK = Recording
    try:
        out = decoder.generate(prompt, n_draft="auto", **options)
    finally:
        speculate.AdaptiveK = drafting.AdaptiveK = real
    return seen, out


@pytest.mark.parametrize("drafter, n_draft", [("model", "auto"), ("lookup", "auto"), ("hybrid", "auto"),
                                              ("lookup", 4), ("hybrid", 3), ("model", 2)])
def test_greedy_identical_under_every_drafter(tiny_pair, tiny_decoder, drafter, n_draft):
    for prompt in prompts(6, seed=3) + [COPY_PROMPT]:
        expected, _, _ = target_alone(tiny_pair[0], prompt, 40, tiny_decoder.n_ctx)
        got = tiny_decoder.generate(prompt, n_predict=40, n_draft=n_draft, drafter=drafter)
        assert got.tokens == expected, (drafter, n_draft, prompt)


def test_draft_p_min_gating_stays_lossless_and_drafts_less(tiny_pair, tiny_decoder):
    prompt = prompts(1, seed=5)[0]
    expected, _, _ = target_alone(tiny_pair[0], prompt, 40, tiny_decoder.n_ctx)
    plain = tiny_decoder.generate(prompt, n_predict=40, n_draft=6)
    gated = tiny_decoder.generate(prompt, n_predict=40, n_draft=6, draft_p_min=0.9)
    assert gated.tokens == expected == plain.tokens
    assert gated.stats.n_drafted < plain.stats.n_drafted


def test_lookup_finds_and_proposes_repeats():
    lookup = LookupDrafter(n_vocab=300)  # one per generation: its index only grows with the sequence
    tokens = [1, 5, 6, 7, 8, 9, 5, 6]
    assert lookup.match(tokens, 3) == [7, 8, 9]
    assert lookup.match(tokens + [7], 2) == [8, 9]
    assert LookupDrafter(n_vocab=300).match([1, 2, 3], 3) == []
    fresh = LookupDrafter(n_vocab=300)
    assert fresh.propose(tokens, 2, SamplingParams(temperature=1.0, top_k=0, top_p=1, min_p=0), None) == [7, 8]


def test_lookup_drafts_are_verified_and_accepted_on_copying(tiny_pair, tmp_path):
    """Small random models fall into loops; once the output repeats, lookup drafts are accepted."""
    shape = Shape()
    weights = make_weights(shape, seed=0)
    weights["output.weight"][2] = 0  # no EOS: a long run
    target = write_model(tmp_path / "looping.gguf", shape, weights)
    with SpeculativeDecoder(target, None, n_ctx=512, n_threads=1) as decoder:
        expected = decoder.generate(COPY_PROMPT, n_predict=200, n_draft=0).tokens
        out = decoder.generate(COPY_PROMPT, n_predict=200, n_draft=4, drafter="lookup")  # auto: machine-dependent
    assert out.tokens == expected
    assert out.stats.n_accept > 20 and out.stats.n_accept <= out.stats.n_drafted


def test_lookup_sampling_keeps_a_proposal_as_often_as_the_target_picks_it(tiny_pair, tiny_decoder):
    """A lookup proposal x is kept exactly when the position's draw picks x from the target's p: with
    probability p(x), as the rejection rule keeps a point mass, and what comes out is the target's
    own pick either way. Checked on the target's real distribution after the copy prompt; then end
    to end, seeded runs from a cold and from a warm pool give the target alone's text."""
    from llama_cpp import Llama
    from scipy import stats as scipy_stats

    from ggufspec.ngram import NgramPool
    from ggufspec.sampling import Draws, distribution
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1, min_p=0)
    proposals = LookupDrafter(tiny_decoder.target.n_vocab).propose(COPY_PROMPT, 1, params, None)
    assert proposals == [260]
    llm = Llama(model_path=str(tiny_pair[0]), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(COPY_PROMPT)
    p = distribution(np.array(llm.scores[llm.n_tokens - 1]), params)
    llm.close()
    x = int(np.argmax(p))  # the tiny target does not follow the pattern: a likely proposal instead
    assert 0.02 < p[x] < 0.98, p[x]
    n = 5_000
    kept = sum(Draws(seed).pick(p, len(COPY_PROMPT)) == x for seed in range(n))
    assert scipy_stats.binomtest(kept, n, p[x]).pvalue > 1e-3
    runs = []
    tiny_decoder.ngram_pool = NgramPool(1 << 12)
    for _ in range(2):  # the second run drafts from a pool that learned the first
        runs.append(tiny_decoder.generate(COPY_PROMPT, n_predict=20, n_draft=3, drafter="lookup", temperature=1.0, seed=3))
    alone = tiny_decoder.generate(COPY_PROMPT, n_predict=20, n_draft=0, temperature=1.0, seed=3)
    assert runs[0].stats.n_drafted > 0
    assert runs[0].tokens == runs[1].tokens == alone.tokens  # up to batch rounding: F32, far from ties


def test_controller_picks_zero_for_an_unrelated_draft(tiny_pair, tmp_path, monkeypatch):
    """An unrelated draft model soon stops being asked (the n-gram lookup may still draft where the
    output repeats itself: that is free and verified like any draft)."""
    from ggufspec.drafting import ModelDrafter
    shape = Shape()
    unrelated = write_model(tmp_path / "unrelated.gguf", shape, make_weights(shape, seed=99))
    asked = []  # sequence lengths at which the draft model proposed
    real = ModelDrafter.propose

    def spy(self, tokens, *args):
        asked.append(len(tokens))
        return real(self, tokens, *args)
    monkeypatch.setattr(ModelDrafter, "propose", spy)
    with SpeculativeDecoder(tiny_pair[0], unrelated, n_ctx=512, n_threads=1) as decoder:
        decoder.generate([1, 260, 261], n_predict=200, n_draft="auto")
    late = [n for n in asked if n > 3 + 100]
    assert len(late) <= 20, asked  # the model drafted on at most a fifth of the later positions


def test_controller_picks_large_k_when_the_draft_always_agrees(tmp_path):
    """A draft that always agrees and costs less: the target is the draft plus 7 layers whose outputs
    are zero (x + 0 == x exactly), so it computes the draft's logits at 8 times the cost. (A draft
    identical to the target always agrees too, but costs as much as the target: drafting never pays.)"""
    import numpy as np
    shape = Shape(n_layer=16, n_embd=256, n_head=4, n_head_kv=2, n_ff=768)
    weights = make_weights(shape, seed=1)
    weights["output.weight"][2] = 0  # no EOS: a long run
    for i in range(1, 16):
        weights[f"blk.{i}.attn_output.weight"][:] = 0
        weights[f"blk.{i}.ffn_down.weight"][:] = 0
    target = write_model(tmp_path / "target.gguf", shape, weights)
    draft_shape = Shape(**{**shape.__dict__, "n_layer": 1})
    draft = write_model(tmp_path / "draft.gguf", draft_shape,
                        {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith("blk.0.")})
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        # The costs of a memory-bound device (a GPU: a batch of n costs about one token), given
        # rather than measured: on this shared 2-core CPU a batch of n costs nearly n tokens and
        # whether drafting pays at all is a coin toss. Measured times only ever lower these minima.
        costs = decoder.costs["model"] = Costs()
        for n in range(1, 10):
            for _ in range(3):
                costs.add_batch(n, 1e-3 * (1 + 0.05 * (n - 1)))
        costs.draft_times.extend([6e-5] * 3)
        ks, out = chosen_ks(decoder, [1, 260, 261], n_predict=200, draft_max=8)
    assert out.stats.acceptance > 0.95
    tokens_per_step = out.stats.n_predict / out.stats.n_steps
    print("meanK", np.mean(ks), "maxK", max(ks), "tokens/step", tokens_per_step)
    assert tokens_per_step >= 3 and max(ks) >= 5, ks  # timings on a shared CPU are noisy: no finer claim


def test_controller_rates_follow_the_cost_model():
    c = AdaptiveK(k_max=8)
    for k, acc, t_draft, t_verify in [(3, 3, 0.03, 0.05), (0, 0, 0.0, 0.044)]:
        c.observe(k, acc, t_draft, t_verify)
    # a memory-bound target (batch of 4 ~ 1 token) and a cheap draft: drafting pays
    assert c.choose(8) > 0
    linear = AdaptiveK(k_max=8)
    for k, acc, t_draft, t_verify in [(3, 3, 0.09, 0.176), (0, 0, 0.0, 0.044)]:
        linear.observe(k, acc, t_draft, t_verify)
    # batch cost linear in its size (this CPU) and a draft 2/3 the target's cost: K=0
    assert linear.choose(8) == 0


def test_cli_lookup_and_auto(tiny_pair):
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "--lookup", "-p", "the cat the cat the cat",
                                       "-n", "16", "-c", "128", "-t", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stats"]["drafter"] == "lookup+auto"
    bad = CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "x", "--draft", "lots"])
    assert bad.exit_code == 2 and "--draft takes" in bad.output


def test_bench_json_has_the_fields(tiny_pair, tmp_path):
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"id": "a", "kind": "raw", "prompt": "the cat"}\n{"id": "b", "kind": "chat", "prompt": "hi"}\n')
    target, draft = tiny_pair
    result = CliRunner().invoke(main, ["bench", "-m", str(target), "-md", str(draft), "--prompts", str(prompts_file),
                                       "-n", "16", "--draft", "1,3,auto", "--lookup", "--hybrid", "-c", "256",
                                       "-t", "1", "--json", "--repeat", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["configs"] == ["target", "K=1", "K=3", "auto", "lookup", "hybrid"]
    row = data["summary"][1]
    for key in ("prompt", "config", "decode_tps", "prompt_tps", "speedup", "acceptance", "tokens_per_step", "same_text"):
        assert key in row
    assert all(s["same_text"] for s in data["summary"] if s["config"] != "target")
    assert set(data["cost_model"]["predicted"]) == {"K=1", "K=3"}
    assert len(data["runs"]) == 2 * 2 * 6


def test_bench_interrupted_keeps_the_prompts_it_finished(tiny_decoder):
    """Ctrl-C during the second prompt: the first prompt's runs are the result, marked interrupted
    (the CLI prints them and exits 130), instead of everything lost."""
    from ggufspec import bench as B

    class CtrlCAtThirdRun:
        updates = 0

        def update(self, n):
            self.updates += n
            if self.updates == 3:
                raise KeyboardInterrupt
    prompts = [{"id": "a", "kind": "raw", "prompt": "the cat"}, {"id": "b", "kind": "raw", "prompt": "a dog"}]
    result = B.run_bench(tiny_decoder, prompts, B.parse_configs("1"), n_predict=8, progress=CtrlCAtThirdRun())
    assert result.interrupted and {r.prompt for r in result.runs} == {"a"} and len(result.runs) == 2
    assert result.to_dict()["interrupted"] and "| a | K=1 |" in B.markdown(result)


def test_bench_bad_prompts_file(tiny_pair, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_pair[0]), "-md", str(tiny_pair[1]), "--prompts", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:1" in result.output


def test_no_probes_when_even_perfect_drafts_cannot_pay():
    """Batch cost linear in its size (this CPU): after measuring that, the controller stops probing."""
    c = AdaptiveK(k_max=8)
    for _ in range(3):
        c.observe(3, 3, 0.075, 0.176)   # K=3, all accepted, batch of 4 ~ 4 single tokens
        c.observe(0, 0, 0.0, 0.044)
    assert not c.costs.could_pay(8)
    assert [c.choose(8) for _ in range(300)] == [0] * 300


def test_the_costs_an_h100_measured_for_the_demo_shapes_leave_little_to_probe_for():
    """llama-bench on an H100 (benchmarks/results/gpu-h100-r12-3-*): the 1.5B decodes a token in
    1.88 ms, a batch of 2 / 4 / 8 costs 2.84 / 3.38 / 4.32 ms, the 0.5B draft 1.20 ms a token. Even
    all accepted, K = 1 gives two tokens for 4.04 ms against 3.76; only K >= 3 nearly always right
    could pay, so auto still probes, ever more rarely (every 2, 4, ... 128 steps). Timed when queued
    (0.22 ms a token, before Context.synchronize) the costs said nothing could pay at all."""
    from ggufspec.costs import Costs
    from ggufspec.costmodel import tokens_per_second
    costs = Costs()
    for n, seconds in {1: 1.88e-3, 2: 2.84e-3, 4: 3.38e-3, 8: 4.32e-3}.items():
        for _ in range(3):
            costs.add_batch(n, seconds)
    costs.draft_times.extend([1.20e-3] * 3)
    batch = costs.batch_model()
    assert tokens_per_second(1, 1.0, costs.t_draft, batch(2)) < 1 / batch(1)
    assert costs.could_pay(8)
    controller = AdaptiveK(8, costs=costs)
    choices = [controller.choose(8) for _ in range(300)]
    assert 4 <= sum(1 for k in choices if k) <= 9 and choices.count(0) >= 290


def test_a_generation_probes_a_draft_that_kept_failing_less_than_a_fresh_start():
    """The H200's costs (benchmarks/results/gpu-h200-r20-1-llama-bench.json, the draft from bench):
    with a never-agreeing draft, auto cost 0.92x the target alone on each 256-token answer, probing at
    steps 2, 7, 16, 33, 66 and 131. The next generation on the same costs starts at a quarter of where
    the last left off (128 steps): probes at 32, 97 and 226. A draft that won leaves the interval at 2."""
    from ggufspec.costs import Costs
    costs = Costs()
    for n, seconds in {1: 1.861e-3, 2: 2.970e-3, 4: 3.495e-3, 8: 4.469e-3}.items():
        for _ in range(3):
            costs.add_batch(n, seconds)
    costs.draft_times.extend([1.29e-3] * 3)
    assert costs.could_pay(8)
    probes = []
    for _ in range(3):
        controller = AdaptiveK(8, costs=costs)
        probes.append(sum(1 for _ in range(256) if controller.choose(8)))
    assert probes == [6, 3, 3] and costs.probe_interval == 128
    controller = AdaptiveK(8, costs=costs)
    for _ in range(10):
        controller.observe(3, 3, 3 * 0.3e-3, 3.495e-3)  # a cheaper draft, right every time: K > 0 wins
    assert controller.choose(8) > 0 and costs.probe_interval == 2
    assert AdaptiveK(8, costs=costs).probe_interval == 2


def test_costs_are_remembered_between_runs(tiny_pair, ggufspec_home):
    """The controller's measured costs outlive the decoder (in $GGUFSPEC_HOME/costs.json)."""
    from ggufspec.costs import Costs
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as decoder:
        decoder.generate([1, 260, 261], n_predict=60, n_draft="auto")
        learned = decoder.costs["model"].to_dict()
    assert (ggufspec_home / "costs.json").is_file()
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as decoder:
        assert decoder.costs["model"].to_dict() == learned
    # a machine where no draft can pay, remembered: the next run drafts nothing from its first step
    hopeless = Costs()
    for _ in range(3):
        hopeless.observe(3, 0.075, 0.176)
        hopeless.observe(0, 0.0, 0.044)
    controller = AdaptiveK(8, costs=Costs.from_dict(hopeless.to_dict()))
    assert controller.choose(8) == 0
