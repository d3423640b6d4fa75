"""What pulls have verified: $GGUFSPEC_HOME/verified.json.

The registry leaves size and sha256 out for most models (the hub knows them). Once a pull has
verified a file, its size and hash are noted here, so that `list` shows sizes offline, even after
`rm`. A note is only a note: a damaged file or entry loses the remembered sizes, never a pull.
"""
from __future__ import annotations

from pathlib import Path

from .home import home, one_at_a_time, read_json, write_json
from .registry import ModelEntry


def verified_path() -> Path:
    return home() / "verified.json"


def _verified_key(entry: ModelEntry, file: str) -> str:
    return f"{entry.repo}/{file}"  # the cache holds one copy per repo and file name, as final_path does


def _read_verified() -> dict:
    return read_json(verified_path().name)  # absent or damaged: only the remembered sizes are lost


def record_verified(entry: ModelEntry, file: str, size: int, sha256: str) -> None:
    try:
        with one_at_a_time("verified.json"):  # pulls of other files at the same time add theirs too
            _add_note(entry, file, size, sha256)
    except OSError:  # a note for `list`; never fails a verified pull
        _add_note(entry, file, size, sha256)


def _add_note(entry: ModelEntry, file: str, size: int, sha256: str) -> None:
    data = _read_verified()
    data[_verified_key(entry, file)] = {"size": size, "sha256": sha256, "revision": entry.revision}
    write_json(verified_path().name, data)


def _sound(note) -> bool:
    """A note as `record_verified` writes it (one edited by hand or cut short is ignored)."""
    return (isinstance(note, dict) and type(note.get("size")) is int and note["size"] >= 0
            and isinstance(note.get("sha256"), str))


def verified_files(entry: ModelEntry) -> dict[str, dict]:
    """file -> {size, sha256, revision} for the files of `entry` that a pull has verified."""
    data = _read_verified()
    notes = {f: data.get(_verified_key(entry, f)) for f in entry.files}
    return {f: note for f, note in notes.items() if _sound(note)}
