"""What several commands share: the model, drafting and sampling flags, and turning them into an
opened Session (`ggufspec.session`) and the decoder's stream() keywords."""
from __future__ import annotations

import json
import re

import click

from ..chat_templates import RENDERER_VARIABLES
from ..errors import GgufspecError
from ..gguffiles import file_list, scaled_item
from ..load import KV_CACHE_TYPES
from ..ngram import DEFAULT_POOL_SIZE
from ..sampling import LLAMACPP_FILTERS, SamplingParams  # the sampling defaults, in one place
from .app import not_utf8_file, utf8_text
from .bounds import FiniteRange, threads, tokens
from .constraint_options import constraint_options, constraints_from
from .hub_flags import hub_flag_options
from .load_extras import EXTRA_LOAD_FLAGS, extra_load_options
from .spec_type import apply_spec_type, spec_type_options


class RenamedOption(click.Option):
    """An option llama.cpp renamed: --help shows the current name first, the old spelling still works."""

    def get_help_record(self, ctx):
        every, self.opts = self.opts, self.opts[:1]
        try:
            record = super().get_help_record(ctx)
        finally:
            self.opts = every
        return record and (record[0], f"{record[1]} (also: {', '.join(every[1:])})")


def options(*decorators):
    """Several click options as one decorator, in the order they are listed in --help."""
    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command
    return apply


def model_options(command):
    """The models and how they are loaded: shared by run, serve and chat."""
    return options(
        click.argument("pair", required=False),
        click.option("-m", "--model", "model",
                     help="Target model (GGUF path, hf://OWNER/REPO[/FILE.gguf], OWNER/REPO:QUANT or a URL)."),
        click.option("-md", "--model-draft", "model_draft",
                     help="Draft model (GGUF path, or as -m) [default: one on disk with the target's tokenizer, at "
                          "least 5x smaller; else the registry's pair; else n-gram drafting]."),
        *hub_flag_options(presets=True),  # -hf, -hff, -hfd, -hft, -mu, --offline, --fim-qwen-7b-spec...: as -m/-md
        click.option("--draft-dir", "draft_dir", default=None, metavar="DIR",
                     help="Also look for a draft model in this folder (besides ggufspec's models)."),
        click.option("--lookup-pool", "lookup_pool", type=int, default=DEFAULT_POOL_SIZE, metavar="N",
                     help="N-grams the n-gram pool keeps across requests (12 bytes each)."),
        click.option("-c", "--ctx-size", "n_ctx", type=tokens(0), default=4096,
                     help="Context size in tokens (0: the model's own)."),
        click.option("-t", "--threads", "n_threads", type=threads(), default=None,
                     help="CPU threads [default: physical cores]."),
        click.option("-ngl", "--gpu-layers", "--n-gpu-layers", "n_gpu_layers", type=int, default=None,
                     help="Target layers on the GPU [default: planned]."),
        click.option("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "n_gpu_layers_draft", type=int, default=None,
                     help="Draft layers on the GPU [default: planned]."),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
                     help="Flash attention (auto: off where the CPU computes every layer, else llama.cpp's)."),
        click.option("--rpc", default=None, metavar="HOST:PORT[,...]",
                     help="Put the target's layers on these `ggufspec worker`s; the draft stays local."),
        click.option("--no-draft", is_flag=True, help="The target alone, for comparison."),
        *spec_type_options(),
        click.option("--strict", is_flag=True, help="Verify token by token: bit-identical to the target alone, slower."),
        click.option("--exact", is_flag=True,
                     help="On the CPU, compute verification batches with the single-token kernels: greedy text "
                          "bit-identical to the target alone with the batch kept (prompt processing slower)."),
        click.option("--swa-full", is_flag=True, help="Full-size caches for sliding-window layers (default: "
                     "window-sized, as llama-server; rollback through checkpoints)."),
        *load_flag_options(hub=False),
        click.option("--chat-template", "chat_template", default=None, metavar="JINJA",
                     help="Render chats with this Jinja template (or chatml) instead of the model's own."),
        click.option("--chat-template-file", "chat_template_file", default=None, metavar="FILE",
                     help="Read the --chat-template from a file."),
    )(command)


def load_flag_options(hub: bool = True):
    """llama.cpp's load flags, by its names (common/arg.cpp). -b, -ub, --mlock and --no-mmap apply to
    both models; the draft's threads default to the target's, its cache types are its own. `hub`: with
    the download flags (-hf...: bench's and eval's; model_options puts them beside its -m)."""
    count, batch = dict(type=threads(), default=None, metavar="N"), dict(type=tokens(), default=None, metavar="N")
    return [
        *(hub_flag_options() if hub else []),
        click.option("-b", "--batch-size", "n_batch", **batch,
                     help="Logical batch: the most tokens one decode takes (a prompt goes in chunks of it; a step's "
                          "K drafts + 1 must fit) [default: 512, or -ub if larger; llama.cpp's is 2048]."),
        click.option("-ub", "--ubatch-size", "n_ubatch", **batch,
                     help="Physical batch: tokens computed at once, at most -b (--strict: the target's is 1; "
                          "--exact: at most 32) [default: 512]."),
        click.option("-tb", "--threads-batch", "n_threads_batch", **count,
                     help="Threads for batches: prompts, verifications [default: -t]."),
        click.option("-td", "--threads-draft", "--spec-draft-threads", "n_threads_draft", **count,
                     help="The draft's threads [default: -t]."),
        click.option("-tbd", "--threads-batch-draft", "--spec-draft-threads-batch", "n_threads_batch_draft", **count,
                     help="The draft's threads for batches [default: -tb]."),
        click.option("--mlock", "use_mlock", is_flag=True, help="Keep the models in RAM, never swapped out."),
        click.option("--no-mmap", "no_mmap", is_flag=True,
                     help="Read the models into memory instead of mapping their files (slower load, no page-outs)."),
        click.option("-lm", "--load-mode", "load_mode", type=click.Choice(LOAD_MODES), default=None,
                     help="llama.cpp's newer spelling of --mlock / --no-mmap: auto and mmap map the files; none "
                          "reads them; mlock reads and locks them; mmap+mlock maps and locks [default: auto]."),
        *cache_type_options(),
        click.option("--lora", "lora", multiple=True, metavar="FNAME",
                     help="A LoRA adapter on the target, scale 1 (repeatable, or comma-separated); the draft has none, "
                          "the adapted target decides every token."),
        click.option("--lora-scaled", "lora_scaled", multiple=True, metavar="FNAME:SCALE",
                     help="A LoRA adapter on the target with its scale (repeatable, or FNAME:SCALE,...; 0: off)."),
        *tensor_placement_options(),
        *extra_load_options(),  # RoPE/YaRN, --override-kv, -sm, -mg, -ts, -dev, -devd, --list-devices
    ]


def tensor_placement_options():
    """llama.cpp's tensor buffer type overrides (`ggufspec.placement`): -ot, -cmoe, -ncmoe for the target,
    -otd, -cmoed, -ncmoed for the draft (llama.cpp's --spec-draft-* names too)."""
    pattern = dict(multiple=True, metavar="PATTERN=TYPE,...")
    layers = dict(type=click.IntRange(min=0), default=0, metavar="N")
    return [
        click.option("-ot", "--override-tensor", "override_tensor", **pattern,
                     help="Put the target's tensors whose names match the regex PATTERN in buffer type TYPE (CPU, "
                          "CUDA0...; the first match wins, -ot's before --cpu-moe's), e.g. -ot "
                          "'blk\\.[0-9]\\.ffn_.*_exps\\.=CPU' (repeatable)."),
        click.option("-cmoe", "--cpu-moe", "cpu_moe", is_flag=True,
                     help="Keep every Mixture-of-Experts weight (the experts) of the target on the CPU, the rest "
                          "where -ngl puts it: an MoE larger than the GPU's memory, its dense part on the GPU."),
        click.option("-ncmoe", "--n-cpu-moe", "n_cpu_moe", **layers,
                     help="Keep the experts of the target's first N layers on the CPU."),
        click.option("-otd", "--override-tensor-draft", "--spec-draft-override-tensor", "override_tensor_draft",
                     **pattern, help="-ot for the draft model."),
        click.option("-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe", "cpu_moe_draft", is_flag=True,
                     help="--cpu-moe for the draft model."),
        click.option("-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "n_cpu_moe_draft",
                     **layers, help="--n-cpu-moe for the draft model."),
    ]


def lora_flags(load: dict) -> tuple[tuple[str, float], ...]:
    """--lora and --lora-scaled (consumed from `load`) as (path, scale) pairs, in llama.cpp's syntax: each
    value a comma-separated list (a name with a comma in double quotes), --lora-scaled's items FNAME:SCALE.
    The --lora ones come first, then the --lora-scaled ones (their ids on serve's /lora-adapters)."""
    adapters = [(name, 1.0) for value in load.pop("lora", ()) for name in file_list("--lora", utf8_text("--lora", value))]
    for value in load.pop("lora_scaled", ()):
        adapters += [scaled_item("--lora-scaled", item, "adapter.gguf:0.5")
                     for item in file_list("--lora-scaled", utf8_text("--lora-scaled", value))]
    return tuple(adapters)


def cache_type_options():
    """-ctk/-ctv (the target's KV cache types) and -ctkd/-ctvd (the draft's): run, serve, chat and plan."""
    kind = dict(type=click.Choice(KV_CACHE_TYPES, case_sensitive=False), default="f16", metavar="TYPE")
    v_note = " (quantized: flash attention, which -fa auto turns on for it)"
    return [
        click.option("-ctk", "--cache-type-k", "cache_type_k", **kind,
                     help=f"KV cache type for K: {', '.join(KV_CACHE_TYPES)} (q8_0: about half f16's memory)."),
        click.option("-ctv", "--cache-type-v", "cache_type_v", **kind, help=f"KV cache type for V{v_note}."),
        click.option("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k", "cache_type_k_draft", **kind,
                     help="The draft's KV cache type for K."),
        click.option("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v", "cache_type_v_draft", **kind,
                     help=f"The draft's KV cache type for V{v_note}."),
    ]


# llama.cpp's samplers past temperature, top-k, top-p and min-p: (its flags, SamplingParams' field, the help)
LLAMACPP_SAMPLER_FLAGS = [
    (("--typical", "--typical-p"), "typical_p", "Locally typical sampling, p (1: off)."),
    (("--top-nsigma", "--top-n-sigma"), "top_n_sigma",
     "Top-n-sigma: the tokens within n standard deviations of the best logit (<= 0: off)."),
    (("--xtc-probability",), "xtc_probability", "XTC: the chance that a step removes its likeliest tokens (0: off)."),
    (("--xtc-threshold",), "xtc_threshold",
     "XTC: tokens at least this likely are removed, all but the least of them (above 0.5: off)."),
    (("--dynatemp-range",), "dynatemp_range",
     "Dynamic temperature: each step's in [temp - range, temp + range], by the entropy of the tokens left (0: off)."),
    (("--dynatemp-exp",), "dynatemp_exponent", "Dynamic temperature: the exponent the normalised entropy is raised to."),
    (("--adaptive-target",), "adaptive_target",
     "adaptive-p, where --samplers lists adaptive_p: the probability of the tokens drawn it steers to (< 0: off)."),
    (("--adaptive-decay",), "adaptive_decay", "adaptive-p: the decay of its moving average (0 to 0.99)."),
    (("--min-keep",), "min_keep", "The fewest tokens typical, top-p, min-p and XTC leave (0: one)."),
    (("--mirostat",), "mirostat", "Mirostat 1 or 2 in place of the other samplers and the penalties, as llama.cpp (0: off)."),
    (("--mirostat-ent",), "mirostat_tau", "Mirostat: the target surprise, tau."),
    (("--mirostat-lr",), "mirostat_eta", "Mirostat: the learning rate, eta."),
]


def generation_options(n_predict: int):
    """Drafting and sampling: shared by run, serve (as the defaults of every request) and chat."""
    return options(
        click.option("-n", "--n-predict", default=n_predict,
                     help="Tokens to generate (-1: until EOS or the context is full)."),
        click.option("--draft", "n_draft", default="auto",
                     help="Tokens drafted per step, K (0: the target alone), or 'auto' (chosen every step, 0 included)."),
        click.option("--spec-draft-n-max", "--draft-max", "draft_max", cls=RenamedOption, default=8,
                     type=click.IntRange(min=0),
                     help="Largest K for --draft auto."),
        click.option("--spec-draft-n-min", "--draft-min", "draft_min", cls=RenamedOption, default=0,
                     type=click.IntRange(min=0),
                     help="Do not verify drafts shorter than this."),
        click.option("--spec-draft-p-min", "--draft-p-min", "draft_p_min", cls=RenamedOption, default=0.0,
                     type=FiniteRange(0, 1, max_open=True), help="Stop drafting when the draft's probability of its token is below this."),
        click.option("--lookup", is_flag=True, help="Draft by n-gram lookup in the prompt and output (no draft model needed)."),
        click.option("--hybrid", is_flag=True, help="A lookup match when there is one, else the draft model."),
        click.option("--temp", "temperature", default=SamplingParams.temperature, help="Temperature (0 or -1: greedy)."),
        click.option("--top-k", default=SamplingParams.top_k, help="Top-k (0: off)."),
        click.option("--top-p", default=SamplingParams.top_p, help="Top-p (1: off)."),
        click.option("--min-p", default=SamplingParams.min_p, help="Min-p (0: off)."),
        *(click.option(*flags, name, type=type(getattr(SamplingParams, name)), default=getattr(SamplingParams, name),
                       help=text) for flags, name, text in LLAMACPP_SAMPLER_FLAGS),
        click.option("-s", "--seed", type=int, default=None, help="Sampling seed (-1: random) [default: random]."),
        *constraint_options(),
    )


def open_session(opts: dict, *, requests_choose_drafting: bool = False):
    """The Session the model options describe (consumed from `opts`); see `ggufspec.session`.

    --no-draft loads no draft model and, for run and chat, drafts nothing (K = 0). A server's requests
    choose their own drafting: there it only leaves the draft model out (a request may ask for lookup).
    With -m alone and no draft model found, drafting is by n-gram (as --lookup)."""
    from ..session import ModelOptions, open_session as open_
    apply_spec_type(opts)  # llama.cpp's --spec-type as --no-draft, -md mtp, --lookup or --hybrid
    no_draft = opts.pop("no_draft")
    opts.update(load_mode_flags(opts))
    options = ModelOptions(pair=opts.pop("pair"), model=opts.pop("model"), model_draft=opts.pop("model_draft"),
                           draft_dir=opts.pop("draft_dir"), lookup_pool=opts.pop("lookup_pool"),
                           no_draft=no_draft, n_ctx=opts.pop("n_ctx"), n_threads=opts.pop("n_threads"),
                           n_gpu_layers=opts.pop("n_gpu_layers"), n_gpu_layers_draft=opts.pop("n_gpu_layers_draft"),
                           flash_attn=opts.pop("flash_attn"), rpc=opts.pop("rpc"), rpc_timeout=opts.pop("rpc_timeout", None) or None,
                           strict=opts.pop("strict"), exact=opts.pop("exact"),
                           swa_full=opts.pop("swa_full"), n_parallel=opts.pop("parallel", 1),
                           needs_draft_model=not opts["lookup"],
                           fixed_draft=parse_draft(opts.get("n_draft", "auto")) not in ("auto", 0),
                           use_mmap=not opts.pop("no_mmap"), **{name: opts.pop(name) for name in LOAD_FLAGS},
                           lora=lora_flags(opts),
                           chat_template=chat_template_given(opts.pop("chat_template"), opts.pop("chat_template_file")))
    if no_draft and not requests_choose_drafting:
        opts["n_draft"] = "0"
    session = open_(options, log=lambda line: click.echo(line, err=True))
    if session.draft_choice["kind"] == "ngram":
        opts["lookup"], opts["hybrid"] = True, False
    return session


def chat_template_given(text: str | None, path: str | None) -> str | None:
    """--chat-template's text, or --chat-template-file's (UTF-8), one of them at most."""
    if text is not None and path is not None:
        raise GgufspecError("give --chat-template or --chat-template-file, not both")
    if path is None:
        return utf8_text("--chat-template", text)
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except UnicodeDecodeError as exc:
        raise not_utf8_file("--chat-template-file", path, exc) from None
    except OSError as exc:
        raise GgufspecError(f"--chat-template-file: {path}: {exc.strerror or exc}") from None


def template_variable_options(command):
    """--chat-template-kwargs, -rea/--reasoning and --reasoning-effort (llama.cpp's): run --chat, chat, serve."""
    return options(
        click.option("--chat-template-kwargs", "template_kwargs", default=None, metavar="JSON",
                     help="Variables for the chat template (on serve, a request's chat_template_kwargs add to "
                          "them), e.g. '{\"enable_thinking\": false}'."),
        click.option("-rea", "--reasoning", "reasoning", default="auto", metavar="[on|off|auto]",
                     type=click.Choice(["on", "off", "auto", "true", "false", "enabled", "disabled", "1", "0"]),
                     help="Thinking on or off: the template's enable_thinking (auto: as the template does)."),
        click.option("--reasoning-effort", "reasoning_effort", default="default", metavar="LEVEL",
                     help="The template's reasoning_effort (gpt-oss's: low, medium, high...; default: the "
                          "template's own)."),
    )(command)


def template_variables(text: str | None, opts: dict, chat: bool = True) -> dict:
    """--chat-template-kwargs (a JSON object), -rea/--reasoning, --reasoning-effort (consumed from `opts`)
    and --reasoning-budget 0 as the chat template's variables (a budget of 0 is also forced in the
    sampler: a template that ignores enable_thinking gets </think>). Without `chat` none may be given."""
    reasoning, effort = opts.pop("reasoning"), opts.pop("reasoning_effort")
    if not chat:
        if text is not None or reasoning != "auto" or effort != "default":
            raise GgufspecError("--chat-template-kwargs, -rea/--reasoning and --reasoning-effort are the chat "
                                "template's: give --chat too")
        return {}
    variables = {}
    if text is not None:
        try:
            variables = json.loads(utf8_text("--chat-template-kwargs", text))
        except ValueError as exc:
            raise GgufspecError(f"--chat-template-kwargs is no JSON ({exc}): give an object, e.g. "
                                "'{\"enable_thinking\": false}'") from None
        if not isinstance(variables, dict):
            raise GgufspecError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
        if not isinstance(variables.get("enable_thinking", False), bool):
            raise GgufspecError("--chat-template-kwargs: enable_thinking must be true or false")
        taken = [name for name in variables if name in RENDERER_VARIABLES]
        if taken:
            raise GgufspecError(f"--chat-template-kwargs: {taken[0]} is set by the renderer itself: leave it out")
    if reasoning != "auto":
        thinking = reasoning in ("on", "true", "enabled", "1")
        if variables.get("enable_thinking", thinking) != thinking:
            raise GgufspecError(f"-rea {reasoning} and --chat-template-kwargs' enable_thinking "
                                f"{str(variables['enable_thinking']).lower()} contradict each other: give one of them")
        variables["enable_thinking"] = thinking
    if effort != "default":
        variables["reasoning_effort"] = utf8_text("--reasoning-effort", effort)
    return {**variables, "enable_thinking": False} if opts["reasoning_budget"] == 0 else variables


LOAD_MODES = ["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"]


def load_mode_flags(load: dict) -> dict:
    """-lm/--load-mode (consumed from `load`) as --no-mmap and --mlock (llama-cpp-python's Llama takes
    those and sets llama.cpp's load mode from them); given with either of them, they must agree."""
    mode = load.pop("load_mode", None)
    if mode is None:
        return {"no_mmap": load["no_mmap"], "use_mlock": load["use_mlock"]}
    if mode == "dio":
        raise GgufspecError("--load-mode dio: llama-cpp-python's loader has no DirectIO; use none (read the file) "
                            "or mmap")
    wanted = {"no_mmap": mode in ("none", "mlock"), "use_mlock": mode in ("mlock", "mmap+mlock")}
    for flag, name in (("--no-mmap", "no_mmap"), ("--mlock", "use_mlock")):
        if load[name] and not wanted[name]:
            raise GgufspecError(f"--load-mode {mode} and {flag} contradict each other: give one of them")
    return wanted


def model_load_fields(load: dict) -> dict:
    """The load flags (bench's and eval's **load) as ModelOptions fields."""
    load = dict(load)
    flags = load_mode_flags(load)
    load.pop("no_mmap")
    adapters = lora_flags(load)
    return {**load, "lora": adapters, "use_mmap": not flags["no_mmap"], "use_mlock": flags["use_mlock"]}


# model_options' llama.cpp load flags that are ModelOptions fields of the same name
LOAD_FLAGS = ("n_batch", "n_ubatch", "n_threads_batch", "n_threads_draft", "n_threads_batch_draft", "use_mlock",
              "cache_type_k", "cache_type_v", "cache_type_k_draft", "cache_type_v_draft", "override_tensor", "cpu_moe",
              "n_cpu_moe", "override_tensor_draft", "cpu_moe_draft", "n_cpu_moe_draft") + EXTRA_LOAD_FLAGS


def rpc_timeout_option(command):
    """--rpc-timeout of run, chat and bench (serve has its own: its supervisor reloads the model)."""
    from ..rpc.faults import DEFAULT_STALL_S
    return click.option("--rpc-timeout", "rpc_timeout", type=FiniteRange(min=0), default=DEFAULT_STALL_S,
                        show_default=True, metavar="SECONDS",
                        help="With --rpc: no progress for this many seconds while generating means a hung worker "
                             "(stopped, frozen): one error line and exit code 1 instead of waiting for ever (0: "
                             "wait for ever).")(command)


def check_rpc(rpc: str | None, rpc_timeout_given: bool = False) -> None:
    """A bad --rpc fails in one line before anything loads, an empty one too (not a run that is silently
    local); --rpc-timeout alone is refused (it would watch nothing)."""
    if rpc is not None:
        from ..rpc import parse_endpoints
        parse_endpoints(rpc)
    elif rpc_timeout_given:
        raise GgufspecError("--rpc-timeout watches --rpc's workers: give --rpc too")


def rpc_timeout_given() -> bool:
    return click.get_current_context().get_parameter_source("rpc_timeout").name != "DEFAULT"


def stream_options(opts: dict) -> dict:
    """The decoder's stream() keywords from the generation options (consumed from `opts`)."""
    lookup, hybrid = opts.pop("lookup"), opts.pop("hybrid")
    if lookup and hybrid:
        raise GgufspecError("choose one of --lookup and --hybrid")
    return {"n_predict": opts.pop("n_predict"), "n_draft": parse_draft(opts.pop("n_draft")),
            "draft_max": opts.pop("draft_max"), "draft_min": opts.pop("draft_min"),
            "draft_p_min": opts.pop("draft_p_min"), "drafter": "lookup" if lookup else "hybrid" if hybrid else "model",
            "temperature": opts.pop("temperature"), "top_k": opts.pop("top_k"), "top_p": opts.pop("top_p"),
            "min_p": opts.pop("min_p"), "seed": parse_seed(opts.pop("seed")), "constraints": constraints_from(opts),
            **{name: opts.pop(name) for name in LLAMACPP_FILTERS}}


def parse_seed(seed: int | None) -> int | None:
    """-s: a fixed seed, or None (random per generation) for -1, as llama.cpp and serve's requests take it."""
    if seed is not None and seed < -1:
        raise GgufspecError(f"-s/--seed must be >= 0 (or -1 for a random one), got {seed}")
    return None if seed == -1 else seed


def parse_draft(value: str):
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise GgufspecError(f"--draft takes a number K >= 0 (0: the target alone) or 'auto', got {value!r}") from None


def check_defaults(opts: dict) -> None:
    """Sampling and draft defaults that would fail every request fail at start instead."""
    SamplingParams(opts["temperature"], opts["top_k"], opts["top_p"], opts["min_p"], parse_seed(opts["seed"]),
                   **{name: opts[name] for name in LLAMACPP_FILTERS})
    if opts.get("lookup") and opts.get("hybrid"):
        raise GgufspecError("choose one of --lookup and --hybrid")
    constraints_from(dict(opts))  # a bad bias, penalty or grammar flag (the grammar itself is parsed at load)
    n_draft = parse_draft(opts["n_draft"])
    if n_draft != "auto" and n_draft < 0:
        raise GgufspecError(f"--draft must be >= 0 (0: the target alone) or 'auto', got {n_draft}")
    check_draft_flags(opts, n_draft)
    check_batch_size(opts, n_draft)
    if opts["n_predict"] == 0 or opts["n_predict"] < -1:
        raise GgufspecError(f"-n/--n-predict must be >= 1 (or -1 for no limit), got {opts['n_predict']}")


def check_draft_flags(opts: dict, n_draft) -> None:
    """Drafting flags that contradict each other fail in one line, rather than one silently winning."""
    if opts.get("no_draft") and n_draft not in ("auto", 0):
        raise GgufspecError(f"--no-draft runs the target alone, --draft {n_draft} drafts: give one of them")
    if opts.get("no_draft") and (opts.get("lookup") or opts.get("hybrid")):
        raise GgufspecError(f"--no-draft runs the target alone, --{'lookup' if opts.get('lookup') else 'hybrid'} "
                            f"drafts: give one of them")
    largest, flag = (opts["draft_max"], "--spec-draft-n-max") if n_draft == "auto" else (n_draft, "--draft")
    if n_draft != 0 and opts["draft_min"] > largest:
        raise GgufspecError(f"--spec-draft-n-min {opts['draft_min']} is above {flag} {largest}: no draft would "
                            f"ever be verified; lower --spec-draft-n-min or raise {flag}")


def check_batch_size(opts: dict, n_draft) -> None:
    """A step verifies its K drafts and the token after them in one batch: a -b below that for the K the
    drafting flags ask is refused, rather than K silently cut to fit (-ub may be smaller: llama.cpp
    splits a batch into micro-batches)."""
    n_batch = opts.get("n_batch")
    if n_batch is None or opts.get("no_draft") or n_draft == 0:
        return
    largest, flag = (opts["draft_max"], "--spec-draft-n-max") if n_draft == "auto" else (n_draft, "--draft")
    if n_batch < largest + 1:
        raise GgufspecError(f"-b {n_batch} is smaller than a step verifies at once ({flag} {largest} drafts and "
                            f"the token after them: {largest + 1}): raise -b to {largest + 1} or lower {flag}")


def read_prompt(prompt: str | None, prompt_file, escape: bool) -> str:
    if prompt is not None and prompt_file is not None:
        raise GgufspecError("give the prompt with -p or -f, not both")
    text = _read_file(prompt_file) if prompt_file is not None else utf8_text("-p/--prompt", prompt)
    if text is None:
        raise GgufspecError("no prompt: give one with -p TEXT or -f FILE")
    if prompt_file is not None and not text:
        raise GgufspecError(f"-f {prompt_file.name}: the file is empty: write the prompt in it, or give -p TEXT")
    return process_escapes(text) if escape else text


def _read_file(prompt_file) -> str:
    try:
        return prompt_file.read()
    except UnicodeDecodeError as exc:
        raise not_utf8_file("-f/--file", prompt_file.name, exc) from None


def process_escapes(text: str) -> str:
    """llama.cpp's -e (common's string_process_escapes): \\n \\r \\t \\' \\" \\\\, and \\xHH as one raw byte (so
    \\xC3\\xA9 is "é"); any other backslash pair, \\x without two hex digits included, stays as written."""
    simple = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}

    def replace(match):
        body = match.group(1)
        if len(body) == 3:  # x and two hex digits
            return bytes([int(body[1:], 16)])
        return simple.get(body, b"\\" + body)
    raw = re.sub(rb"\\(x[0-9a-fA-F]{2}|.)", replace, text.encode("utf-8"), flags=re.DOTALL)
    return raw.decode("utf-8", errors="replace")  # bytes that are no UTF-8 text: U+FFFD, as a terminal shows them
