"""structlog configuration, redaction and per-task event files."""

from __future__ import annotations

import io
import json
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog

from supervisor.logging import (
    REDACTED,
    LogSink,
    Redactor,
    TaskEventLog,
    configure,
    dropped_lines,
    get_logger,
    read_events,
    read_events_from,
    reset,
)
from tests.mounts import fill, small_disk
from worker import credentials
from worker.events import utc_now

# Canaries: if one of these shows up in any output, a secret leaked.
ANTHROPIC_CANARY = "sk-ant-api03-CANARY0123456789abcdefghijklmnopqrstuvwxyz_-ABCDEFGH"
ENV_CANARY = "plain-env-canary-4f9a2c71e8"
BEARER_CANARY = "eyJhbGciOiJIUzI1NiJ9.bearer-canary"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_event_timestamp_and_level() -> None:
    stream = io.StringIO()
    configure("json", stream)

    get_logger().info("worker_spawned", task="t1", pid=1240, turn=3)
    get_logger().warning("worker_hung", task="t1")

    first, second = _json_lines(stream)
    assert first["event"] == "worker_spawned"
    assert first["level"] == "info"
    assert (first["task"], first["pid"], first["turn"]) == ("t1", 1240, 3)
    assert second["level"] == "warning"
    stamp = datetime.fromisoformat(first["timestamp"])
    assert stamp.utcoffset() == UTC.utcoffset(None)
    assert first["timestamp"].endswith("Z")
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 60


def test_level_filter_drops_debug_by_default() -> None:
    stream = io.StringIO()
    configure("json", stream)

    get_logger().debug("noise")
    get_logger().info("signal")

    assert [e["event"] for e in _json_lines(stream)] == ["signal"]


def test_bound_context_is_merged() -> None:
    stream = io.StringIO()
    configure("json", stream)

    structlog.contextvars.bind_contextvars(task="t9")
    get_logger(pid=7).info("task_resumed")

    (event,) = _json_lines(stream)
    assert (event["task"], event["pid"]) == ("t9", 7)


def test_secrets_are_redacted_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", ENV_CANARY)
    stream = io.StringIO()
    configure("json", stream)
    request: dict[str, Any] = {
        "headers": {"Authorization": f"Bearer {BEARER_CANARY}", "X-Api-Key": ENV_CANARY},
        "attempts": [{"note": f"retrying with {ANTHROPIC_CANARY}"}],
        "usage": {"input_tokens": 1200, "output_tokens": 310},
    }

    get_logger().error(
        f"model call failed for key {ANTHROPIC_CANARY}",
        request=request,
        api_key=ANTHROPIC_CANARY,
        detail=("env", ENV_CANARY),
        error=RuntimeError(f"401 with header Authorization: Bearer {BEARER_CANARY}"),
    )

    output = stream.getvalue()
    for canary in (ANTHROPIC_CANARY, ENV_CANARY, BEARER_CANARY):
        assert canary not in output
    (event,) = _json_lines(stream)
    assert event["event"] == f"model call failed for key {REDACTED}"
    assert event["api_key"] == REDACTED
    assert event["request"]["headers"] == {"Authorization": REDACTED, "X-Api-Key": REDACTED}
    assert event["request"]["attempts"] == [{"note": f"retrying with {REDACTED}"}]
    assert event["request"]["usage"] == {"input_tokens": 1200, "output_tokens": 310}
    assert event["detail"] == ["env", REDACTED]
    assert f"Bearer {REDACTED}" in event["error"]
    # The caller's objects are copied, not scrubbed in place.
    assert request["headers"]["X-Api-Key"] == ENV_CANARY


def test_secrets_in_tracebacks_are_redacted() -> None:
    stream = io.StringIO()
    configure("json", stream)

    try:
        raise ValueError(f"bad key {ANTHROPIC_CANARY}")
    except ValueError:
        get_logger().exception("worker_exited", task="t1")

    (event,) = _json_lines(stream)
    assert "ValueError: bad key [redacted]" in event["exception"]
    assert ANTHROPIC_CANARY not in stream.getvalue()


@pytest.mark.parametrize(
    "key", ["api_key", "apiKey", "x-api-key", "authorization", "token", "access_token", "password"]
)
def test_secret_named_keys_are_redacted(key: str) -> None:
    assert Redactor({}).clean_mapping({key: "hunter2"}) == {key: REDACTED}


@pytest.mark.parametrize(
    "key", ["input_tokens", "max_tokens", "tokens", "turn", "keyed", "idempotency_key"]
)
def test_ordinary_keys_are_kept(key: str) -> None:
    assert Redactor({}).clean_mapping({key: 5}) == {key: 5}


def test_values_of_secret_named_env_vars_are_redacted() -> None:
    redactor = Redactor({"GITHUB_TOKEN": "ghp_canary_0123456789", "HOME": "/srv/operator"})

    clean = redactor.clean_text("push with ghp_canary_0123456789 from /srv/operator")

    assert clean == f"push with {REDACTED} from /srv/operator"


def test_secrets_that_appear_after_a_first_use_are_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The redactor remembers the secrets it found, but never past a change of the
    environment or of the credentials held."""
    redactor = Redactor()
    assert redactor.clean_secrets("deploy with ghp_late_canary_01234") == (
        "deploy with ghp_late_canary_01234"
    )

    monkeypatch.setenv("DEPLOY_TOKEN", "ghp_late_canary_01234")
    assert redactor.clean_secrets("deploy with ghp_late_canary_01234") == f"deploy with {REDACTED}"

    monkeypatch.delenv("DEPLOY_TOKEN")
    monkeypatch.setattr(credentials, "_held", credentials.Credentials({"X": "held_canary_56789"}))
    assert redactor.clean_secrets("ghp_late_canary_01234 held_canary_56789") == (
        f"ghp_late_canary_01234 {REDACTED}"
    )


def test_a_short_env_key_is_not_redacted_everywhere() -> None:
    assert Redactor({"ANTHROPIC_API_KEY": "x"}).clean_text("x marks the spot") == "x marks the spot"


def test_console_format_without_tty_has_no_colors() -> None:
    stream = io.StringIO()
    configure("console", stream)

    get_logger().info("task_done", task="t1", reason="end_turn", api_key=ANTHROPIC_CANARY)

    output = stream.getvalue()
    assert "task_done" in output
    assert "reason=end_turn" in output
    assert "task=t1" in output
    assert f"api_key={REDACTED}" in output
    assert "\x1b[" not in output


def test_default_format_is_json_off_a_tty_and_console_on_one() -> None:
    pipe, tty = io.StringIO(), _Tty()

    configure(None, pipe)
    get_logger().info("supervisor_ready")
    configure(None, tty)
    get_logger().info("supervisor_ready")

    assert json.loads(pipe.getvalue())["event"] == "supervisor_ready"
    assert "supervisor_ready" in tty.getvalue()
    assert "\x1b[" in tty.getvalue()  # colors on a terminal


def test_reset_restores_structlog_defaults() -> None:
    configure("json", io.StringIO())
    assert structlog.is_configured()

    reset()

    assert not structlog.is_configured()


# -- per-task event files --------------------------------------------------------------


def test_event_log_is_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    old = os.umask(0o000)
    try:
        TaskEventLog(path).append({"event": "task_submitted"})
    finally:
        os.umask(old)
    path.chmod(0o644)  # someone loosened it: the next append tightens it again

    TaskEventLog(path).append({"event": "worker_spawned"})

    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [e["event"] for e in read_events(path)] == ["task_submitted", "worker_spawned"]


def test_event_log_redacts_what_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"

    TaskEventLog(path).append({"event": "x", "nested": [{"api_key": "k"}], "msg": ANTHROPIC_CANARY})

    assert read_events(path) == [{"event": "x", "nested": [{"api_key": REDACTED}], "msg": REDACTED}]


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = TaskEventLog(path)
    log.append({"event": "worker_spawned"})
    with path.open("ab") as f:
        f.write(b'{"event": "worker_exi')  # the writer died mid-line

    assert [e["event"] for e in read_events(path)] == ["worker_spawned"]

    log.append({"event": "task_resumed"})

    assert [e["event"] for e in read_events(path)] == ["worker_spawned", "task_resumed"]


def test_read_events_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    assert read_events(tmp_path / "events.jsonl") == []


def test_read_events_from_follows_a_growing_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = TaskEventLog(path)
    log.append({"event": "a"})

    events, offset = read_events_from(path, 0)
    assert [e["event"] for e in events] == ["a"]

    with path.open("ab") as f:
        f.write(b'{"event": "b"}\n{"event": "c"')  # c is still being written
    events, offset = read_events_from(path, offset)
    assert [e["event"] for e in events] == ["b"]

    with path.open("ab") as f:
        f.write(b"}\n")
    events, offset = read_events_from(path, offset)
    assert [e["event"] for e in events] == ["c"]
    assert offset == path.stat().st_size
    assert read_events_from(path, offset) == ([], offset)


def test_lines_are_compact_json(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"

    TaskEventLog(path).append({"event": "x", "path": Path("a/b"), "n": 1})

    assert re.fullmatch(r'\{"event":"x","path":"a/b","n":1\}\n', path.read_text())


# -- a log on a full disk ----------------------------------------------------------------

PAGE = 4096  # a line this long needs a page of its own on the tmpfs


def test_a_log_on_a_full_disk_never_raises_and_catches_up_when_space_returns(
    tmp_path: Path,
) -> None:
    with small_disk(tmp_path / "disk", size_mb=1) as disk, open(disk / "daemon.log", "w") as out:
        configure("json", out)
        log = get_logger()
        log.info("before")
        filler = disk / "fill"
        fill(filler)
        for n in range(3):  # each longer than a page: the disk has none to give
            log.warning("while_full", n=n, pad="x" * PAGE)  # the daemon would die if it raised
        assert '"n": 1' not in (disk / "daemon.log").read_text()  # (0 fills the last page)
        filler.unlink()
        log.info("after")
        events = [
            json.loads(line)["event"] for line in (disk / "daemon.log").read_text().splitlines()
        ]
    assert events == ["before", "while_full", "while_full", "while_full", "after"]
    assert dropped_lines() == 0


def test_lines_kept_past_the_backlog_are_dropped_and_counted(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", size_mb=1) as disk, open(disk / "daemon.log", "w") as out:
        sink = LogSink(out, backlog=2)
        filler = disk / "fill"
        fill(filler)
        for n in range(5):
            sink.write(f"line {n} " + "x" * PAGE)
        filler.unlink()
        sink.write("line 5")
        lines = [line[:6] for line in (disk / "daemon.log").read_text().splitlines()]
    assert lines == ["line 4", "line 5"]
    assert sink.dropped == 4


def test_a_closed_stream_does_not_raise() -> None:
    stream = io.StringIO()
    configure("json", stream)
    stream.close()
    get_logger().info("into_the_void")


def test_lines_carry_their_syslog_priority_under_journald_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain, journal = io.StringIO(), io.StringIO()
    configure("json", plain)
    get_logger().warning("dangling_held", task="t1")

    monkeypatch.setenv("JOURNAL_STREAM", "8:123456")
    configure("json", journal)
    log = get_logger()
    log.debug("ignored")  # filtered out: no line at all
    log.info("task_done", task="t1")
    log.warning("dangling_held", task="t1")
    log.error("task_failed", task="t1")

    assert plain.getvalue().startswith("{")
    lines = journal.getvalue().splitlines()
    assert [line[:4] for line in lines] == ["<6>{", "<4>{", "<3>{"]
    assert [json.loads(line[3:])["event"] for line in lines] == [
        "task_done",
        "dangling_held",
        "task_failed",
    ]


def test_no_color_turns_colours_off_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    tty = _Tty()
    configure("console", tty)
    get_logger().warning("dangling_held", task="t1")

    assert "dangling_held" in tty.getvalue()
    assert "\x1b[" not in tty.getvalue()


def test_utc_now_is_the_time_now_to_the_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records and events are stamped with ``utc_now``: ISO 8601 in UTC with milliseconds,
    right across a change of second (its formatted second is cached)."""
    for now in (1_780_000_000.999, 1_780_000_001.0, 1_780_000_001.3, 1_780_000_061.9999996):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        expected = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds")
        assert utc_now() == expected.replace("+00:00", "Z")
