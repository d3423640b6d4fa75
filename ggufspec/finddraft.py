"""Which draft a target gets when none is named (`-m` alone), and whether a named one (`-md`) fits.

In order: a model on disk (ggufspec's models folder, and the `--draft-dir` folders) whose tokenizer
matches the target's (`fingerprint`: from the GGUF headers, never the file names) and that is at
least MIN_SIZE_RATIO times smaller; else the registry's pair for that target, when its draft is on
disk (when it is not, the choice says how to get it); else n-gram drafting, which needs no model.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import GgufspecError, IncompatibleModelsError
from .fingerprint import describe, differences, file_size, first_token_difference, read_fingerprint
from .ggufheader import cut_short

MIN_SIZE_RATIO = 5.0   # a draft that is not this much smaller costs too much of a target step
MAX_SCANNED = 500      # .gguf files looked at per folder
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class DraftChoice:
    """What drafts for a session: kind "model" (path: the draft's file), "mtp", "ngram" or "none"; why, in words."""

    kind: str
    path: str | None
    why: str

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        what = {"model": f"draft model {self.path}", "ngram": "n-gram drafting (no draft model)",
                "mtp": "the target's own MTP blocks",
                "none": "none (the target alone)"}[self.kind]
        return f"ggufspec: draft: {what}: {self.why}"


def check_draft_dir(folder: str | os.PathLike | None) -> Path | None:
    """--draft-dir as a folder, or one line of error."""
    if folder is None:
        return None
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise GgufspecError(f"--draft-dir {folder}: no such folder" if not path.exists()
                            else f"--draft-dir {folder}: not a folder")
    return path


def choose_draft(target: str | os.PathLike, folders: list[Path], registry=None) -> DraftChoice:
    """The draft for `target` when none was named (see the module's note)."""
    target = Path(target)
    target_print = read_fingerprint(target)
    target_size = file_size(target)
    found = [(size, path) for size, path in _on_disk(folders, target)
             if size * MIN_SIZE_RATIO <= target_size and _pairs_with(target_print, target, path)]
    if found:
        size, path = max(found)  # the largest that is small enough: the likeliest to agree with the target
        return DraftChoice("model", str(path), f"{path.name} shares the target's tokenizer "
                           f"({describe(target_print)}) and is {target_size / size:.1f}x smaller")
    pairs = registry_pairs(target, registry)
    for pair, draft_path in pairs:
        if draft_path is not None:
            return DraftChoice("model", str(draft_path), f"the registry pair {pair.name}")
    looked = ", ".join(str(f) for f in folders) or "no folder"
    why = (f"no model in {looked} shares the target's tokenizer and is at least {MIN_SIZE_RATIO:g}x smaller")
    if pairs:
        why += f"; `ggufspec pull {pairs[0][0].name}` gets its draft (the registry pair for this target)"
    return DraftChoice("ngram", None, why)


def check_draft(target: str | os.PathLike, draft: str | os.PathLike, registry=None, folders=()) -> None:
    """A named draft whose tokenizer cannot pair with the target's: one line naming the fields that
    differ and what would work (the registry's pairs for the target, else matching files on disk)."""
    target, draft = Path(target), Path(draft)
    if not (target.is_file() and draft.is_file()):
        return  # the loader says which is missing
    differ = differences(read_fingerprint(target), read_fingerprint(draft), target, draft)
    if not differ:
        return
    differ = [f"{d}, first at {first_token_difference(target, draft)}" if d.startswith("token texts") else d
              for d in differ]
    raise IncompatibleModelsError(f"the draft {draft.name} cannot draft for {target.name}: its tokenizer differs "
                                  f"({'; '.join(differ)}); {_what_would_work(target, registry, folders)}")


def _what_would_work(target: Path, registry, folders) -> str:
    pairs = registry_pairs(target, registry)
    if pairs:
        return "pairs that would work: " + ", ".join(
            f"{pair.name} (draft {pair.draft}{'' if path else ', `ggufspec pull ' + pair.name + '`'})"
            for pair, path in pairs)
    target_print = read_fingerprint(target)
    matching = [path.name for _, path in _on_disk(folders, target) if _pairs_with(target_print, target, path)]
    if matching:
        return "files on disk that would work: " + ", ".join(sorted(matching)[:5])
    return "no registry pair has this target: pair it with a model of the same family (see `ggufspec list`), or drop -md"


def registry_pairs(target: Path, registry=None) -> list[tuple]:
    """The registry's pairs whose target is this file (same file name, and size where the registry
    knows it), each with its draft's path when the draft is on disk (else None)."""
    from . import store
    from .registry import RegistryError, load_registry
    try:
        registry = registry or load_registry()
    except RegistryError:
        return []  # a damaged user registry: no pairs to offer (commands that read it say why)
    found = []
    for pair in registry.pairs.values():
        entry = registry.models[pair.target]
        if entry.first_file != target.name or (entry.size is not None and entry.size != file_size(target)):
            continue
        draft = registry.models[pair.draft]
        try:
            draft_path = store.final_path(draft, draft.first_file) if store.is_complete(draft) else None
        except GgufspecError:  # a name that cannot be stored
            draft_path = None
        found.append((pair, draft_path))
    return found


def _pairs_with(target_print, target: Path, path: Path) -> bool:
    """Whether the file at `path` could draft for the target: its tokenizer pairs, and it is whole (a download
    cut short has a readable header, and was offered, then failed to load)."""
    try:
        return not differences(target_print, read_fingerprint(path), target, path) and not cut_short(path)
    except GgufspecError:  # a damaged or foreign .gguf in the folder: not a candidate
        return False


def _on_disk(folders, target: Path):
    """(bytes, path) of the models in `folders` other than the target: first shards only, no
    multimodal projectors."""
    seen = set()
    target_id = _identity(target)
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        for count, path in enumerate(sorted(Path(folder).rglob("*.gguf"))):
            if count >= MAX_SCANNED:
                break
            shard = _SHARD.search(path.name)
            if "mmproj" in path.name.lower() or (shard and int(shard[1]) != 1) or not path.is_file():
                continue
            ident = _identity(path)
            if ident in seen or ident == target_id:
                continue
            seen.add(ident)
            yield file_size(path), path


def _identity(path: Path):
    stat = path.stat()
    return stat.st_dev, stat.st_ino
