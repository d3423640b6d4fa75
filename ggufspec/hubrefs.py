"""Hub references outside the registry: `hf://OWNER/REPO/FILE.gguf`, llama.cpp's `OWNER/REPO:QUANT`,
and `hf://OWNER/REPO` (llama.cpp's -hf OWNER/REPO without a tag: its Q4_K_M, else its Q8_0, else its
first model).

How a reference is parsed, how a split GGUF's shards are named, and which file of a listing a quant
tag (or none) names: in the hub's listing, or in the files the store holds when the hub cannot be
asked (offline mode, unreachable), as huggingface_hub and llama.cpp's -hf fall back to their caches.
"""
from __future__ import annotations

import re
import sys

from .errors import BadReferenceError, StoreError, UnsafeNameError
from .registry import ModelEntry
from .urlmodels import entry_from_url, is_url
from .huberrors import HubUnreachable, endpoint, hub_errors, offline_mode
from .hubnames import MAX_LISTING, stored_names, unsafe_file_reason, unsafe_repo_reason
from .hubnames import SPLIT_SHARD, first_shard, shard_names, with_shards  # noqa: F401  (hubrefs.shard_names)

HF_URL = re.compile(r"^hf://(?P<repo>[^/\s]+/[^/\s]+)/(?P<file>\S+\.gguf)$")
HF_REPO = re.compile(r"^hf://(?P<repo>[^/\s:]+/[^/\s:]+)$")  # the repository's default model
HF_SHORTHAND = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+):(?P<quant>[\w.-]+)$")
# a file's path as the hub's web pages show it: OWNER/REPO/blob/REV/FILE, OWNER/REPO/resolve/REV/FILE
WEB_PAGE_PATH = re.compile(r"^(?P<kind>blob|resolve)/(?P<revision>[^/]+)/(?P<file>.+\.gguf)$")
LOOKS_LIKE_SHORTHAND = re.compile(r"^[^/\s:]+/[^/\s:]+:")  # OWNER/REPO:... whatever follows
# a word of a file name that looks like a quantization: Q4_K_M, IQ4_XS, Q8_0, TQ1_0, F16, BF16, F32, MXFP4
QUANT_WORD = re.compile(r"(?i)(?:I?Q|TQ)\d(?:_[0-9A-Z]+)*|B?F16|F32|MXFP4(?:_MOE)?")
MAX_NAMED = 12  # candidates or quants named in one error line
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's -hf without a tag (common/download.cpp's find_best_model)
# GGUF files of a repository that are no model to run: llama.cpp's gguf_filename_is_model leaves them out
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


class NoSuchQuant(StoreError):
    """No model of a listing has the quant tag asked for."""


def check_reference(ref: str, repo: str, file: str | None = None) -> None:
    if reason := unsafe_repo_reason(repo):
        raise BadReferenceError(f"{ref!r}: the repository id {repo!r} is invalid ({reason})")
    if file is not None and (reason := unsafe_file_reason(file)):
        raise BadReferenceError(f"{ref!r}: the file name {file!r} is refused ({reason})")


def repo_files(repo: str) -> list[str]:
    """The hub's listing of a repository (HubUnreachable when it cannot be asked)."""
    return checked_listing(repo, _hub_listing(repo))


def _hub_listing(repo: str) -> list[str]:
    """The names the hub lists, unchecked; a StoreError where the hub did not answer with a listing."""
    # model_info is one request, made once: an unreachable hub fails at once, where the paginated
    # tree listing (list_repo_files) retries with backoff for half a minute first
    from huggingface_hub import HfApi
    with hub_errors(repo):
        info = HfApi(endpoint=endpoint()).model_info(repo)
        return [s.rfilename for s in info.siblings or []]


def checked_listing(repo: str, names: list[str]) -> list[str]:
    """A repository's file names as the hub listed them, refused whole if any could not be stored."""
    if len(names) > MAX_LISTING:
        raise StoreError(f"{repo}: the hub at {endpoint()} lists {len(names)} files (more than {MAX_LISTING}); "
                         f"refusing the listing, nothing was written")
    for name in names:
        if reason := unsafe_file_reason(name):
            raise UnsafeNameError(f"{repo}: the hub at {endpoint()} lists a file named {name!r}, refused "
                                  f"({reason}); nothing was written")
    return names


def _models_in(repo: str, names: list[str]) -> list[str]:
    """The GGUF models of a listing, each by its first file (a split model once), projectors, importance
    matrices and draft heads left out."""
    return sorted({first_shard(n) for n in names
                   if n.endswith(".gguf") and not any(word in n.lower() for word in NOT_MODELS)})


def _tagged(quant: str) -> re.Pattern:
    # the tag as a whole word of the path, as llama.cpp's -hf repo:TAG means it: Q4_K_M is not IQ4_K_M
    return re.compile(rf"(?:^|[-._/]){re.escape(quant)}(?:[-._/]|$)", re.IGNORECASE)


def quants_of(repo: str, names: list[str]) -> list[str]:
    """The quantizations a listing holds, as tags (a model whose name has none: its file name)."""
    found = set()
    for model in _models_in(repo, names):
        words = [w for w in re.split(r"[-./]", SPLIT_SHARD.sub("", model)) if QUANT_WORD.fullmatch(w)]
        found.add(words[-1] if words else model)
    return sorted(found)


def quant_files(repo: str, quant: str, names: list[str], where: str) -> tuple[str, ...]:
    """The files of the one model in `names` whose path has `quant` as a whole word (case-insensitive).

    `where` says whose listing it is (the hub's, the store's) for the error lines."""
    tagged = _tagged(quant)
    matches = [m for m in _models_in(repo, names) if tagged.search(m)]
    if len(matches) == 1:
        return with_shards(repo, matches[0])
    if matches:
        named = ", ".join(matches[:MAX_NAMED]) + (", ..." if len(matches) > MAX_NAMED else "")
        raise BadReferenceError(f"{repo}:{quant} is ambiguous, {len(matches)} models in {where} match it ({named}): "
                                f"name one as hf://{repo}/FILE.gguf, or give the whole quant tag")
    have = quants_of(repo, names)
    listed = ", ".join(have[:MAX_NAMED]) + (", ..." if len(have) > MAX_NAMED else "")
    raise NoSuchQuant(f"{repo}: no .gguf file in {where} is quantized {quant!r}"
                     + (f"; it has {listed}" if have else "; it holds no .gguf file"))


def default_files(repo: str, names: list[str], where: str) -> tuple[str, ...]:
    """The model llama.cpp's -hf OWNER/REPO takes without a tag: its Q4_K_M, else its Q8_0 (each as a
    tag names one), else its first model by name."""
    for quant in DEFAULT_QUANTS:
        try:
            return quant_files(repo, quant, names, where)
        except NoSuchQuant:
            continue
    models = _models_in(repo, names)
    if not models:
        raise NoSuchQuant(f"{repo}: {where} holds no .gguf model file")
    return with_shards(repo, models[0])


def model_files(repo: str, quant: str | None) -> tuple[str, ...]:
    """The files a quant tag (None: the default) names: in the hub's listing, or, when the hub gives
    none (unreachable, failing, rate-limiting, a captive portal's page, a token refused), among the
    files of the repository in the store, with a warning, as hf_hub_download falls back to its cache.
    Only with no match there is the hub's failure raised."""
    def choose(names: list[str], where: str) -> tuple[str, ...]:
        return quant_files(repo, quant, names, where) if quant else default_files(repo, names, where)
    try:
        names = _hub_listing(repo)
    except StoreError as failure:
        try:
            files = choose(stored_names(repo), "the store (the hub cannot be asked)")
        except NoSuchQuant:
            raise failure from None
        if not (isinstance(failure, HubUnreachable) and offline_mode()):  # offline mode asks for just this
            print(f"ggufspec: warning: {failure}; using {repo}/{files[0]} from the store", file=sys.stderr)
        return files
    return choose(checked_listing(repo, names), "the repository")


def entry_from_reference(ref: str) -> ModelEntry | None:
    """`hf://OWNER/REPO/FILE.gguf`, llama.cpp's `OWNER/REPO:QUANT`, `hf://OWNER/REPO` (its default
    model) or an http(s) URL (`urlmodels`) as an ad-hoc model entry.

    None when `ref` is none of them; BadReferenceError when it is meant as one but is malformed."""
    if is_url(ref):
        return entry_from_url(ref)
    if m := HF_REPO.match(ref):
        check_reference(ref, m["repo"])
        return ModelEntry(ref, m["repo"], model_files(m["repo"], None))
    if ref.startswith("hf://"):
        m = HF_URL.match(ref)
        if not m:
            raise BadReferenceError(f"{ref!r} is not a hub file reference: use hf://OWNER/REPO/FILE.gguf (or "
                                    f"hf://OWNER/REPO: its Q4_K_M, else Q8_0, else first model)")
        if web := WEB_PAGE_PATH.match(m["file"]):  # copied from the browser's address bar
            main = "" if web["revision"] == "main" else " (hf:// takes the main revision)"
            raise BadReferenceError(f"{ref!r} holds the web page's /{web['kind']}/{web['revision']}/: give "
                                    f"hf://{m['repo']}/{web['file']}{main}")
        check_reference(ref, m["repo"], m["file"])
        return ModelEntry(ref, m["repo"], with_shards(m["repo"], m["file"]))
    if m := HF_SHORTHAND.match(ref):
        check_reference(ref, m["repo"])
        return ModelEntry(ref, m["repo"], model_files(m["repo"], m["quant"]))
    if LOOKS_LIKE_SHORTHAND.match(ref):
        raise BadReferenceError(f"{ref!r} is not a hub reference: use OWNER/REPO:QUANT (e.g. "
                                f"bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M)")
    return None


def hub_form_hint(name: str) -> str:
    """For a name that is no reference but reads as a hub repository (OWNER/REPO) or a file of one
    (OWNER/REPO/FILE.gguf): ': give ...' naming the form that works; '' otherwise."""
    repo, _, file = name.partition("/")[2].partition("/")
    repo = f"{name.partition('/')[0]}/{repo}"
    if unsafe_repo_reason(repo):
        return ""
    if not file:
        return (f": for the hub repository give hf://{repo} (its Q4_K_M, else Q8_0, else first model) or "
                f"{repo}:QUANT (e.g. {repo}:Q4_K_M)")
    file = web["file"] if (web := WEB_PAGE_PATH.match(file)) else file
    if file.endswith(".gguf") and not unsafe_file_reason(file):
        return f": for the hub's file give hf://{repo}/{file}"
    return ""
