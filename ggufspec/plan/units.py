"""Byte units, sizes as users write them, and the planner's error."""
from __future__ import annotations

import re

from ..errors import GgufspecError

MiB = 1 << 20
GiB = 1 << 30


class PlanError(GgufspecError):
    pass


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '8192MiB', '16g' -> bytes (k, m, g, t without an i: powers of 1000). A number
    with no unit is refused but for 0: "--vram 24" meant 24 GiB, not the 24 bytes it once planned for."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())  # one dot at most
    if not m or (not m[2] and not m[4] and m[1].strip("0.") != "") or float(m[1]) * 1024 ** 4 >= 1 << 80:
        raise PlanError(f"cannot read the size {text!r}: write it with its unit, like 24GiB, 16GB or 8192MiB")
    number, unit, binary = float(m[1]), m[2], m[3]
    base = 1024 if binary or unit == "" else 1000
    return int(number * base ** " kmgt".index(unit or " ")) if unit else int(number)
