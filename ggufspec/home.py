"""ggufspec's own folder and what it remembers there (costs, shapes, verified files).

`$GGUFSPEC_HOME`, else `$XDG_DATA_HOME/ggufspec` (~/.local/share/ggufspec). Everything kept here is
written atomically (a reader sees the old file or the new one) and is an optimisation or a note:
failing to read or write it never fails a command.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
from pathlib import Path


def home() -> Path:
    """The ggufspec directory: $GGUFSPEC_HOME, else $XDG_DATA_HOME/ggufspec (~/.local/share/ggufspec)."""
    if os.environ.get("GGUFSPEC_HOME"):
        return _absolute(os.environ["GGUFSPEC_HOME"])
    if os.environ.get("XDG_DATA_HOME"):
        return _absolute(os.environ["XDG_DATA_HOME"]) / "ggufspec"
    return Path.home() / ".local" / "share" / "ggufspec"


def _absolute(setting: str) -> Path:
    """A folder as a variable gives it, `~` and `$VARS` expanded (a quoted "~/gg" reaches us unexpanded) and made
    absolute: a relative one would be another store in each folder a command runs from."""
    return Path(os.path.abspath(os.path.expandvars(os.path.expanduser(setting))))


def read_json(name: str) -> dict:
    """A JSON object ggufspec remembers in its home; {} when absent or damaged."""
    try:
        data = json.loads((home() / name).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_json(name: str, data: dict) -> None:
    """Replace `name` in ggufspec's home atomically; an error is swallowed (see the module's note)."""
    path = home() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


@contextlib.contextmanager
def one_at_a_time(name: str, waiting: str | None = None):
    """One holder of `name` at a time, across processes and threads: a lock file under locks/ (left in
    place, empty). `waiting`: said on stderr when another holds it. OSError where home cannot be written."""
    from filelock import FileLock
    path = home() / "locks" / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except TimeoutError:
        if waiting:
            print(waiting, file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
