"""A call's input as RFC 8785 canonical JSON, and its SHA-256 (worker/canonical.py)."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from worker.canonical import NotCanonical, canonical_json, input_sha256, number


def test_the_rfc_example_is_written_as_the_rfc_writes_it() -> None:
    # RFC 8785 section 3.2.2 (its input, and its output byte for byte)
    data = json.loads(
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    assert canonical_json(data) == (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )


def test_keys_sort_by_utf16_code_units_not_code_points() -> None:
    # RFC 8785 section 3.2.3: the emoji (a surrogate pair, 0xd83d...) sorts before U+FB33
    data = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    keys = list(json.loads(canonical_json(data)))
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]
    assert sorted(data) != keys  # (Python's own order, by code point, differs)


def _double(bits: str) -> float:
    return float(struct.unpack(">d", bytes.fromhex(bits))[0])


@pytest.mark.parametrize(
    ("bits", "text"),
    [  # RFC 8785 appendix B
        ("0000000000000000", "0"),
        ("8000000000000000", "0"),
        ("0000000000000001", "5e-324"),
        ("8000000000000001", "-5e-324"),
        ("7fefffffffffffff", "1.7976931348623157e+308"),
        ("ffefffffffffffff", "-1.7976931348623157e+308"),
        ("4340000000000000", "9007199254740992"),
        ("c340000000000000", "-9007199254740992"),
        ("4430000000000000", "295147905179352830000"),
        ("44b52d02c7e14af5", "9.999999999999997e+22"),
        ("44b52d02c7e14af6", "1e+23"),
        ("44b52d02c7e14af7", "1.0000000000000001e+23"),
        ("444b1ae4d6e2ef4e", "999999999999999700000"),
        ("444b1ae4d6e2ef4f", "999999999999999900000"),
        ("444b1ae4d6e2ef50", "1e+21"),
        ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
        ("3eb0c6f7a0b5ed8d", "0.000001"),
        ("41b3de4355555553", "333333333.3333332"),
        ("41b3de4355555554", "333333333.33333325"),
        ("41b3de4355555555", "333333333.3333333"),
        ("41b3de4355555556", "333333333.3333334"),
        ("41b3de4355555557", "333333333.33333343"),
        ("becbf647612f3696", "-0.0000033333333333333333"),
        ("43143ff3c1cb0959", "1424953923781206.2"),
    ],
)
def test_numbers_are_written_in_ecmascript_form(bits: str, text: str) -> None:
    assert number(_double(bits)) == text


def test_integers_are_exact_up_to_2_53_and_doubles_past_it() -> None:
    assert canonical_json([1, -7, 4.0, 2**53]) == "[1,-7,4,9007199254740992]"
    assert canonical_json(10**21) == "1e+21"


def test_unicode_strings_are_kept_and_control_characters_escaped() -> None:
    assert canonical_json({"é": "日本\u2028\x1f"}) == '{"é":"日本\u2028\\u001f"}'


def test_the_hash_is_of_the_utf8_bytes_and_ignores_how_the_input_was_spelled() -> None:
    a = json.loads('{"command": "echo hi", "timeout": 10.0}')
    b = json.loads('{ "timeout" : 1e1, "command" : "echo hi" }')
    expected = hashlib.sha256(b'{"command":"echo hi","timeout":10}').hexdigest()
    assert input_sha256(a) == input_sha256(b) == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {1: "a"}, {"a": object()}])
def test_what_json_cannot_carry_is_refused(value: object) -> None:
    with pytest.raises(NotCanonical):
        canonical_json(value)
