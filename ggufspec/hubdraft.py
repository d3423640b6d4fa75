"""A draft for a hub target, found on the hub (`ggufspec pull hf://OWNER/REPO/FILE.gguf --with-draft`).

Candidates: the other .gguf files of the target's repository, then those of the repositories of the
same family (the repository name up to its size, e.g. `Qwen2.5-Coder` of `Qwen2.5-Coder-7B-Instruct-GGUF`)
that the registry names or that the hub lists under the same owner. A candidate must be at least
MIN_SIZE_RATIO times smaller than the target (sizes from the hub's listing) and its tokenizer
fingerprint must match the target's: both read from the GGUF headers with Range requests for the
first bytes of each file (more when a header is longer), so nothing large is downloaded to decide.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import GgufspecError, StoreError
from .finddraft import MIN_SIZE_RATIO
from .fingerprint import Fingerprint, HeaderCutShort, describe, differences, fingerprint_of_bytes
from .hubrefs import first_shard, shard_names
from .registry import ModelEntry, load_registry
from . import store

FIRST_BYTES = 1 << 20          # of a header read; grown 4x while the header is longer
MAX_HEADER_BYTES = 256 << 20   # a header longer than this is not read
MAX_PROBED = 12                # candidate headers read per search
MAX_LISTED_REPOS = 30          # same-family repositories asked for their files
SIZE = re.compile(r"[-_.](\d+(?:\.\d+)?)[BbMm](?=$|[-_.])")


@dataclass
class HubDraft:
    """The outcome of a search: the chosen draft (an entry to pull) and why, or why none."""

    target: str
    draft: ModelEntry | None = None
    why: str = ""
    skipped: list[dict] = field(default_factory=list)   # {"model": ref, "reason": ...}

    def as_dict(self) -> dict:
        return {"target": self.target, "chosen": self.draft.name if self.draft else None, "why": self.why,
                "skipped": self.skipped}

    def line(self) -> str:
        if self.draft is None:
            return f"no draft on the hub for {self.target}: {self.why}"
        return f"draft for {self.target}: {self.draft.name}: {self.why}"


def family(repo: str) -> str:
    """A repository name up to its parameter count (`Qwen2.5-Coder` of `Qwen/Qwen2.5-Coder-7B-GGUF`),
    or without a -GGUF ending when it names none."""
    name = repo.split("/")[-1]
    if m := SIZE.search(name):
        return name[:m.start()]
    return re.sub(r"[-_.]?gguf$", "", name, flags=re.I)


def ref(repo: str, file: str) -> str:
    return f"hf://{repo}/{file}"


def find_draft(target: ModelEntry, registry=None) -> HubDraft:
    """Search the hub for a draft of `target` (a hub entry); reads headers only."""
    name = ref(target.repo, target.first_file)
    remote = store.remote_files(target)
    target_size = sum(r.size or 0 for r in remote)
    target_print, target_header = _remote_fingerprint(remote[0].url, remote[0].size, name)
    result = HubDraft(name)
    candidates = _candidates(target, registry or load_registry())
    small = [(repo, files, size) for repo, files, size in candidates
             if size and size * MIN_SIZE_RATIO <= target_size]
    too_big = len(candidates) - len(small)
    # the largest that is small enough first: it accepts the most for a cost the ratio bounds
    small.sort(key=lambda c: (-c[2], c[0] != target.repo, c[1][0]))
    for repo, files, size in small[:MAX_PROBED]:
        candidate = ModelEntry(ref(repo, files[0]), repo, files)
        try:
            found = store.remote_files(ModelEntry(candidate.name, repo, files[:1]))[0]
            draft_print, draft_header = _remote_fingerprint(found.url, found.size, candidate.name)
        except GgufspecError as exc:
            result.skipped.append({"model": candidate.name, "reason": f"header not read ({exc})"})
            continue
        if why_not := differences(target_print, draft_print, target_header, draft_header):
            result.skipped.append({"model": candidate.name, "reason": "tokenizer differs: " + "; ".join(why_not)})
            continue
        result.draft = candidate
        result.why = (f"its tokenizer matches the target's ({describe(draft_print)}, read from the GGUF headers) "
                      f"and it is {target_size / size:.1f}x smaller ({store.human_size(size)} vs "
                      f"{store.human_size(target_size)})")
        return result
    result.why = _none_reason(len(candidates), too_big, result.skipped, target_print)
    return result


def _none_reason(n_candidates: int, too_big: int, skipped: list, target_print: Fingerprint) -> str:
    if not n_candidates:
        return "no other .gguf file in the repository or in repositories of the same family"
    parts = []
    if too_big:
        parts.append(f"{too_big} candidate(s) not {MIN_SIZE_RATIO:g}x smaller than the target")
    if skipped:
        parts.append(f"{len(skipped)} with another tokenizer than the target's ({describe(target_print)}) "
                     f"or an unreadable header")
    return "; ".join(parts) + " (run uses n-gram drafting without a draft model)"


def _candidates(target: ModelEntry, registry) -> list[tuple[str, tuple[str, ...], int | None]]:
    """(repo, files, total size) of each .gguf model in the target's repository and its family's,
    the target excluded; a split model once, by its shards."""
    found, keys = [], set()
    for repo in _family_repos(target.repo, registry):
        try:
            sizes = _repo_sizes(repo)
        except StoreError:
            if repo == target.repo:
                raise
            continue  # a family repository that cannot be listed: not a candidate
        for file in sorted(sizes):
            if not file.endswith(".gguf") or "mmproj" in file.lower():
                continue
            if first_shard(file) != file or (repo, file) in keys or (repo == target.repo and file in target.files):
                continue
            keys.add((repo, file))
            if not all(f in sizes for f in shard_names(file)):  # a shard not listed (stops there): no size
                found.append((repo, (file,), None))
                continue
            files = store._with_shards(repo, file)
            found.append((repo, files, sum(sizes.get(f) or 0 for f in files)))
    return found


def _family_repos(repo: str, registry) -> list[str]:
    """The target's repository, then same-family ones: the registry's (any owner), the hub's (same owner)."""
    owner, key = repo.split("/")[0], family(repo).lower()
    repos = [repo]
    for entry in registry.models.values():
        if family(entry.repo).lower() == key and entry.repo not in repos:
            repos.append(entry.repo)
    from huggingface_hub import HfApi
    try:
        with store.hub_errors(owner):
            listed = [m.id for m in HfApi(endpoint=store.endpoint()).list_models(author=owner, search=family(repo),
                                                                                 limit=MAX_LISTED_REPOS)]
    except StoreError:
        listed = []  # no listing: the repository and the registry's repositories alone
    repos += [r for r in listed if family(r).lower() == key and r not in repos and not store.unsafe_repo_reason(r)]
    return repos[:MAX_LISTED_REPOS]


def _repo_sizes(repo: str) -> dict[str, int | None]:
    """File name -> size, from one model_info request (the hub's listing with sizes)."""
    from huggingface_hub import HfApi
    with store.hub_errors(repo):
        info = HfApi(endpoint=store.endpoint()).model_info(repo, files_metadata=True)
    siblings = info.siblings or []
    names = store._checked_listing(repo, [s.rfilename for s in siblings])
    return {name: s.size for name, s in zip(names, siblings)}


def _remote_fingerprint(url: str, size: int | None, name: str) -> tuple[Fingerprint, bytes]:
    """A hub file's tokenizer fingerprint from its first bytes (Range requests, grown while the header
    is longer), and those bytes (to compare the token texts of two vocabularies of different sizes)."""
    from huggingface_hub.utils import hf_raise_for_status, http_backoff
    first = FIRST_BYTES
    while True:
        with store.hub_errors(name):
            response = http_backoff("GET", url, headers={**store.download_headers(url), "Range": f"bytes=0-{first - 1}"})
            hf_raise_for_status(response)
        data = response.content
        try:
            return fingerprint_of_bytes(data, name), data
        except HeaderCutShort:
            if len(data) < first or (size is not None and first >= size) or first >= MAX_HEADER_BYTES:
                raise
        first *= 4
