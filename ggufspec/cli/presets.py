"""llama.cpp's preset flags (common/arg.cpp, "presets": --fim-qwen-7b-spec, --gpt-oss-20b-default,
--spec-default...) as the ggufspec flags they amount to, so that a pasted llama-server or llama-cli
command line starts the same models with the same settings:

    --fim-qwen-7b-spec   -> -hf ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF -hff qwen2.5-coder-7b-q8_0.gguf
                            -hfd ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF -md qwen2.5-coder-0.5b-q8_0.gguf
                            --port 8012 -b 1024 -ub 1024 -c 0
    --spec-default       -> --spec-type ngram-mod (with a draft model: draft-simple,ngram-mod, --hybrid)

A flag given on the command line wins over the preset's value for it, wherever it stands (llama.cpp
applies argv in order: a flag before the preset loses there). A preset names the target: given with
PAIR, -m, -hf, -hff or -mu, or with another model preset, it is refused (llama.cpp would let the later
one win, with the other's file name left over), as is a preset llama.cpp does not have on the command
(its fim presets are llama-server's) and the presets for what ggufspec does not serve: images
(--vision-*) and embeddings (--embd-gemma-default). What a preset sets that ggufspec does its own
way is left out and said in --help: llama.cpp's --cache-reuse 256 (ggufspec reuses the prefix a slot
holds, never KV-shifted chunks), --jinja (ggufspec always renders with Jinja), --spec-default's
ngram-mod sizes (ggufspec's lookup sizes its n-grams itself)."""
from __future__ import annotations

from dataclasses import dataclass

import click

from ..errors import GgufspecError
from .spec_type import NGRAM_KINDS
from .unsupported_flags import NO_EMBEDDINGS, NO_MEDIA

SERVE, EVERY = ("serve",), ("serve", "run", "chat")  # llama.cpp's LLAMA_EXAMPLE_SERVER; with LLAMA_EXAMPLE_CLI
FLAGS = {"n_ctx": "-c", "n_batch": "-b", "n_ubatch": "-ub", "port": "--port", "parallel": "-np",
         "temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}
TARGET_FLAGS = (("pair", "PAIR"), ("model", "-m"), ("hf_repo", "-hf"), ("hf_file", "-hff"), ("model_url", "-mu"))
CACHE_REUSE = "llama.cpp's --cache-reuse 256 left out: ggufspec reuses the prefix a slot holds itself"
JINJA = "--jinja: ggufspec always renders with Jinja"


@dataclass(frozen=True)
class Preset:
    flag: str
    what: str                                   # llama.cpp's description
    commands: tuple[str, ...] = SERVE           # where llama.cpp has it
    target: tuple[str, str | None] | None = None  # (Hub repository, file in it; None: -hf's default quant)
    draft: tuple[str, str] | None = None        # the same for the draft model
    settings: tuple = ()                        # (param, value) on every command
    on_serve: tuple = ()                        # (param, value) on serve only
    one_sequence: tuple = ()                    # (param, value) on run and chat only
    note: str = ""                              # what it sets that ggufspec does its own way
    refused: str | None = None                  # why ggufspec has no such thing

    @property
    def param(self) -> str:
        return "preset_" + self.flag.lstrip("-").replace("-", "_").replace(".", "_")


def _fim(size: str, draft: bool = False, name: str | None = None, file: str | None = None) -> Preset:
    """llama.cpp's Qwen Coder FIM presets: one server on port 8012, the model's own context."""
    name = name or f"Qwen2.5-Coder-{size.upper()}-Q8_0-GGUF"
    file = file or f"qwen2.5-coder-{size}-q8_0.gguf"
    coder = "Qwen 3 Coder 30B A3B Instruct" if size == "30b" else f"Qwen 2.5 Coder {size.upper()}"
    return Preset(f"--fim-qwen-{size}-{'spec' if draft else 'default'}",
                  f"{coder} + 0.5B draft" if draft else coder, SERVE, (f"ggml-org/{name}", file),
                  ("ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF", "qwen2.5-coder-0.5b-q8_0.gguf") if draft else None,
                  settings=(("n_batch", 1024), ("n_ubatch", 1024), ("n_ctx", 0)), on_serve=(("port", 8012),),
                  note=CACHE_REUSE)


def _gpt_oss(size: str, file: str | None) -> Preset:
    """llama.cpp's gpt-oss presets: two slots of the model's 131072 tokens each, its sampling settings."""
    return Preset(f"--gpt-oss-{size}-default", f"gpt-oss-{size}", EVERY, (f"ggml-org/gpt-oss-{size}-GGUF", file),
                  settings=(("n_batch", 32768), ("n_ubatch", 2048), ("temperature", 1.0), ("top_p", 1.0),
                            ("top_k", 0), ("min_p", 0.01)),
                  on_serve=(("port", 8013), ("parallel", 2), ("n_ctx", 131072 * 2)),
                  one_sequence=(("n_ctx", 131072),),  # llama-cli's -c 262144 -np 2: one sequence's share
                  note=JINJA)


def _vision(size: str) -> Preset:
    repo = f"ggml-org/gemma-3-{size}-it-qat-GGUF"
    return Preset(f"--vision-gemma-{size}-default", f"Gemma 3 {size.upper()} QAT", EVERY, (repo, None),
                  refused=f"{NO_MEDIA}; for its text alone give -hf {repo} -c 0")


PRESETS = (
    Preset("--embd-gemma-default", "EmbeddingGemma", SERVE, refused=NO_EMBEDDINGS),
    _fim("1.5b"), _fim("3b"), _fim("7b"), _fim("7b", draft=True), _fim("14b", draft=True),
    _fim("30b", name="Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF", file="qwen3-coder-30b-a3b-instruct-q8_0.gguf"),
    _gpt_oss("20b", "gpt-oss-20b-mxfp4.gguf"), _gpt_oss("120b", None),
    _vision("4b"), _vision("12b"),
    Preset("--spec-default", "llama.cpp's default speculative decoding", EVERY),
)
SPEC_DEFAULT = PRESETS[-1]


class PresetOption(click.Option):
    """A preset's flag: its --help says what it amounts to on the command at hand; hidden where it is
    refused (as ggufspec's other refused flags are) and where llama.cpp lacks it (its fim presets on
    run and chat: refused there too, naming `ggufspec serve`)."""

    def __init__(self, param_decls, preset: Preset, **attrs):
        super().__init__(param_decls, **attrs)
        self.preset = preset

    def get_help_record(self, ctx):
        if self.preset.refused or ctx.command.name not in self.preset.commands:
            return None
        self.help = preset_help(self.preset, ctx.command.name)
        return super().get_help_record(ctx)


def preset_options() -> list:
    return [click.option(preset.flag, preset.param, cls=PresetOption, preset=preset, is_flag=True, default=False)
            for preset in PRESETS]


def preset_help(preset: Preset, command: str) -> str:
    if preset is SPEC_DEFAULT:
        return ("llama.cpp's default speculative decoding: --spec-type ngram-mod, n-gram lookup (with a draft model: "
                "--hybrid; its ngram-mod sizes are not ggufspec's knobs: its lookup sizes n-grams itself); a "
                "drafting flag given wins.")
    note = f"; {preset.note}" if preset.note else ""
    if command != "serve" and preset.one_sequence:
        served = dict(preset.on_serve)
        note += f"; -c {dict(preset.one_sequence)['n_ctx']}: one sequence's share of its -c {served['n_ctx']} " \
                f"-np {served['parallel']}"
    return (f"llama.cpp's preset: {preset.what} from the Hugging Face Hub, as {equivalent(preset, command)} (flags "
            f"given win; not with -m/-hf{note}).")


def equivalent(preset: Preset, command: str) -> str:
    """The ggufspec flags `preset` amounts to on `command`."""
    repo, file = preset.target
    words = ["-hf", repo] + (["-hff", file] if file else [])
    if preset.draft:
        words += ["-hfd", preset.draft[0], "-md", preset.draft[1]]
    return " ".join(words + [settings_flags(preset, command)])


def settings_flags(preset: Preset, command: str) -> str:
    """The flags for `preset`'s settings on `command`, without its models."""
    return " ".join(f"{FLAGS[param]} {value:g}" if isinstance(value, float) else f"{FLAGS[param]} {value}"
                    for param, value in _settings(preset, command))


def _settings(preset: Preset, command: str) -> tuple:
    """(param, value) of `preset` on `command`: serve's port and slots on serve only (run and chat
    generate one sequence, on no port)."""
    return preset.settings + (preset.on_serve if command == "serve" else preset.one_sequence)


def explicit_params(ctx: click.Context) -> set[str]:
    """The parameters given on the command line (or by an environment variable), not left at their default."""
    sources = {name: ctx.get_parameter_source(name) for name in ctx.params}
    return {name for name, source in sources.items()
            if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")}


def apply_presets(opts: dict, command: str | None = None, given: set[str] | None = None) -> None:
    """The preset flags (consumed from `opts`) as the flags they amount to, set in `opts` where the
    command line did not give them (`given`: the parameters it did; by default click's current
    context says). Before the download flags turn -hf/-hfd into -m/-md."""
    if SPEC_DEFAULT.param not in opts:
        return  # a command without presets (bench, eval)
    chosen = [preset for preset in PRESETS if opts.pop(preset.param)]
    if not chosen:
        return
    if command is None or given is None:
        ctx = click.get_current_context()
        command, given = ctx.command.name, explicit_params(ctx)
    for preset in chosen:
        _check_usable(preset, command)
    models = [preset for preset in chosen if preset.target]
    if len(models) > 1:
        raise GgufspecError(f"{models[0].flag} and {models[1].flag} each name a model: give one preset")
    if models:
        _apply_model(models[0], opts, command, given)
    if SPEC_DEFAULT in chosen:
        _apply_spec_default(opts)


def _check_usable(preset: Preset, command: str) -> None:
    if preset.refused:
        raise GgufspecError(f"{preset.flag} is not supported: {preset.refused}")
    if command not in preset.commands:
        raise GgufspecError(f"{preset.flag} is llama-server's preset: use it with `ggufspec serve`, or give what it "
                            f"amounts to here: {equivalent(preset, command)}")


def _apply_model(preset: Preset, opts: dict, command: str, given: set[str]) -> None:
    for param, flag in TARGET_FLAGS:
        if opts.get(param) is not None:
            raise GgufspecError(f"{preset.flag} names the target model ({preset.target[0]}) and {flag} another: "
                                f"give one of them (for {flag}'s model with the preset's settings, give them as "
                                f"flags: {settings_flags(preset, command)})")
    opts["hf_repo"], opts["hf_file"] = preset.target
    if preset.draft and _takes_the_presets_draft(opts):
        opts["hf_repo_draft"], opts["model_draft"] = preset.draft  # -md FILE with -hfd: the file in it
    for param, value in _settings(preset, command):
        if param not in given:
            opts[param] = value


def _takes_the_presets_draft(opts: dict) -> bool:
    """A -spec preset's draft model, unless the command line names its own (-md, -hfd) or drafts with
    none: --no-draft, --lookup, a --spec-type without draft-simple."""
    if opts.get("model_draft") is not None or opts.get("hf_repo_draft") is not None:
        return False
    if opts.get("no_draft") or opts.get("lookup"):
        return False
    return opts.get("spec_type") is None or "draft-simple" in _kinds(opts["spec_type"])


def _apply_spec_default(opts: dict) -> None:
    """--spec-default: llama.cpp adds ngram-mod to its speculative types; here n-gram lookup as --spec-type
    ngram-mod, and with a draft model both (--hybrid). A drafting choice given stands: --no-draft, --lookup
    and --hybrid as they are, a --spec-type with ngram-mod added unless it is none or has an n-gram kind."""
    if opts.get("no_draft") or opts.get("lookup") or opts.get("hybrid"):
        return
    spec_type = opts.get("spec_type")
    if spec_type is not None:
        kinds = _kinds(spec_type)
        if "none" not in kinds and not any(kind in NGRAM_KINDS for kind in kinds):
            opts["spec_type"] = f"{spec_type},ngram-mod"
        return
    with_model = opts.get("model_draft") is not None or opts.get("hf_repo_draft") is not None
    opts["spec_type"] = "draft-simple,ngram-mod" if with_model else "ngram-mod"


def _kinds(spec_type: str) -> list[str]:
    return [kind.strip() for kind in spec_type.split(",") if kind.strip()]
