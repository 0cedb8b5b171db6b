"""The heartbeat: the loop never writes it; its thread does, every interval."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import poll_for
from worker.heartbeat import Heartbeat, Publish
from worker.metrics import StepMetrics
from worker.store.durable import atomic_write_json


@pytest.fixture
def writes() -> list[dict[str, object]]:
    """Every beat published, as its JSON."""
    return []


def to_file(path: Path, writes: list[dict[str, object]]) -> Publish:
    """Publish beats to ``path`` as the file store does, keeping each in ``writes``."""

    def publish(beat: dict[str, object]) -> None:
        writes.append(beat)
        atomic_write_json(path, beat, durable=False)

    return publish


def test_start_writes_a_beat_and_updates_never_write_the_file(
    tmp_path: Path, writes: list[dict[str, object]]
) -> None:
    beat = Heartbeat(to_file(tmp_path / "heartbeat.json", writes), interval=0.2)
    beat.update(turn=3)
    assert writes == []
    beat.start()
    try:
        assert [w["turn"] for w in writes] == [3]
        beat.phase("tool:write_file")
        beat.update(turn=4, usage={"input_tokens": 5})
        assert len(writes) == 1  # the caller never writes; the next beat carries it all
        poll_for(lambda: len(writes) == 2, 5, what="the next beat")
        last = json.loads((tmp_path / "heartbeat.json").read_text())
        assert last["turn"] == 4
        assert last["phase"] == "tool:write_file"
        assert last["usage"] == {"input_tokens": 5}
    finally:
        beat.stop()


def test_the_thread_beats_every_interval_and_stops_at_once(
    tmp_path: Path, writes: list[dict[str, object]]
) -> None:
    beat = Heartbeat(to_file(tmp_path / "heartbeat.json", writes), interval=0.05).start()
    poll_for(lambda: len(writes) >= 4, 5, what="four beats")
    times = [float(w["at"]) for w in writes]  # type: ignore[arg-type]
    assert times == sorted(times)
    started = time.monotonic()
    beat.stop()
    assert time.monotonic() - started < 0.5
    count = len(writes)
    time.sleep(0.15)
    assert len(writes) == count


def test_each_instant_is_stamped_on_the_monotonic_clock_too(
    tmp_path: Path, writes: list[dict[str, object]]
) -> None:
    """Verdicts compare monotonic stamps (supervisor/liveness.py); wall time is display."""
    before = time.monotonic()
    beat = Heartbeat(to_file(tmp_path / "heartbeat.json", writes), interval=0.2)
    beat.phase("model")
    beat.start()
    beat.stop()
    after = time.monotonic()
    (last,) = writes
    assert before <= float(last["phase_started_mono"]) <= float(last["at_mono"]) <= after  # type: ignore[arg-type]
    assert abs(float(last["at"]) - time.time()) < 5  # type: ignore[arg-type]
    assert last["interval"] == 0.2


def test_a_final_stop_publishes_the_metrics_of_the_last_interval(
    tmp_path: Path, writes: list[dict[str, object]]
) -> None:
    metrics = StepMetrics()
    Heartbeat(to_file(tmp_path / "never.json", writes), interval=60, metrics=metrics).stop(
        final=True
    )
    assert writes == []  # never started: no beat at all
    beat = Heartbeat(
        to_file(tmp_path / "heartbeat.json", writes), interval=60, metrics=metrics
    ).start()
    metrics.tool_called("read_file", 0.01)  # after the first beat, long before the next
    beat.stop(final=True)
    first, last = writes
    assert first["metrics"]["tool_call"] == {}  # type: ignore[index]
    assert sum(last["metrics"]["tool_call"]["read_file"]["b"]) == 1  # type: ignore[index]
    on_disk = json.loads((tmp_path / "heartbeat.json").read_text())
    assert on_disk["metrics"] == metrics.to_json()


def test_a_followed_field_is_read_as_each_beat_is_written(
    tmp_path: Path, writes: list[dict[str, object]]
) -> None:
    """The journal's durable size changes when a background sync returns, with no word
    from the loop: each beat reads it then (the last one too)."""
    durable = [100]
    beat = Heartbeat(to_file(tmp_path / "heartbeat.json", writes), interval=0.05)
    beat.follow(journal=lambda: durable[0])
    beat.start()
    try:
        assert last(writes) == 100
        durable[0] = 250
        poll_for(lambda: last(writes) == 250, 10, what="a beat that read it again")
        durable[0] = 300
    finally:
        beat.stop(final=True)
    assert last(writes) == 300
    assert json.loads((tmp_path / "heartbeat.json").read_text())["journal"] == 300


def last(writes: list[dict[str, object]]) -> object:
    """The journal field of the last beat written."""
    return writes[-1]["journal"]
