"""Byte units, sizes as users write them, and the planner's error."""
from __future__ import annotations

import re

from ..errors import GgufspecError

MiB = 1 << 20
GiB = 1 << 30


class PlanError(GgufspecError):
    pass


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '8192MiB', '16g' -> bytes (a bare number: bytes; k, m, g, t without an i:
    powers of 1000)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise PlanError(f"cannot read the size {text!r}: write it like 24GiB, 16GB or 8192MiB")
    number, unit, binary = float(m[1]), m[2], m[3]
    base = 1024 if binary or unit == "" else 1000
    return int(number * base ** " kmgt".index(unit or " ")) if unit else int(number)
