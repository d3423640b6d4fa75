"""The GGUF files a user names (models, LoRA adapters, control vectors): the checks each gets before
llama.cpp reads it, and llama.cpp's file-list flags (--lora, --control-vector and their -scaled forms),
in one wording for all of them.

llama.cpp's lists (common/arg.cpp's string_split on ','... read as CSV here so that a name holding a
comma can be quoted) give FNAME[,FNAME...]; the -scaled forms FNAME:SCALE[,...], the last colon
splitting, so a path may hold colons.
"""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from .errors import GgufspecError

GGUF_MAGIC = b"GGUF"


def check_gguf(path: str | os.PathLike, what: str, *, hint: str = "", error: type = GgufspecError) -> Path:
    """`path` as a Path once it is a file starting with GGUF's magic; else one line naming `what` ("target
    model", "LoRA adapter"...), and `hint` (how to make one) where the file is something else."""
    where = Path(path)
    if where.is_dir():
        found = sorted(p.name for p in where.glob("*.gguf"))[:3]
        raise error(f"{what} {path} is a folder: give a .gguf file" + (f" in it ({', '.join(found)})" if found else ""))
    if not where.is_file():
        raise error(f"{what} not found: {path}")
    with where.open("rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise error(f"{what} {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')" +
                    (f"; {hint}" if hint else ""))
    return where


def file_list(flag: str, value: str | os.PathLike) -> list[str]:
    """A flag's file names: a path as it is, a text as llama.cpp's comma-separated list (quotes allowed)."""
    if isinstance(value, os.PathLike):
        return [os.fspath(value)]
    if not isinstance(value, str):
        raise GgufspecError(f"{flag} takes file names, got {value!r}")
    items = next(csv.reader([value]), [])
    if not items or not all(items):
        raise GgufspecError(f"{flag} {value!r}: an empty file name; give FNAME or a comma-separated list of them")
    return items


def scaled_item(flag: str, item: str, example: str) -> tuple[str, float]:
    """FNAME:SCALE as (path, scale); llama.cpp has no other form (`example` shows it: "adapter.gguf:0.5")."""
    path, colon, scale = item.rpartition(":")
    if not colon or not path:
        raise GgufspecError(f"{flag} takes FNAME:SCALE in one argument (e.g. {flag} {example}), got {item!r}")
    try:
        number = float(scale)
    except ValueError:
        raise GgufspecError(f"{flag} {item}: the scale {scale!r} is not a number") from None
    if not math.isfinite(number):
        raise GgufspecError(f"{flag} {item}: the scale must be a finite number")
    return path, number


def scaled_pair(what: str, pair) -> tuple[str, float]:
    """A path (scale 1) or a (path, scale) pair as the Python API takes them, the scale a finite number;
    `what` names one in errors ("LoRA adapter")."""
    if isinstance(pair, (str, os.PathLike)):
        return os.fspath(pair), 1.0
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], (str, os.PathLike))):
        raise GgufspecError(f"a {what} is a path or a (path, scale) pair, got {pair!r}")
    path, scale = os.fspath(pair[0]), pair[1]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise GgufspecError(f"{what} {path}: the scale must be a finite number, got {scale!r}")
    return path, float(scale)
