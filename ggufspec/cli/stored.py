"""What the store holds beyond the registry's names, for `list` and `rm`: GGUF files pulled by hub
reference (hf://... or OWNER/REPO:QUANT, which no models.toml entry names), partial downloads, and
which registry pairs share a model (so that removing one pair keeps what another still uses).

The store keeps a hub file at models/OWNER__REPO/FILE (`store.final_path`) and its partial download
under downloads/OWNER__REPO/ (an assembly from PyPI parts: models/.../FILE.part), so a file's hub
reference can be told back from its place."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import GgufspecError

# A partial download's name: FILE.incomplete, or FILE.KEY.incomplete (KEY: 16 hex digits of the
# upload's sha256); an assembly's: FILE.part. As the store names them (store.PARTIAL), which has no
# public listing of them.
PARTIAL = re.compile(r"(?:(?:\.[0-9a-f]{16})?\.incomplete|\.part)$")


def registry_files(registry) -> dict[Path, str]:
    """The final path of every registry model's files -> the model's name."""
    from .. import store
    return {store.final_path(entry, file): name for name, entry in registry.models.items() for file in entry.files}


def reference_of(path: Path, root: Path) -> str:
    """hf://OWNER/REPO/FILE.gguf for root/OWNER__REPO/FILE.gguf; else the path itself (a file put
    there by hand, which no reference names)."""
    from .. import store
    relative = path.relative_to(root)
    if len(relative.parts) >= 2 and "__" in relative.parts[0]:
        owner, repo = relative.parts[0].split("__", 1)  # hub owner names hold no underscore
        ref = f"hf://{owner}/{repo}/{'/'.join(relative.parts[1:])}"
        try:
            if store.entry_from_reference(ref) is not None:  # hf:// references are parsed offline
                return ref
        except GgufspecError:
            pass
    return str(path)


def _first_shard_reference(ref: str) -> str:
    """A split GGUF is listed once, by its first shard (what pull and rm take for the whole)."""
    from .. import store
    if not ref.startswith("hf://"):
        return ref
    entry = store.entry_from_reference(ref)
    return f"hf://{entry.repo}/{entry.first_file}"


def other_models(registry) -> dict[str, dict]:
    """The complete GGUF files in the models folder that no registry entry covers, by reference:
    {ref: {"files": [paths], "size": bytes}}."""
    from .. import store
    root = store.models_dir()
    if not root.is_dir():
        return {}
    covered = registry_files(registry)
    found: dict[str, dict] = {}
    for path in sorted(root.rglob("*.gguf")):
        if path in covered or not path.is_file():
            continue
        shown = found.setdefault(_first_shard_reference(reference_of(path, root)), {"files": [], "size": 0})
        shown["files"].append(str(path))
        shown["size"] += path.stat().st_size
    return found


def partial_downloads(registry) -> list[dict]:
    """Downloads and assemblies that never finished: [{"name", "path", "bytes"}], the name being what
    `pull` resumes and `rm` deletes (the registry model's name, else the hub reference)."""
    from .. import store
    covered = registry_files(registry)
    found = []
    for root, final_root in ((store.downloads_dir(), store.models_dir()), (store.models_dir(), store.models_dir())):
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            match = PARTIAL.search(path.name)
            if not match or not match.start() or not path.is_file():
                continue
            final = final_root / path.relative_to(root).with_name(path.name[:match.start()])
            name = covered.get(final) or _first_shard_reference(reference_of(final, final_root))
            found.append({"name": name, "path": str(path), "bytes": path.stat().st_size})
    return found


def pairs_using(registry, model: str, *, besides: str | None = None) -> list[tuple[str, str]]:
    """(pair, role) for each registry pair other than `besides` that uses `model` and is on disk
    (its other model has files there: removing `model` would break it)."""
    from .. import store
    users = []
    for pair in registry.pairs.values():
        if pair.name == besides:
            continue
        for role, name, partner in (("target", pair.target, pair.draft), ("draft", pair.draft, pair.target)):
            if same_files(registry, name, model) and (same_files(registry, partner, model)
                                                      or store.files_on_disk(registry.model(partner))):
                users.append((pair.name, role))
                break
    return users


def same_files(registry, a: str, b: str) -> bool:
    """Whether two models' files are (some of) the same files in the store: two names for one file."""
    from .. import store
    if a == b or a not in registry.models or b not in registry.models:  # a hub reference is its own name
        return a == b
    first, second = registry.model(a), registry.model(b)
    return bool({store.final_path(first, f) for f in first.files} & {store.final_path(second, f) for f in second.files})


def kept_line(model: str, users: list[tuple[str, str]]) -> str:
    roles = " and ".join(f"the {role} of {pair}" for pair, role in users)
    pairs = " and ".join(pair for pair, _ in users)
    return f"kept {model}: also {roles} (rm {pairs} too, or rm {model} by name)"
