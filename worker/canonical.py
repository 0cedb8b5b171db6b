"""A tool call's input as canonical JSON (RFC 8785, the JSON Canonicalization Scheme), and
its SHA-256: the ``input_sha256`` a held call carries (docs/guides/tools.md), so that
an operator's decision names the exact input they saw, and any program can check it.

The scheme: object keys sorted by their UTF-16 code units, no whitespace, strings as
ECMAScript's ``JSON.stringify`` writes them (only ``"``, ``\\`` and control characters
escaped), and numbers in ECMAScript's ``Number.prototype.toString`` form (the shortest
digits that read back as the same double: ``1e+30``, ``0.002``, ``4.5``, ``-0`` as ``0``).
An integer is a double in JSON's number model, so one past 2**53 is written as the double
it reads back as. A string holding a lone surrogate (which RFC 8785 refuses) is encoded
with its code unit kept (``surrogatepass``), so that listing a held call never fails.
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal
from typing import Any

#: Integers up to this magnitude are exact as doubles, written as they are.
EXACT_INTEGER = 2**53


class NotCanonical(ValueError):
    """A value JSON cannot carry (NaN, an infinity, an object that is no JSON value)."""


def canonical_json(value: Any) -> str:
    """``value`` (parsed JSON) as RFC 8785 canonical JSON text."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts)


def input_sha256(value: Any) -> str:
    """The SHA-256 (hex) of ``value`` as canonical JSON, UTF-8 encoded."""
    text = canonical_json(value)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _write(value: Any, parts: list[str]) -> None:
    if value is None:
        parts.append("null")
    elif value is True:
        parts.append("true")
    elif value is False:
        parts.append("false")
    elif isinstance(value, str):
        parts.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, int):
        parts.append(str(value) if abs(value) <= EXACT_INTEGER else number(float(value)))
    elif isinstance(value, float):
        parts.append(number(value))
    elif isinstance(value, list | tuple):
        parts.append("[")
        for i, item in enumerate(value):
            if i:
                parts.append(",")
            _write(item, parts)
        parts.append("]")
    elif isinstance(value, dict):
        parts.append("{")
        keys = sorted(value, key=_utf16)
        for i, key in enumerate(keys):
            if not isinstance(key, str):
                raise NotCanonical(f"an object key must be a string, not {type(key).__name__}")
            if i:
                parts.append(",")
            parts.append(json.dumps(key, ensure_ascii=False))
            parts.append(":")
            _write(value[key], parts)
        parts.append("}")
    else:
        raise NotCanonical(f"{type(value).__name__} is no JSON value")


def _utf16(key: Any) -> bytes:
    """The sort key of an object key: its UTF-16 code units (big-endian bytes compare as
    the units do)."""
    return str(key).encode("utf-16-be", "surrogatepass")


def number(value: float) -> str:
    """``value`` as ECMAScript's ``Number.prototype.toString`` writes it (ECMA-262,
    Number::toString): the shortest round-trip digits, in plain or exponent form."""
    if math.isnan(value) or math.isinf(value):
        raise NotCanonical(f"{value} is no JSON number")
    if value == 0:
        return "0"  # (and -0)
    sign = "-" if value < 0 else ""
    # repr gives the shortest digits that read back as the same double
    _, digits_tuple, exponent = Decimal(repr(abs(value))).as_tuple()
    digits = "".join(map(str, digits_tuple)).rstrip("0")
    # (a finite Decimal's exponent is an int; the zeros taken off the end raise it)
    exponent = int(exponent) + len(digits_tuple) - len(digits)
    k = len(digits)
    n = exponent + k  # the value is 0.DIGITS * 10**n
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        e = n - 1
        mantissa = digits if k == 1 else f"{digits[0]}.{digits[1:]}"
        text = f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + text
