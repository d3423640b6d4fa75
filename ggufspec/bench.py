"""`ggufspec bench`: the target alone and each speculative configuration, interleaved, per prompt.

Runs alternate A B C ... then ... C B A on the next repeat, so that slow drift of the machine
(thermal, other load) falls on every configuration alike. Each run starts from an empty n-gram pool
and with the prompt in both caches. The predicted column (`simulate`) replays an acceptance trace
under the step costs timed between the runs (`stepcosts.CostSampler`), next to the measured speedup.
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from .costmodel import acceptance_from_tokens_per_step, speedup
from .costs import Costs
from .errors import GgufspecError
from .llamacpp_tools import NativeSettings, run_tool, target_alone_tool
from .load import chat_prompt
from .lora import adapters_of
from .ngram import NgramPool
from .stepcosts import DRAFT_SIZES, CostSampler, measure_costs  # noqa: F401  (bench.measure_costs)
from .simulate import CostCurve, Policy, Trace, curve_from_times, predict, synthetic_trace


@dataclass(frozen=True)
class Config:
    name: str
    options: dict
    llamacpp_k: int | None = None  # set for a llama.cpp run: K for llama-speculative-simple, 0 for the target alone

LLAMACPP_TARGET = "llama.cpp target"  # llama.cpp's own target-alone decode, from the same build
FLASH_ATTN_SETTINGS = ("on", "off", "auto")


def parse_configs(draft: str, lookup: bool = False, hybrid: bool = False, against_llamacpp: str | None = None,
                  draft_p_min: float = 0.0, alone: bool = False) -> list[Config]:
    """The configurations to measure: the target alone first, then each draft setting (`alone`: it may
    be the only one, as where only a trace is recorded)."""
    configs = [Config("target", {"n_draft": 0})]
    if against_llamacpp:
        configs.append(Config(LLAMACPP_TARGET, {}, llamacpp_k=0))
    for item in [d.strip() for d in draft.split(",") if d.strip()]:
        if item == "auto":
            configs.append(Config("auto", {"n_draft": "auto", "draft_p_min": draft_p_min}))
        elif item.isdigit() and int(item) >= 1:
            configs.append(Config(f"K={item}", {"n_draft": int(item), "draft_p_min": draft_p_min}))
            if against_llamacpp:
                configs.append(Config(f"llama.cpp K={item}", {}, llamacpp_k=int(item)))
        else:
            raise GgufspecError(f"--draft takes a comma-separated list of K >= 1 and 'auto', got {item!r}")
    if lookup:
        configs.append(Config("lookup", {"n_draft": "auto", "drafter": "lookup"}))
    if hybrid:
        configs.append(Config("hybrid", {"n_draft": "auto", "drafter": "hybrid"}))
    if len(configs) == 1 + bool(against_llamacpp) and not alone:
        raise GgufspecError(f"--draft {draft!r} names no configuration to measure against the target alone "
                            "(K values >= 1 and 'auto', e.g. 1,3,auto; or --lookup / --hybrid)")
    return configs


def load_prompts(path: str | None) -> list[dict]:
    """JSONL prompts (id, kind: chat|raw, prompt, optional system); default: the seed and copy sets."""
    if path:
        try:
            sources = [(path, Path(path).read_text(encoding="utf-8"))]
        except FileNotFoundError:
            raise GgufspecError(f"--prompts: {path} does not exist (a JSONL file: one "
                                f'{{"prompt": ..., "kind": "raw"}} object a line)') from None
        except UnicodeDecodeError:
            raise GgufspecError(f"--prompts: {path} is not UTF-8 text (a JSONL file)") from None
        except OSError as exc:
            raise GgufspecError(f"--prompts: cannot read {path}: {exc.strerror}") from None
    else:
        data = resources.files("ggufspec").joinpath("data")
        sources = [(name, data.joinpath(name).read_text(encoding="utf-8"))
                   for name in ("seed-prompts.jsonl", "copy-prompts.jsonl")]
    prompts = []
    for source, text in sources:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                assert isinstance(item["prompt"], str) and item.get("kind", "raw") in ("chat", "raw")
            except (ValueError, KeyError, AssertionError, TypeError):
                raise GgufspecError(f"{source}:{number}: expected a JSON object with a string 'prompt' and "
                                    f"kind 'chat' or 'raw'") from None
            if not item["prompt"]:
                raise GgufspecError(f"{source}:{number}: the prompt is empty")
            item.setdefault("id", f"p{len(prompts)}")
            prompts.append(item)
    return prompts


@dataclass
class Run:
    prompt: str
    config: str
    repeat: int
    n_prompt: int
    n_predict: int
    prompt_tps: float
    decode_tps: float
    decode_seconds: float
    acceptance: float
    tokens_per_step: float
    n_drafted: int
    n_accept: int
    same_text: bool | None = None
    text: str = ""
    stop: str = ""
    n_steps: int = 0              # target batches; with the two below, what a step costs beyond them
    draft_seconds: float = 0.0
    target_seconds: float = 0.0


@dataclass
class BenchResult:
    runs: list[Run]
    configs: list[str]
    summary: list[dict] = field(default_factory=list)
    overall: dict = field(default_factory=dict)
    cost_model: dict = field(default_factory=dict)
    interrupted: bool = False  # Ctrl-C: the prompts finished before it

    def to_dict(self) -> dict:
        return {"configs": self.configs, "summary": self.summary, "overall": self.overall, "cost_model": self.cost_model,
                "runs": [asdict(r) for r in self.runs], "interrupted": self.interrupted}


def run_bench(decoder, prompts: list[dict], configs: list[Config], *, n_predict: int = 256, repeat: int = 1,
              temperature: float = 0.0, seed: int = 1, progress=None, llamacpp: str | None = None,
              n_threads: int | None = None, flash_attn: str = "auto", n_gpu_layers: int = 0,
              n_gpu_layers_draft: int | None = None, recorder=None, cost_sampler=None,
              llamacpp_args: tuple[tuple, tuple] = ((), ())) -> BenchResult:
    """flash_attn (auto: as the decoder took it) and the offload (-ngl, -ngld; None: as the target) are the
    decoder's: llama.cpp's tools get the same, and `llamacpp_args` (the load flags: the target's and shared
    ones, the draft's). `recorder` (a traces.TraceRecorder): each prompt's acceptance trace, from its first
    greedy target-alone run; `cost_sampler` (a CostSampler): a round of cost measurements after each
    prompt's configurations (both outside every timed run)."""
    if flash_attn not in FLASH_ATTN_SETTINGS:
        raise GgufspecError(f"-fa/--flash-attn takes on, off or auto, got {flash_attn!r}")
    if flash_attn == "auto":  # `load.resolved_flash_attn`'s (off on a CPU), not llama.cpp's auto
        flash_attn = {0: "off", 1: "on"}.get(decoder.target_llm.context_params.flash_attn_type, "auto")
    adapted = tuple(arg for a in adapters_of(decoder.target_llm) for arg in ("--lora-scaled", f"{a.path}:{a.scale}"))
    native = NativeSettings(n_threads, flash_attn, n_gpu_layers, n_gpu_layers if n_gpu_layers_draft is None else
                            n_gpu_layers_draft, llamacpp_args[0] + adapted, llamacpp_args[1])  # the adapted target too
    runs: list[Run] = []
    done, interrupted = 0, False  # done: the runs of the prompts finished
    try:
        for item in prompts:
            done = len(runs)
            chat = item.get("kind") == "chat"
            _prefill_draft(decoder, item)
            for r in range(repeat):
                order = configs if r % 2 == 0 else configs[::-1]  # A B C, then C B A: drift cancels
                for config in order:
                    if config.llamacpp_k == 0:
                        runs.append(_run_llamacpp_alone(llamacpp, decoder, item, config, r, n_predict, native))
                    elif config.llamacpp_k is not None:
                        runs.append(_run_llamacpp(llamacpp, decoder, item, config, r, n_predict, native))
                    else:
                        _fresh_pool(decoder)
                        gen = decoder.generate(item["prompt"], n_predict=n_predict, temperature=temperature, seed=seed,
                                               chat=chat, system=item.get("system") if chat else None, **config.options)
                        s = gen.stats
                        runs.append(Run(item["id"], config.name, r, s.n_prompt, s.n_predict, s.prompt_tps, s.decode_tps,
                                        s.decode_seconds, s.acceptance, s.n_predict / max(s.n_steps, 1), s.n_drafted,
                                        s.n_accept, text=gen.text, stop=s.stop_reason, n_steps=s.n_steps,
                                        draft_seconds=s.draft_seconds, target_seconds=s.target_seconds))
                        if recorder is not None and r == 0 and config.name == "target" and temperature == 0:
                            recorder.add(item, gen.tokens, s.stop_reason)
                    if progress is not None:
                        progress.update(1)
                if cost_sampler is not None:
                    cost_sampler.sample()
            if recorder is not None and temperature > 0:
                recorder.add(item)  # a greedy run of its own: a trace is of the target's greedy tokens
        done = len(runs)
    except KeyboardInterrupt:  # Ctrl-C: the prompts finished are the result (not a prompt's part)
        if not done:
            raise
        del runs[done:]
        interrupted = True
    result = BenchResult(runs, [c.name for c in configs], interrupted=interrupted)
    _compare_texts(result, temperature)
    _summarise(result)
    return result


def fitting_prompts(decoder, prompts: list[dict], warn) -> list[dict]:
    """The prompts that fit the context; `warn` is told of each one that does not (it is skipped)."""
    fitting = []
    for item in prompts:
        chat = item.get("kind") == "chat"
        n = len(decoder.tokenize(item["prompt"], chat=chat, system=item.get("system") if chat else None))
        if n < decoder.target.n_ctx:
            fitting.append(item)
        else:
            warn(f"prompt {item['id']} skipped: it is {n} tokens but the context holds {decoder.target.n_ctx} (-c)")
    return fitting


def _fresh_pool(decoder) -> None:
    """An empty n-gram pool of the same size for every run: a repeat of a prompt would otherwise copy
    the answer an earlier run gave it (auto's second run of a prompt drafted whole answers from its
    first), which no fresh request sees. Each run's speed is then that of its prompt alone."""
    pool = getattr(decoder, "ngram_pool", None)
    if pool is not None:
        decoder.ngram_pool = NgramPool(pool.size, pool.orders)


def _prefill_draft(decoder, item: dict) -> None:
    """The prompt in the draft's cache before a prompt's runs, as in the target's. The engine has the
    draft evaluate it when it first drafts (where `auto` may never draft), and bench's runs reuse
    both caches: without this, whichever configuration drafted first on a prompt paid for the
    draft's prompt in its decode time, and the others did not."""
    from .mtp import MtpContext
    draft = decoder.draft
    if draft is None or isinstance(getattr(draft, "inner", draft), MtpContext):
        return  # MTP heads read the target's states: nothing of their own to evaluate first
    chat = item.get("kind") == "chat"
    tokens = decoder.tokenize(item["prompt"], chat=chat, system=item.get("system") if chat else None)
    draft.reuse_prefix(tokens[:-1])
    draft.decode(tokens[draft.n_past:-1], n_logits=0)


def _compare_texts(result: BenchResult, temperature: float) -> None:
    if temperature > 0:
        return
    reference = {(r.prompt, r.repeat): r.text for r in result.runs if r.config == "target"}
    for r in result.runs:
        if r.config != "target" and not r.config.startswith("llama.cpp") and (r.prompt, r.repeat) in reference:
            r.same_text = r.text == reference[(r.prompt, r.repeat)]


def _summarise(result: BenchResult) -> None:
    by_key: dict[tuple, list[Run]] = {}
    for r in result.runs:
        by_key.setdefault((r.prompt, r.config), []).append(r)
    prompts = list(dict.fromkeys(r.prompt for r in result.runs))
    for prompt in prompts:
        base = statistics.median(r.decode_tps for r in by_key[(prompt, "target")])
        for config in result.configs:
            rs = by_key.get((prompt, config), [])
            if not rs:
                continue
            tps = statistics.median(r.decode_tps for r in rs)
            same = [r.same_text for r in rs if r.same_text is not None]
            result.summary.append({
                "prompt": prompt, "config": config, "decode_tps": tps,
                "prompt_tps": statistics.median(r.prompt_tps for r in rs),
                "seconds": statistics.median(r.decode_seconds for r in rs),
                "speedup": tps / base if base else 0.0,
                "acceptance": statistics.median(r.acceptance for r in rs),
                "tokens_per_step": statistics.median(r.tokens_per_step for r in rs),
                "same_text": all(same) if same else None})
    for config in result.configs:
        rows = [s for s in result.summary if s["config"] == config]
        result.overall[config] = {
            "median_speedup": statistics.median(s["speedup"] for s in rows),
            "min_speedup": min(s["speedup"] for s in rows),
            "median_decode_tps": statistics.median(s["decode_tps"] for s in rows),
            "median_acceptance": statistics.median(s["acceptance"] for s in rows),
            "all_same_text": (all(s["same_text"] for s in rows if s["same_text"] is not None)
                              if any(s["same_text"] is not None for s in rows) else None)}


# ---------------------------------------------------------------- cost model: the predicted column

def cost_curve(costs: dict, result: BenchResult | None = None, remembered: Costs | None = None) -> CostCurve:
    """measure_costs' figures as the simulator's curve, with what a step costs beyond drafting and
    verifying (Python, rewinding the caches, yielding the tokens): measured in the bench's own
    target-alone runs (their time less the target's, per step). `remembered`: what `auto`'s
    controller knew of this machine's costs before the runs."""
    batches = {int(key[7:]): t for key, t in costs.items() if key.startswith("target_")}
    return curve_from_times(batches, costs.get("draft_1", 0.0), step_seconds=step_seconds(result),
                            row_seconds=costs.get("row", 0.0), source="measured", draft_batches=draft_batches(costs),
                            remembered=remembered)


def step_seconds(result: BenchResult | None) -> float:
    """The median over the target-alone runs of their time outside the target's batches, per step.
    (Not their time per token less a T(1) timed at another moment: on a shared machine that
    difference is the load's, and charged to every step it favoured the configurations with fewer
    steps; one such residual was 29 ms a step where the steps' own gaps were 0.1 ms.)"""
    alone = [r for r in (result.runs if result else []) if r.config == "target" and r.n_steps]
    if not alone:
        return 0.0
    return max(statistics.median((r.decode_seconds - r.draft_seconds - r.target_seconds) / r.n_steps
                                 for r in alone), 0.0)


def draft_batches(costs: dict) -> dict[int, float]:
    return {int(key[6:]): t for key, t in costs.items() if key.startswith("draft_")}


def remember_costs(decoder, costs: dict) -> None:
    """Add measure_costs' figures to what `--draft auto` remembers for this pair and machine
    (costs.json), where `plan` reads them back."""
    if "draft_1" not in costs:
        return
    learned = decoder.costs.setdefault("model", Costs())
    for key, seconds in costs.items():
        if key.startswith("target_"):
            learned.add_batch(int(key[7:]), seconds)
    learned.draft_times.append(costs["draft_1"])


def predicted_speedup(costs: dict, k: int, a: float) -> float:
    """The i.i.d. cost model's speedup for K = k from measure_costs' figures (costmodel.speedup)."""
    return speedup(k, a, costs["draft_1"], costs[f"target_{k + 1}"], costs["target_1"])


def _policy(config: Config) -> Policy | None:
    if config.llamacpp_k is not None or config.options.get("drafter", "model") != "model":
        return None  # llama.cpp's runs, the lookup and hybrid drafters: not replayed
    n_draft = config.options.get("n_draft", 0)
    if n_draft == "auto":
        return Policy(auto=True, p_min=config.options.get("draft_p_min", 0.0))
    return Policy(int(n_draft), p_min=config.options.get("draft_p_min", 0.0))


def repeats_of(result: BenchResult) -> int:
    return 1 + max((r.repeat for r in result.runs), default=0)


def snapshot_costs(decoder) -> Costs | None:
    """What `auto` knows before a bench (its replay starts there and learns as the runs did)."""
    learned = decoder.costs.get("model")
    return Costs.from_dict(learned.to_dict()) if learned is not None else None


def add_cost_model(result: BenchResult, costs: dict, configs: list[Config], trace: Trace | None = None,
                   remembered: Costs | None = None) -> None:
    """The predicted column: each configuration replayed by the simulator under this machine's costs.

    With a trace, its prompts of the same id as the bench's, each replayed as often and in the order
    bench ran it (one n-gram pool throughout, as the decoder has; `remembered`: what auto knew
    before the runs), else all of them (held-out prompts);
    without one, an i.i.d. trace at the acceptance each K measured in this run (then `auto`, whose
    acceptance depends on its own choices, is not predicted)."""
    curve = cost_curve(costs, result, remembered)
    result.cost_model = {"costs": costs, "step_seconds": curve.step_seconds, "predicted": {},
                         "auto_knew": remembered.to_dict() if remembered is not None else None,
                         "acceptance_from": trace.source if trace else "this run's tokens per step (i.i.d. model)"}
    for config in configs:
        policy = _policy(config)
        rows = [s for s in result.summary if s["config"] == config.name]
        if policy is None or not policy.k and not policy.auto or not rows or "draft_1" not in costs:
            continue
        if trace is not None:
            bench_prompts = {s["prompt"] for s in rows}
            own = [p.prompt for p in trace.prompts if p.prompt in bench_prompts]
            predicted = predict(trace, curve, policy, own or None, repeats=repeats_of(result) if own else 1)
        elif not policy.auto:
            a = acceptance_from_tokens_per_step(statistics.median(s["tokens_per_step"] for s in rows), policy.k)
            predicted = predict(synthetic_trace(a), curve, policy)
        else:
            continue
        measured = result.overall[config.name]["median_speedup"]
        result.cost_model["predicted"][config.name] = {
            "acceptance_per_token": predicted.acceptance, "predicted_speedup": predicted.speedup,
            "measured_speedup": measured, "error": predicted.speedup / measured - 1 if measured else None}


# ---------------------------------------------------------------- llama.cpp's own tools

def prompt_text(decoder, item: dict) -> str:
    return chat_prompt(decoder.target_llm, item["prompt"], item.get("system")) if item.get("kind") == "chat" \
        else item["prompt"]


def _run_llamacpp(binary: str, decoder, item: dict, config: Config, repeat: int, n_predict: int,
                  native: NativeSettings) -> Run:
    cmd = [binary, "-m", decoder.target_llm.model_path, "-md", decoder.draft_llm.model_path, "-p", prompt_text(decoder, item),
           "-n", str(n_predict), "--spec-type", "draft-simple", "--spec-draft-n-max", str(config.llamacpp_k),
           "--spec-draft-n-min", "0", "-c", str(decoder.n_ctx), "--temp", "0", *native.args(draft=True)]
    log = run_tool(cmd, "llama-speculative-simple", "decoded")
    grab = lambda pattern, cast=float: cast(re.search(pattern, log).group(1))
    n_dec, secs = grab(r"decoded\s+(\d+) tokens", int), grab(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds")
    n_enc, enc_secs = grab(r"encoded\s+(\d+) tokens", int), grab(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds")
    drafted, accepted = grab(r"n_drafted = (\d+)", int), grab(r"n_accept\s+= (\d+)", int)
    steps = max(n_dec - accepted, 1)
    return Run(item["id"], config.name, repeat, n_enc, n_dec, n_enc / enc_secs if enc_secs else 0.0,
               n_dec / secs if secs else 0.0, secs, accepted / drafted if drafted else 0.0, n_dec / steps,
               drafted, accepted)


DECODE_TIME = r"(?<!prompt) eval time =\s*([\d.]+) ms /\s*(\d+) runs"  # llama-completion's decode line, its last


def _run_llamacpp_alone(binary: str, decoder, item: dict, config: Config, repeat: int, n_predict: int,
                        native: NativeSettings) -> Run:
    tool = target_alone_tool(binary)
    model = decoder.target_llm.model_path
    if tool.name.startswith("llama-bench"):
        cmd = [str(tool), "-m", model, "-p", "0", "-n", str(n_predict), "-r", "1", "-o", "json", *native.args(draft=False)]
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600, stdin=subprocess.DEVNULL)
        try:
            row = json.loads(proc.stdout)[0]
            n_gen, tps = int(row["n_gen"]), float(row["avg_ts"])
        except (ValueError, LookupError, TypeError):
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise GgufspecError(f"llama-bench failed ({proc.returncode}): {last}") from None
        return Run(item["id"], config.name, repeat, 0, n_gen, 0.0, tps, n_gen / tps if tps else 0.0, 0.0, 1.0, 0, 0)
    # -no-cnv: a model with a chat template would start a conversation; chat prompts come templated already
    cmd = [str(tool), "-m", model, "-p", prompt_text(decoder, item), "-n", str(n_predict), "-c", str(decoder.n_ctx),
           "--temp", "0", "-no-cnv", *native.args(draft=False)]
    log = run_tool(cmd, "llama-completion", DECODE_TIME)
    prompt = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
    decode = re.search(DECODE_TIME, log)
    if not prompt or not decode:
        raise GgufspecError(f"llama-completion printed no timings: {log.strip().splitlines()[-1] if log.strip() else ''}")
    prompt_s, n_prompt = float(prompt[1]) / 1000, int(prompt[2])
    decode_s, n_decoded = float(decode[1]) / 1000, int(decode[2])
    return Run(item["id"], config.name, repeat, n_prompt, n_decoded, n_prompt / prompt_s if prompt_s else 0.0,
               n_decoded / decode_s if decode_s else 0.0, decode_s, 0.0, 1.0, 0, 0)


# ---------------------------------------------------------------- output

def markdown(result: BenchResult) -> str:
    lines = ["| prompt | config | seconds | tok/s | speedup | accept | tokens/step | same text |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for s in result.summary:
        same = "" if s["same_text"] is None else ("yes" if s["same_text"] else "no")
        lines.append(f"| {s['prompt']} | {s['config']} | {s['seconds']:.2f} | {s['decode_tps']:.2f} | "
                     f"{s['speedup']:.2f}x ({100 * (s['speedup'] - 1):+.0f}%) | {100 * s['acceptance']:.1f}% | "
                     f"{s['tokens_per_step']:.2f} | {same} |")
    lines += ["", "| config | median tok/s | median speedup | min speedup | median accept | predicted speedup |",
              "|---|---:|---:|---:|---:|---:|"]
    for config, o in result.overall.items():
        p = result.cost_model.get("predicted", {}).get(config, {})
        predicted = "" if not p else f"{p['predicted_speedup']:.2f}x ({100 * (p['error'] or 0):+.0f}%)"
        lines.append(f"| {config} | {o['median_decode_tps']:.2f} | {o['median_speedup']:.2f}x | {o['min_speedup']:.2f}x "
                     f"| {100 * o['median_acceptance']:.1f}% | {predicted} |")
    if result.cost_model.get("predicted"):
        lines.append(f"\npredicted: the simulator replaying {result.cost_model['acceptance_from']} under the costs "
                     f"measured here (in parentheses: against the measured speedup)")
    return "\n".join(lines)


def plot(result: BenchResult, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GgufspecError("--plot needs matplotlib: pip install 'ggufspec[plot]'") from None
    ks = sorted(int(c[2:]) for c in result.overall if re.fullmatch(r"K=\d+", c))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [result.overall[f"K={k}"]["median_speedup"] for k in ks], "o-", label="speedup (measured)")
    predicted = result.cost_model.get("predicted", {})
    if predicted:
        ax.plot(ks, [predicted.get(f"K={k}", {}).get("predicted_speedup", float("nan")) for k in ks], "x--",
                label="speedup (cost model)")
    ax.plot(ks, [result.overall[f"K={k}"]["median_acceptance"] for k in ks], "s-", label="acceptance")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("K (tokens drafted per step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
