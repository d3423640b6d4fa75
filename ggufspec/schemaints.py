"""Bounds in a JSON schema as GBNF (schemafollow.BoundedConverter): the integers from a least to a most
value, written digit by digit as JSON writes them (ported from llama.cpp's converter), and the numbers
between any bounds, as plain decimals."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal

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


# ---------------------------------------------------------------- a number's bounds
# pydantic's Field(ge=0, le=1) or gt=0.5 on a float. A number is written as JSON's plain decimals (no
# exponent): an integer part I and a fraction F of 0 to 16 digits (the converter's decimal-part: a
# fraction that ran on, a small model writing 7s until max_tokens, ends there). A bound b = Ib.Fb orders
# them by the integer part first: v >= b is I > Ib, or I = Ib and F >= Fb, where fractions compare as
# digit strings padded with zeros (.5 = .50 < .51 < .6). So the integers strictly between the bounds'
# take any fraction (int_range_rule), and a bound's own integer part the fractions on its side, written
# digit by digit (`at_least`, `at_most`, `between`). A negative number is "-" and a magnitude bounded
# the other way round, above 0 (never "-0": the rule writes 0).
FRACTION_DIGITS = 16
ANY_FRACTION = '("." [0-9]{1,16})?'
STEP = Decimal(1).scaleb(-FRACTION_DIGITS)
EXACT = Context(prec=64)  # a bound below 2**63 to 16 places has at most 35 digits


@dataclass(frozen=True)
class Bound:
    value: Decimal
    inclusive: bool


def number_range(schema: dict, where: str) -> tuple[Bound | None, Bound | None] | None:
    """A number schema's (lower, upper) bounds (None: unbounded on that side), or None where it has
    none or one is no number below 2**63 in magnitude (check_followed refuses it)."""
    bounds = {key: schema[key] for key in INT_BOUNDS if key in schema}
    if not bounds or not all(map(number_bound, bounds.values())):
        return None
    lows = [decimal_bound(v, key == "minimum", ROUND_CEILING) for key, v in bounds.items() if key.endswith("inimum")]
    highs = [decimal_bound(v, key == "maximum", ROUND_FLOOR) for key, v in bounds.items() if key.endswith("aximum")]
    low = max(lows, key=lambda b: (b.value, not b.inclusive), default=None)  # the tighter of each side
    high = min(highs, key=lambda b: (b.value, b.inclusive), default=None)
    # every bound is on the grid of 16 places now: an exclusive one lets in the next decimal of it inwards
    if low and high and low.value + STEP * (not low.inclusive) > high.value - STEP * (not high.inclusive):
        raise ToolError(f"the JSON schema's bounds at {where} leave no number of at most {FRACTION_DIGITS} "
                        f"decimals (from {plain(low.value)} to {plain(high.value)})")
    return low, high


def number_bound(value) -> bool:
    """Whether a number schema's bound is one the rule follows: a number below 2**63 in size (the
    rule's integer parts are int64's)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) < INT64_MAX)


def decimal_bound(value: int | float, inclusive: bool, rounding: str) -> Bound:
    """A bound as the decimal its JSON text says (repr: 0.1, not the float's 0.1000000000000000055...).
    One of more than 16 decimals is rounded inwards to 16 (ROUND_CEILING for a lower bound) and made
    inclusive: exact, as no decimal the rule writes lies between the two (gt=1e-20 is ge=1e-16)."""
    exact = Decimal(value) if isinstance(value, int) else Decimal(repr(value))
    rounded = exact.quantize(STEP, rounding=rounding, context=EXACT)
    return Bound(rounded if rounded else abs(rounded), inclusive or rounded != exact)  # -1e-20 up: 0, not -0


def plain(value: Decimal) -> str:
    """A decimal as JSON writes it plainly: 0.5, 3, -273.15."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def number_range_rule(low: Bound | None, high: Bound | None) -> str:
    """A GBNF expression for the numbers within the bounds, in plain decimals."""
    parts = []
    if high is None or high.value > 0 or high.value == 0 and high.inclusive:
        parts += magnitudes(low if low and low.value >= 0 else Bound(Decimal(0), True), high)
    if low is None or low.value < 0:  # -v: at most -low, above -high (or above 0)
        above = Bound(-high.value, high.inclusive) if high and high.value < 0 else Bound(Decimal(0), False)
        below = Bound(-low.value, low.inclusive) if low else None
        negative = magnitudes(above, below)  # none above -1e-16 exclusive
        parts += [f'"-" ({" | ".join(negative)})'] if negative else []
    return " | ".join(parts)


def magnitudes(low: Bound, high: Bound | None) -> list[str]:
    """Alternatives for the numbers >= 0 between `low` (>= 0) and `high` (None: unbounded)."""
    (least, low_digits), strict_low = split(low.value), not low.inclusive
    most, high_digits = split(high.value) if high else (None, "")
    if least == most:  # one integer part: the fractions between the two
        return [part for part in [then(str(least), between(low_digits, high_digits, strict_low, not high.inclusive,
                                                            FRACTION_DIGITS), ".")] if part]
    last = INT64_MAX if high is None else most - 1
    parts = [f"({int_range_rule(least + 1, last)}) {ANY_FRACTION}"] if least < last else []
    parts.append(then(str(least), at_least(low_digits, strict_low, FRACTION_DIGITS), "."))
    if high is not None:
        parts.append(then(str(most), at_most(high_digits, not high.inclusive, FRACTION_DIGITS), "."))
    return [part for part in parts if part]


def split(value: Decimal) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a decimal >= 0: 2.750 -> (2, "75")."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


# Fractions as (empty, alternatives): the digit strings of 1 to `room` digits that the alternatives
# match, and the empty one where `empty` (no fraction: 0). A bound's digits s1 s2 ... (no trailing
# zeros; "" is 0): F >= S where F's first digit is above s1, or is s1 and F's rest >= S's rest.
Fractions = tuple[bool, list[str]]


def at_least(digits: str, strict: bool, room: int) -> Fractions:
    """The fractions >= `digits` (> where strict)."""
    if not digits and not strict:
        return True, [free(1, room)] if room else []
    if not room:
        return False, []
    first, rest = (digits or "0")[0], digits[1:]  # more than 0: a first digit above 0, or 0 and more than 0
    alternatives = [f"{span(chr(ord(first) + 1), '9')} {free(0, room - 1)}".strip()] if first < "9" else []
    return False, alternatives + keep(then(first, at_least(rest, strict, room - 1)))


def at_most(digits: str, strict: bool, room: int) -> Fractions:
    """The fractions <= `digits` (< where strict): none (0) is one, unless `digits` is 0 and strict."""
    if not digits:  # zeros only, equal to 0
        return not strict, [f'"0"{{1,{room}}}'] if room and not strict else []
    first, rest = digits[0], digits[1:]
    alternatives = [f"{span('0', chr(ord(first) - 1))} {free(0, room - 1)}".strip()] if first > "0" else []
    return True, alternatives + keep(then(first, at_most(rest, strict, room - 1)))


def between(low: str, high: str, strict_low: bool, strict_high: bool, room: int) -> Fractions:
    """The fractions from `low` to `high` (low <= high as fractions), each end excluded where strict."""
    if not low and not high:
        return at_most("", strict_low or strict_high, room)
    empty = not low and not strict_low  # none: 0, below any `high` but "" (taken above)
    if not room:
        return empty, []
    first, last = (low or "0")[0], high[0]
    if first == last:
        return empty, keep(then(first, between(low[1:], high[1:], strict_low, strict_high, room - 1)))
    middle = [f"{span(chr(ord(first) + 1), chr(ord(last) - 1))} {free(0, room - 1)}".strip()] if (
        ord(last) - ord(first) > 1) else []
    return empty, middle + keep(then(first, at_least(low[1:], strict_low, room - 1))) + keep(
        then(last, at_most(high[1:], strict_high, room - 1)))


def then(prefix: str, rest: Fractions, point: str = "") -> str | None:
    """`prefix` followed by `point` and one of `rest` (or nothing, where it takes none): None where
    `rest` holds no fraction at all. A bound's integer part and its fractions are then('2', ..., '.')."""
    empty, alternatives = rest
    if not alternatives:
        return f'"{prefix}"' if empty else None
    group = f"({' | '.join(alternatives)})"
    if point:
        return f'"{prefix}" ("{point}" {group})?' if empty else f'"{prefix}" "{point}" {group}'
    return f'"{prefix}" {group}' + ("?" if empty else "")


def keep(alternative: str | None) -> list[str]:
    return [alternative] if alternative else []


def span(low: str, high: str) -> str:
    return f"[{low}]" if low == high else f"[{low}-{high}]"


def free(least: int, most: int) -> str:
    """`least` to `most` digits of any value ("" for none)."""
    return "" if most == 0 else "[0-9]" if least == most == 1 else f"[0-9]{{{least},{most}}}"
