"""The shared words of worker and daemon (worker/protocol.py): public numbers and shapes."""

from __future__ import annotations

import json

import pytest

from worker.protocol import (
    VERDICT_EXITS,
    ExitCode,
    TaskStatus,
    exit_reason,
    exit_record,
    heartbeat_shaped,
    parse_decision,
    parse_heartbeat,
    usable_decision,
)


def test_exit_codes_are_the_public_numbers() -> None:
    assert {code.name: int(code) for code in ExitCode} == {
        "DONE": 0,
        "ERROR": 1,
        "FAILED": 3,
        "HELD": 4,
        "STOPPED": 5,
        "LOCKED": 6,
        "STORAGE": 7,
        "RESOURCES": 8,
        "TOOLS": 9,
        "CONFIG": 78,
    }
    assert 1 not in VERDICT_EXITS and 2 not in VERDICT_EXITS  # a crash, not a verdict
    assert {0, 3, 4, 5, 6, 7, 8, 9, 78} == set(VERDICT_EXITS)


def test_task_status_is_its_text_in_json() -> None:
    assert json.dumps({"state": TaskStatus.BACKOFF}) == '{"state": "backoff"}'
    assert f"{TaskStatus.HELD}" == "held" and TaskStatus("done") is TaskStatus.DONE
    assert [s.value for s in TaskStatus] == [
        "queued",
        "running",
        "backoff",
        "held",
        "done",
        "failed",
        "cancelled",
    ]


def test_heartbeat_shape() -> None:
    beat = {"at": 1.5, "turn": 2, "pid": 10, "phase": "model_call", "usage": {"input_tokens": 3}}
    assert heartbeat_shaped(beat)
    assert parse_heartbeat(json.dumps(beat).encode()) == beat
    for bad in (
        {**beat, "at": "soon"},
        {**beat, "at": float("inf")},
        {**beat, "turn": True},
        {**beat, "turn": 1.5},
        {**beat, "phase": 3},
        {**beat, "usage": {"input_tokens": "3"}},
        {**beat, "interval": None},
        {k: v for k, v in beat.items() if k != "at"},
    ):
        assert not heartbeat_shaped(bad), bad
    assert parse_heartbeat(b"[1, 2]") is None
    assert parse_heartbeat(b"{torn") is None


def test_exit_record_round_trip() -> None:
    record = exit_record(ExitCode.HELD, "held", "dangling call", pid=42, at="now")
    assert record == {"code": 4, "state": "held", "reason": "dangling call", "pid": 42, "at": "now"}
    data = json.dumps(record).encode()
    assert exit_reason(data) == "dangling call"
    assert exit_reason(data, 42) == "dangling call"
    assert exit_reason(data, 43) is None  # another worker's last words
    assert exit_reason(b"not json") is None
    assert exit_reason(b"[]") is None


def test_decision_validator() -> None:
    data = {"action": "skip", "reason": "done by hand", "result": 5, "by": "ops", "x": "y"}
    assert parse_decision(json.dumps(data).encode()) == {
        "action": "skip",
        "reason": "done by hand",
        "by": "ops",
    }
    assert usable_decision(b'{"action": "rerun"}')
    for bad in (b'{"action": "delete"}', b"[]", b"{", b'"rerun"'):
        assert not usable_decision(bad), bad
    with pytest.raises(ValueError, match="bad action"):
        parse_decision(b'{"action": null}')
