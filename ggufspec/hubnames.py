"""Names that come from outside, checked before any of them becomes a path.

A hub's listing (or a mirror's: `HF_ENDPOINT` may point anywhere), an `hf://OWNER/REPO/FILE.gguf` or
`OWNER/REPO:QUANT` reference and a user's models.toml all name files that the store then writes under
`$GGUFSPEC_HOME`. The Hugging Face Hub never lists a name with a `..` segment, an absolute path, a
backslash or a drive letter, so refusing those loses nothing legitimate, and a subfolder the hub
really uses (`Q4_K_M/model-Q4_K_M-00001-of-00002.gguf`) passes. `contained` checks the joined path
as well: what the names allow must still land inside the store's folder.

A split GGUF's shard names (MODEL-00001-of-00003.gguf...) are made here from any one of them.

Where those folders are: a hub file at models/OWNER__REPO/FILE once verified, its partial download
under downloads/OWNER__REPO/ (`stored_names` reads a repository's back, for the store to choose among
them when the hub cannot be asked).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .home import home

DRIVE = re.compile(r"^[A-Za-z]:")
MAX_SEGMENT = 255 - len(".0123456789abcdef.incomplete")  # a partial download's name must fit too
MAX_NAME = 1024                     # the hub's own limit on a path is far below this
MAX_LISTING = 20_000                # files in one repository's listing; the largest GGUF repos list a few hundred
MAX_FILE_BYTES = 8 << 40            # 8 TiB: no GGUF file (a shard, or a whole unsplit model) comes near


SPLIT_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _split(file: str) -> re.Match | None:
    """The shard numbers of a split GGUF's file name; None for a file of its own (or numbers no split has)."""
    m = SPLIT_SHARD.search(file)
    return m if m and 1 <= int(m[1]) <= int(m[2]) <= MAX_LISTING else None


def shard_names(file: str):
    """A split GGUF's shard names in order, from any one shard's name (made one at a time: a listing may
    claim thousands); the file alone otherwise."""
    m = _split(file)
    if m is None:
        yield file
        return
    for i in range(1, int(m[2]) + 1):
        yield f"{file[:m.start()]}-{i:05d}-of-{m[2]}.gguf"


def first_shard(file: str) -> str:
    return next(shard_names(file))


def with_shards(repo: str, file: str) -> tuple[str, ...]:
    """A split GGUF's shard list, from any one shard's name; a single file otherwise."""
    return tuple(shard_names(file))


def unsafe_file_reason(name: object) -> str | None:
    """Why a repository file name cannot become a path under the store, or None when it can."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if len(name) > MAX_NAME:
        return f"a name of {len(name)} characters"
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        return "a control character"
    if "\\" in name:
        return "a backslash"
    if name.startswith("/"):
        return "an absolute path"
    if DRIVE.match(name):
        return "a drive letter"
    segments = name.split("/")
    if "" in segments:
        return "an empty path segment"
    if any(len(segment.encode()) > MAX_SEGMENT for segment in segments):
        return f"a path segment over {MAX_SEGMENT} bytes (file systems take 255, a partial download's suffix 28)"
    if ".." in segments or "." in segments:
        return f"a {'..' if '..' in segments else '.'!r} segment"
    return None


def unsafe_repo_reason(repo: object) -> str | None:
    """Why a repository id is not `OWNER/NAME` as the hub allows it, or None (huggingface_hub's own rule)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    if not isinstance(repo, str) or repo.count("/") != 1:
        return "not of the form OWNER/NAME"
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        return str(exc).splitlines()[0].rstrip(".")
    owner = repo.split("/")[0]
    if "__" in owner or owner.endswith("_"):  # the store's folders join OWNER__NAME: a_/b and a/_b both a___b
        return "an owner name with '__' or ending in '_' (the store's folder OWNER__NAME would be another repository's)"
    return None


def contained(root: Path, *parts: str) -> Path | None:
    """root/parts... when it lies inside root once '.' and '..' are folded; None otherwise."""
    base = os.path.normpath(os.path.abspath(root))
    joined = os.path.normpath(os.path.join(base, *parts))
    return Path(joined) if joined.startswith(base + os.sep) else None


def models_dir() -> Path:
    return home() / "models"


def downloads_dir() -> Path:
    return home() / "downloads"


def repo_folder(repo: str) -> str:
    return repo.replace("/", "__")


# downloads/OWNER__REPO/FILE.KEY.incomplete, KEY the start of the remote's sha256: a partial download
# of an older upload is never resumed with the new upload's bytes (huggingface_hub keys its
# .incomplete files by ETag). Where the hub gives no sha256, KEY hashes its ETag and size instead.
PARTIAL = re.compile(r"(?:\.[0-9a-f]{16})?\.incomplete$")


def partial_of(name: str) -> str | None:
    """The file name a partial download's name is for; None when it is not one."""
    m = PARTIAL.search(name)
    return name[:m.start()] if m and m.start() else None


def stored_names(repo: str) -> list[str]:
    """The file names of a repository that the store holds, complete or partly downloaded."""
    names = set()
    for root, partial in ((models_dir(), False), (downloads_dir(), True)):
        folder = contained(root, repo_folder(repo))
        for path in (folder.rglob("*") if folder is not None and folder.is_dir() else ()):
            name = path.relative_to(folder).as_posix()
            name = partial_of(name) if partial else name
            if name and not name.endswith(".part") and path.is_file() and not unsafe_file_reason(name):
                names.add(name)
    return sorted(names)
