"""FILENAME.setup beside a slot file (--slot-save-path): the setup whose KV cells the file holds, so that
a restore on a server whose target computes other cells is refused instead of answering with them.

llama.cpp's state file check (llama_state_seq_load_file) refuses another model shape, token count or
cache layout, but not a LoRA adapter, control vector, RoPE/YaRN setting or metadata override of another
value: those change every cell's value and nothing of its size. The sidecar is JSON: `fingerprint`, a
hash of `target` (props.cache_setup: the file, cache types, adapters, vectors, rope and kv overrides),
which a restore compares with this server's; `flags`, the target's as the command-line flags that give
it (for a person: how to start a server that restores it); `draft`, the same for FILENAME.draft (a draft of another
setup is passed over: it changes what is drafted, never the answer); and `ggufspec`, the version that
wrote it. What only rounds the cells (builds, threads, -ngl, --strict) is not in it: llama-server
restores across those. The slot file itself stays llama-server's, which reads it and ignores the
sidecar; a file without one (llama-server's, or saved by an older ggufspec) is restored unchecked,
and the answer says so (`setup_checked`).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

from .. import __version__
from .errors import APIError
from .props import cache_setup

SETUP_SUFFIX = ".setup"
FORMAT, VERSION = "ggufspec slot setup", 1
SIDECAR_MAX = 1 << 20  # bytes: a larger file of that name is no sidecar (a slot file named so)
# how the differences are named, by cache_setup's keys, in this order
KEYS = ("file", "cache_types", "lora", "cvec", "rope", "override_kv")
ROPE_FLAGS = {"rope_scaling_type": "--rope-scaling"}  # the others: --rope-freq-base for rope_freq_base...


def setup_of(target, draft) -> dict:
    """The setup of a slot's target context and of its draft's (None: no draft of its own to save)."""
    return {"target": cache_setup(target.llm), "draft": None if draft is None else cache_setup(draft.llm)}


def fingerprint(target_setup: dict) -> str:
    return "fp_" + hashlib.sha256(json.dumps(target_setup, sort_keys=True).encode()).hexdigest()[:12]


def read(path: str) -> dict | None:
    """The sidecar at `path`; None where there is none: no file, or one that is not ggufspec's sidecar
    (a slot file a user named so, something unreadable)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > SIDECAR_MAX:
            return None
        with open(path, "rb") as file:
            record = json.loads(file.read())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def make_room(path: str, filename: str) -> None:
    """Before a save of `filename`: its earlier sidecar removed (a save that fails halfway must not leave
    the old setup vouching for new cells); 400 where something else has the sidecar's name."""
    if not os.path.lexists(path):
        return
    if read(path) is None:
        raise APIError(400, f"Unable to save slot: {filename}{SETUP_SUFFIX} in --slot-save-path is not ggufspec's "
                            f"setup file (a slot file of that name?), and saving {filename} would overwrite it: "
                            f"move it, or save under another name", param="filename")
    os.remove(path)


def write(path: str, setup: dict) -> None:
    """The sidecar, whole or not at all (written aside, then renamed over)."""
    target = setup["target"]
    record = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint(target),
              "flags": " ".join(describe(key, value) for key, value in target.items()), **setup,
              "ggufspec": __version__}
    folder, name = os.path.split(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{name[:100]}.", dir=folder)
    try:
        with os.fdopen(handle, "w") as file:  # a key a line, for a person to read
            file.write("{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}" for key, value in record.items())
                       + "\n}\n")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def checked(path: str, filename: str, here: dict) -> dict | None:
    """The sidecar at `path` where there is one and the target's setup is this server's (`here`); None
    where there is none. A 400 naming what differs where it is not."""
    saved = read(path)
    if saved is None or saved.get("fingerprint") == fingerprint(here["target"]):
        return saved
    named = "; ".join(differences(saved.get("target"), here["target"]))
    raise APIError(400, f"Unable to restore slot: {filename} holds KV cells computed with another setup than this "
                        f"server's ({named}); its answers would not be this target's: restore it on a server "
                        f"started as it was saved ({filename}{SETUP_SUFFIX} says how)".replace("\n", "\\n"),
                   param="filename")


def same_draft(saved: dict | None, here: dict) -> bool:
    """Whether FILENAME.draft may be restored: no sidecar to say (as before), or the same draft setup."""
    return saved is None or saved.get("draft") == here["draft"]


def differences(saved, here: dict) -> list[str]:
    """What differs between two targets' setups, each as "saved with FLAGS, this server has FLAGS"."""
    if not isinstance(saved, dict):
        return [f"the setup's fingerprint differs: this server's is {fingerprint(here)}"]
    found = []
    for key in (*KEYS, *sorted(set(saved) - set(KEYS))):
        if saved.get(key) != here.get(key):
            then, now = describe(key, saved.get(key)), describe(key, here.get(key))
            if then == now:  # the same names: other files of those names
                then, now = describe(key, saved.get(key), sizes=True), describe(key, here.get(key), sizes=True)
            found.append(f"saved with {then}, this server has {now}")
    return found or [f"the setup's fingerprint differs: this server's is {fingerprint(here)}"]


def describe(key: str, value, sizes: bool = False) -> str:
    """A setup's entry as the flags that give it ("none": not given); as JSON where it is not in the
    shape cache_setup writes (a hand-edited sidecar)."""
    if value is None:
        return "none"
    try:
        return _flags(key, value, sizes)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError):
        return f"{key} {json.dumps(value)}"


def _flags(key: str, value, sizes: bool) -> str:
    size = lambda n: f" ({n} bytes)" if sizes else ""
    if key == "file":
        return f"-m {value[0]}{size(value[1])}"
    if key == "cache_types":
        return f"-ctk {value[0]} -ctv {value[1]}"
    if key == "lora":
        return " ".join(_scaled("--lora", name, scale) + size(n) for name, n, scale in value)
    if key == "cvec":
        vectors, first, last = value
        return " ".join([*(_scaled("--control-vector", name, scale) + size(n) for name, n, scale in vectors),
                         f"--control-vector-layer-range {first} {last}"])
    if key == "rope":
        return " ".join(f"{ROPE_FLAGS.get(field, '--' + field.replace('_', '-'))} {_number(v)}"
                        for field, v in value.items())
    if key == "override_kv":
        return " ".join(f"--override-kv {name}={_kv_type(v)}:{_kv_text(v)}" for name, v in value.items())
    raise KeyError(key)


def _scaled(flag: str, name: str, scale: float) -> str:
    return f"{flag} {name}" if scale == 1 else f"{flag}-scaled {name}:{_number(scale)}"


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _kv_type(value) -> str:
    return {bool: "bool", int: "int", float: "float"}.get(type(value), "str")


def _kv_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
