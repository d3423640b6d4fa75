"""Bounds in a JSON schema as GBNF (schemafollow.BoundedConverter): the integers from a least to a most
value, written digit by digit as JSON writes them (ported from llama.cpp's converter), and the numbers
between whole bounds."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .errors import ToolError

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
INT_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def integer_range(schema: dict, where: str) -> tuple[int, int] | None:
    """The integers an integer schema's bounds allow, as (least, most) (INT64_MIN/MAX: unbounded), or None
    where it has no bound. Exclusive bounds as inclusive ones; a fractional bound rounds inwards."""
    if not any(key in schema for key in INT_BOUNDS):
        return None
    least, most = INT64_MIN, INT64_MAX
    for key, value in schema.items():
        if key not in INT_BOUNDS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ToolError(f"the JSON schema's {key!r} at {where} must be a number, got {json.dumps(value)}")
        if key.endswith("inimum"):
            least = max(least, math.floor(value) + 1 if key == "exclusiveMinimum" else math.ceil(value))
        else:
            most = min(most, math.ceil(value) - 1 if key == "exclusiveMaximum" else math.floor(value))
    if least > most:
        raise ToolError(f"the JSON schema's bounds at {where} leave no integer (from {least} to {most})")
    least, most = max(least, INT64_MIN), min(most, INT64_MAX)
    return None if (least, most) == (INT64_MIN, INT64_MAX) else (least, most)  # a bound past int64: none


def int_range_rule(least: int, most: int) -> str:
    """A GBNF expression for the integers from `least` to `most`, written digit by digit
    (common/json-schema-to-grammar.cpp's build_min_max_int, ported, one leading-zero case mended)."""
    out: list[str] = []
    _min_max_int(least, most, out)
    return "".join(out)


def _digit_range(out: list[str], low: str, high: str) -> None:
    out.append(f"[{low}]" if low == high else f"[{low}-{high}]")


def _more_digits(out: list[str], least: int, most: int) -> None:
    out.append("[0-9]")
    if least == most == 1:
        return
    out.append("{" + str(least) + ("" if most == least else "," + ("" if most is None else str(most))) + "}")


def _uniform_range(out: list[str], low: str, high: str) -> None:
    """The numbers with as many digits as `low` and `high`, from `low` to `high`."""
    i = 0
    while i < len(low) and i < len(high) and low[i] == high[i]:
        i += 1
    if i > 0:
        out.append(f'"{low[:i]}"')
    if i >= len(low) or i >= len(high):
        return
    if i > 0:
        out.append(" ")
    rest = len(low) - i - 1
    if rest == 0:
        out.append(f"[{low[i]}-{high[i]}]")
        return
    low_rest, high_rest, zeros, nines = low[i + 1:], high[i + 1:], "0" * rest, "9" * rest
    reached = False
    out.append("(")
    if low_rest == zeros:
        _digit_range(out, low[i], chr(ord(high[i]) - 1))
        out.append(" ")
        _more_digits(out, rest, rest)
    else:
        out.append(f"[{low[i]}] (")
        _uniform_range(out, low_rest, nines)
        out.append(")")
        if ord(low[i]) < ord(high[i]) - 1:
            out.append(" | ")
            if high_rest == nines:
                _digit_range(out, chr(ord(low[i]) + 1), high[i])
                reached = True
            else:
                _digit_range(out, chr(ord(low[i]) + 1), chr(ord(high[i]) - 1))
            out.append(" ")
            _more_digits(out, rest, rest)
    if not reached:
        out.append(" | ")
        _digit_range(out, high[i], high[i])
        out.append(" ")
        _uniform_range(out, zeros, high_rest)
    out.append(")")


def _min_max_int(least: int, most: int, out: list[str], decimals_left: int = 16, top_level: bool = True) -> None:
    has_min, has_max = least != INT64_MIN, most != INT64_MAX
    if has_min and has_max:
        if least < 0 and most < 0:
            out.append('"-" (')
            _min_max_int(-most, -least, out, decimals_left, True)
            out.append(")")
            return
        if least < 0:
            out.append('"-" (')
            _min_max_int(0, -least, out, decimals_left, True)
            out.append(") | ")
            least = 0
        low, high = str(least), str(most)
        for digits in range(len(low), len(high)):
            _uniform_range(out, low, "9" * digits)
            low = "1" + "0" * digits
            out.append(" | ")
        _uniform_range(out, low, high)
        return
    fewer = max(decimals_left - 1, 1)
    if has_min:
        _at_least(least, out, decimals_left, fewer, top_level)
    elif has_max:
        if most >= 0:
            if top_level:
                out.append('"-" [1-9] ')
                _more_digits(out, 0, fewer)
                out.append(" | ")
            _min_max_int(0, most, out, decimals_left, True)
        else:  # the magnitude at least -most, written whole: llama.cpp passes top_level=false here,
            out.append('"-" (')  # which lets "-05" through for a maximum of -7 (test_schema_bounds)
            _min_max_int(-most, INT64_MAX, out, decimals_left, True)
            out.append(")")
    else:
        raise ValueError("at least one of the bounds must be set")


def _at_least(least: int, out: list[str], decimals_left: int, fewer: int, top_level: bool) -> None:
    if least < 0:
        out.append('"-" (')
        _min_max_int(INT64_MIN, -least, out, decimals_left, False)
        out.append(") | [0] | [1-9] ")
        _more_digits(out, 0, decimals_left - 1)
    elif least == 0:
        if top_level:
            out.append("[0] | [1-9] ")
            _more_digits(out, 0, fewer)
        else:
            _more_digits(out, 1, decimals_left)
    elif least <= 9:
        c, start = str(least), "1" if top_level else "0"
        if c > start:
            _digit_range(out, start, chr(ord(c) - 1))
            out.append(" ")
            _more_digits(out, 1, fewer)
            out.append(" | ")
        _digit_range(out, c, "9")
        out.append(" ")
        _more_digits(out, 0, fewer)
    else:  # as many digits as `least`, from it up; or more digits (up to the rule's 16 in all)
        # (llama.cpp recurses on the digits after the first as a number, which loses their leading
        # zeros: its rule for a minimum of 100 took 10)
        text = str(least)
        out.append("(")
        _uniform_range(out, text, "9" * len(text))
        out.append(")")
        if len(text) <= fewer:
            out.append(" | [1-9] ")
            _more_digits(out, len(text), fewer)


# ---------------------------------------------------------------- a number's bounds, where they are whole
# pydantic's Field(ge=0, le=1) or gt=0 on a float. A number is written as JSON's plain decimals (no
# exponent): its integer part I (int_range_rule) and a fraction. With whole bounds, v >= m is I >= m,
# v > m is I > m or I = m with a fraction not all zeros, v <= M is I < M or I = M with a zero fraction,
# v < M is I < M; a negative number is "-" and a magnitude bounded the other way round.
# at most 16 digits after the point, as the converter's decimal-part (a fraction that ran on: a small
# model can write 7s until max_tokens); a nonzero one: its zeros, its first other digit, the rest
ANY_FRACTION = '("." [0-9]{1,16})?'
NONZERO_FRACTION = '"." "0"{0,15} [1-9] [0-9]{0,15}'
ZERO_FRACTION = '("." "0"{1,16})?'


@dataclass(frozen=True)
class Bound:
    value: int
    inclusive: bool


def number_range(schema: dict, where: str) -> tuple[Bound | None, Bound | None] | None:
    """A number schema's (lower, upper) bounds where every one is a whole number (None: unbounded on
    that side), else None: bounds such as 0.5 are not followed (check_followed refuses them)."""
    bounds = {key: schema[key] for key in INT_BOUNDS if key in schema}
    if not bounds or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                             and v == int(v) and abs(v) < INT64_MAX for v in bounds.values()):
        return None
    lows = [Bound(int(v), key == "minimum") for key, v in bounds.items() if key.endswith("inimum")]
    highs = [Bound(int(v), key == "maximum") for key, v in bounds.items() if key.endswith("aximum")]
    low = max(lows, key=lambda b: (b.value, not b.inclusive), default=None)  # the tighter of each side
    high = min(highs, key=lambda b: (b.value, b.inclusive), default=None)
    if low and high and (low.value > high.value or low.value == high.value and not (low.inclusive and high.inclusive)):
        raise ToolError(f"the JSON schema's bounds at {where} leave no number (from {low.value} to {high.value})")
    return low, high


def number_range_rule(low: Bound | None, high: Bound | None) -> str:
    """A GBNF expression for the numbers within the bounds, in plain decimals."""
    parts = []
    if high is None or high.value > 0 or high.value == 0 and high.inclusive:
        parts += magnitudes(low if low and low.value >= 0 else Bound(0, True), high)
    if low is None or low.value < 0:  # -v: at most -low, above -high (or above 0)
        above = Bound(-high.value, high.inclusive) if high and high.value < 0 else Bound(0, False)
        below = Bound(-low.value, low.inclusive) if low else None
        parts.append(f'"-" ({" | ".join(magnitudes(above, below))})')
    return " | ".join(parts)


def magnitudes(low: Bound, high: Bound | None) -> list[str]:
    """Alternatives for the numbers >= 0 between `low` (>= 0) and `high` (None: unbounded)."""
    first, last = low.value + (not low.inclusive), INT64_MAX if high is None else high.value - 1
    parts = [f"({int_range_rule(first, last)}) {ANY_FRACTION}"] if first <= last else []
    if not low.inclusive and (high is None or low.value < high.value):
        parts.append(f'"{low.value}" {NONZERO_FRACTION}')
    if high is not None and high.inclusive and (high.value > low.value or low.inclusive):
        parts.append(f'"{high.value}" {ZERO_FRACTION}')
    return parts
