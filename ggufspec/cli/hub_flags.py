"""llama.cpp's model-download flags (common/arg.cpp), by its names: -hf/-hff for the target, -hfd for the
draft, -hft, -mu, --offline, and -dr refused. Each becomes the reference -m/-md already take, so that
the model is fetched where and as -m's references are (`store.resolve_model_arg`: into ggufspec's
store, verified, resumable) and a pasted llama.cpp command line fetches what llama.cpp would:

    -hf USER/MODEL:QUANT        -> -m USER/MODEL:QUANT (the one model the tag names)
    -hf USER/MODEL              -> -m hf://USER/MODEL (its Q4_K_M, else Q8_0, else its first model)
    -hf USER/MODEL -hff FILE    -> -m hf://USER/MODEL/FILE (the file overrides the quant, as in llama.cpp)
    -hfd USER/MODEL[:QUANT]     -> -md as -hf does for -m; -md FILE with it names the draft's file in that
                                   repository, as llama.cpp's -md does with -hfd (it has no -hffd)
    -mu URL                     -> -m URL (`urlmodels`)

-hft is the token huggingface_hub sends (HF_TOKEN, for this process and any it starts); --offline is
huggingface_hub's offline mode (HF_HUB_OFFLINE): only what the store holds, none of it asked for.
"""
from __future__ import annotations

import functools
import os

import click

from ..errors import GgufspecError
from .app import fail, utf8_text
from .presets import apply_presets, preset_options

REPO_FORM = "<user>/<model>[:quant]"
HUB_PARAMS = {"hf_repo": "-hf", "hf_file": "-hff", "hf_repo_draft": "-hfd", "hf_token": "-hft", "model_url": "-mu",
              "offline": "--offline", "docker_repo": "-dr"}
DOCKER = ("-dr/--docker-repo is not supported: ggufspec fetches models from the Hugging Face Hub or a URL, not "
          "Docker Hub; give the model's GGUF repository with -hf <user>/<model>[:quant], or its file's URL with -mu")


def hub_flag_options(presets: bool = False) -> list:
    """The download flags' options, and the decorator that turns them into -m/-md before the command runs;
    with `presets` (run, chat, serve) llama.cpp's preset flags too (`presets`: applied first, as -hf...)."""
    return [
        click.option("-hf", "-hfr", "--hf-repo", "hf_repo", default=None, metavar=REPO_FORM,
                     help="The target from the Hugging Face Hub, pulled into ggufspec's store (verified, resumable); "
                          "the quant is case-insensitive [default: Q4_K_M, else Q8_0, else the first model file]."),
        click.option("-hff", "--hf-file", "hf_file", default=None, metavar="FILE",
                     help="The file in -hf's repository (overrides -hf's quant)."),
        click.option("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", "hf_repo_draft", default=None,
                     metavar=REPO_FORM, help="-hf for the draft model; -md FILE with it names the file in that "
                                             "repository, as in llama.cpp."),
        click.option("-hft", "--hf-token", "hf_token", default=None, metavar="TOKEN",
                     help="Hugging Face access token for downloads [default: HF_TOKEN, else `hf auth login`'s]; it "
                          "goes to the hub only."),
        click.option("-mu", "--model-url", "model_url", default=None, metavar="URL",
                     help="The target as a GGUF file's http(s) URL, downloaded into ggufspec's store (resumable)."),
        click.option("--offline", "offline", is_flag=True,
                     help="No network: only models already in ggufspec's store (huggingface_hub's HF_HUB_OFFLINE)."),
        click.option("-dr", "--docker-repo", "docker_repo", default=None, hidden=True),
        *(preset_options() if presets else []),
        with_hub_flags,
    ]


def with_hub_flags(command):
    """`command` with the preset flags, then the download flags (consumed from its keywords) applied first:
    its -m/-md (and serve's --alias) set from them. A bad or contradictory flag is one line and exit code 2."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            apply_presets(kwargs)  # none on bench and eval
            apply_hub_flags(kwargs)
        except GgufspecError as exc:
            fail(str(exc), exc.exit_code)
        return command(*args, **kwargs)
    return wrapper


def apply_hub_flags(opts: dict) -> None:
    given = {name: opts.pop(name) for name in HUB_PARAMS}
    if given["docker_repo"] is not None:
        raise GgufspecError(DOCKER)
    for name, flag in HUB_PARAMS.items():
        if isinstance(given[name], str) and not utf8_text(flag, given[name]).strip():
            raise GgufspecError(f"{flag} is empty: give {'a token' if name == 'hf_token' else 'what it names'}, or "
                                f"leave {flag} out")
    if given["hf_token"] is not None:
        os.environ["HF_TOKEN"] = given["hf_token"]  # huggingface_hub reads it per request, as a child process does
    if given["offline"]:
        from ..huberrors import go_offline
        go_offline()
    target = _target(given, opts)
    if target is not None:
        opts["model"] = target
    if given["hf_repo_draft"] is not None:
        opts["model_draft"] = _draft(given["hf_repo_draft"], opts)
    if given["hf_repo"] is not None and "alias" in opts and opts["alias"] is None:
        opts["alias"] = given["hf_repo"]  # llama-server's name for an -hf model (common_params_model::get_name)


def _target(given: dict, opts: dict) -> str | None:
    """-hf (with -hff) or -mu as -m's reference; None when neither is given."""
    named = [flag for flag, value in (("-m", opts.get("model")), ("-hf", given["hf_repo"]),
                                      ("-mu", given["model_url"])) if value is not None]
    if len(named) > 1:
        raise GgufspecError(f"{named[0]} and {named[1]} both name the target model: give one of them")
    if given["hf_file"] is not None and given["hf_repo"] is None:
        raise GgufspecError("-hff names a file in -hf's repository: give -hf <user>/<model> too (or the file alone "
                            "as -m hf://<user>/<model>/FILE.gguf)")
    if named and named[0] != "-m" and opts.get("pair") is not None:
        raise GgufspecError(f"give a PAIR name or {named[0]}, not both")
    if given["model_url"] is not None:
        return _checked_url(given["model_url"])
    if given["hf_repo"] is not None:
        return hub_reference("-hf", given["hf_repo"], given["hf_file"], "-hff")
    return None


def _draft(value: str, opts: dict) -> str:
    """-hfd (with -md as its file) as -md's reference."""
    from ..speculate import MTP
    if opts.get("pair") is not None:
        raise GgufspecError("a PAIR name brings its own draft: give the target with -m or -hf to draft with -hfd")
    if opts.get("model") is None:
        raise GgufspecError("-hfd is the draft for a target: give the target with -m, -hf or -mu too")
    if opts.get("model_draft") == MTP:
        raise GgufspecError("-md mtp drafts with the target's MTP heads, -hfd with a draft model: give one of them")
    return hub_reference("-hfd", value, opts.get("model_draft"), "-md")


def hub_reference(flag: str, value: str, file: str | None, file_flag: str) -> str:
    """<user>/<model>[:quant] (and the file in it, when given) as the reference -m takes."""
    from ..hubnames import unsafe_file_reason, unsafe_repo_reason
    from ..hubrefs import HF_SHORTHAND
    repo, colon, quant = value.partition(":")
    if reason := unsafe_repo_reason(repo):
        raise GgufspecError(f"{flag} {value}: not {REPO_FORM} ({reason}); e.g. {flag} "
                            f"ggml-org/gemma-3-1b-it-GGUF:Q4_K_M")
    if colon and not HF_SHORTHAND.match(value):
        raise GgufspecError(f"{flag} {value}: the quant after the ':' must be a tag such as Q4_K_M")
    if file is None:
        return value if colon else f"hf://{repo}"
    if reason := unsafe_file_reason(file):
        raise GgufspecError(f"{file_flag} {file} with {flag}: not a file name in {repo} ({reason})")
    if not file.endswith(".gguf"):
        raise GgufspecError(f"{file_flag} {file} with {flag}: not a .gguf file; name the GGUF file in {repo}")
    return f"hf://{repo}/{file}"


def _checked_url(url: str) -> str:
    """-mu's URL, checked before anything is asked of its server."""
    from ..urlmodels import entry_from_url
    try:
        entry_from_url(url)
    except GgufspecError as exc:
        raise GgufspecError(f"-mu: {exc}") from None
    return url
