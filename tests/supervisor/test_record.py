"""The task record's moves (supervisor/record.py): each one, and each refusal, on real
records in a real task folder. The CLI and the daemon make exactly these moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.control import change_record, move_record
from supervisor.record import CANCEL_REASON, FIELD_SHAPES, Move, TaskRecord, arrival, legal
from tests.support import make_spool, reply, scripted_task, text
from worker.errors import StateConflictError
from worker.protocol import FINAL_STATES, TaskStatus
from worker.spool import TaskDir

CRASHES = [{"turn": 1, "progressed": False}, {"turn": 1, "progressed": False}]


@pytest.fixture
def task(tmp_path: Path) -> TaskDir:
    return scripted_task(make_spool(tmp_path), [reply(text("done"))])


def recorded(task: TaskDir, state: TaskStatus) -> TaskRecord:
    """Save a record in ``state`` (with a crash history and a reason) and read it back."""
    TaskRecord(state=state, reason="why", restarts=2, crashes=list(CRASHES)).save(task)
    return TaskRecord.load(task)


def test_a_record_reads_back_with_its_state_as_text(task: TaskDir) -> None:
    record = recorded(task, TaskStatus.BACKOFF)
    assert record.state is TaskStatus.BACKOFF
    assert json.loads(task.state.read_bytes())["state"] == "backoff"


@pytest.mark.parametrize(
    "content", ['{"state": "paused"}', '{"reason": "x"}', '{"state": ["held"]}', "[]", "7"]
)
def test_a_record_of_no_known_state_is_a_failed_task(task: TaskDir, content: str) -> None:
    task.state.write_text(content)
    record = TaskRecord.load(task)
    assert record.state is TaskStatus.FAILED
    assert record.reason == f"{task.state} is not a task record"


@pytest.mark.parametrize(
    "field",
    [
        {"restarts": "y"},  # found by the fuzz campaign: the daemon compared it with 0
        {"restarts": True},
        {"reason": 3},
        {"last_exit": "x"},
        {"pid": "x"},
        {"pid_started": "1.0"},
        {"crashes": {"turn": 1}},
        {"crashes": [1]},
        {"updated_at": None},
    ],
)
def test_a_record_with_a_field_of_the_wrong_type_is_a_failed_task(
    task: TaskDir, field: dict[str, object]
) -> None:
    task.state.write_text(json.dumps({"state": "running", "pid": 1, **field}))
    record = TaskRecord.load(task)
    assert record.state is TaskStatus.FAILED
    assert record.reason == f"{task.state} is not a task record"


def test_every_field_of_a_record_has_a_shape_to_check() -> None:
    assert set(FIELD_SHAPES) == set(TaskRecord.__dataclass_fields__) - {"state"}


@pytest.mark.parametrize(
    "state", [TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.BACKOFF, TaskStatus.HELD]
)
def test_cancel_is_taken_by_any_task_that_has_not_ended(task: TaskDir, state: TaskStatus) -> None:
    record = recorded(task, state)
    record.cancel(task.id)
    assert (record.state, record.reason) == (TaskStatus.CANCELLED, CANCEL_REASON)


@pytest.mark.parametrize("state", sorted(FINAL_STATES))
def test_cancel_is_refused_once_the_task_has_ended(task: TaskDir, state: TaskStatus) -> None:
    recorded(task, state)
    before = task.state.read_bytes()
    with pytest.raises(StateConflictError, match=f"task {task.id} is already {state}; nothing"):
        move_record(task, TaskRecord.cancel)
    assert task.state.read_bytes() == before  # refused: nothing written


def test_retry_queues_a_failed_task_with_no_crash_history(task: TaskDir) -> None:
    recorded(task, TaskStatus.FAILED)
    move_record(task, TaskRecord.retry)
    record = TaskRecord.load(task)
    assert (record.state, record.reason, record.crashes) == (TaskStatus.QUEUED, None, [])
    assert record.restarts == 2  # the count of restarts is history, kept


@pytest.mark.parametrize("state", [s for s in TaskStatus if s is not TaskStatus.FAILED])
def test_retry_is_refused_unless_the_task_failed(task: TaskDir, state: TaskStatus) -> None:
    record = recorded(task, state)
    with pytest.raises(StateConflictError, match=f"is {state}; only a failed task can be retried"):
        record.retry(task.id)
    assert record == TaskRecord.load(task)  # the refused move changed nothing


@pytest.mark.parametrize("state", [s for s in TaskStatus if s is not TaskStatus.CANCELLED])
def test_requeue_queues_a_task_from_any_state_but_cancelled(
    task: TaskDir, state: TaskStatus
) -> None:
    record = recorded(task, state)
    record.requeue(task.id)
    assert (record.state, record.reason, record.crashes) == (TaskStatus.QUEUED, None, [])


def test_requeue_is_refused_for_a_cancelled_task(task: TaskDir) -> None:
    record = recorded(task, TaskStatus.CANCELLED)
    with pytest.raises(StateConflictError, match="cancelled task takes no requeue"):
        record.requeue(task.id)
    assert record.state is TaskStatus.CANCELLED


def test_release_hold_queues_a_held_task_and_keeps_its_crashes(task: TaskDir) -> None:
    record = recorded(task, TaskStatus.HELD)
    record.release_hold(task.id)
    assert (record.state, record.reason, record.crashes) == (TaskStatus.QUEUED, None, CRASHES)


@pytest.mark.parametrize("state", [s for s in TaskStatus if s is not TaskStatus.HELD])
def test_release_hold_is_refused_unless_the_task_is_held(task: TaskDir, state: TaskStatus) -> None:
    record = recorded(task, state)
    with pytest.raises(StateConflictError, match="no hold to release"):
        record.release_hold(task.id)
    assert record.state is state


@pytest.mark.parametrize(
    ("move", "name"), [(TaskRecord.retry, "retry.request"), (TaskRecord.requeue, "requeue.request")]
)
def test_change_record_makes_the_move_itself_when_no_daemon_runs(
    tmp_path: Path, task: TaskDir, move: Move, name: str
) -> None:
    recorded(task, TaskStatus.FAILED)
    assert change_record(make_spool(tmp_path), task, name, move)
    assert TaskRecord.load(task).state is TaskStatus.QUEUED
    assert not (task.path / name).exists()  # no request left: nothing to apply later


# -- the one transition --------------------------------------------------------------------


@pytest.mark.parametrize("old", list(TaskStatus))
@pytest.mark.parametrize("new", list(TaskStatus))
def test_a_state_is_left_as_the_rules_say(old: TaskStatus, new: TaskStatus) -> None:
    """Live states move freely; done and failed go back only to the queue (retry, rewind);
    cancelled never moves; staying put is always allowed."""
    record = TaskRecord(state=old)
    expected = (
        old == new
        or old not in FINAL_STATES
        or (old != TaskStatus.CANCELLED and new == TaskStatus.QUEUED)
    )
    assert legal(old, new) is expected
    if expected:
        record.move_to(new, "t1")
        assert record.state == new
    else:
        with pytest.raises(StateConflictError, match=f"task t1 is {old}; it cannot become {new}"):
            record.move_to(new, "t1")
        assert record.state == old  # nothing changed


def test_an_arrival_is_its_event_once() -> None:
    assert arrival(TaskStatus.RUNNING, TaskStatus.DONE) == ("task_done", "info")
    assert arrival(TaskStatus.BACKOFF, TaskStatus.FAILED) == ("task_failed", "error")
    assert arrival(TaskStatus.HELD, TaskStatus.CANCELLED) == ("task_cancelled", "info")
    assert arrival(TaskStatus.FAILED, TaskStatus.FAILED) is None  # no second task_failed
    assert arrival(TaskStatus.QUEUED, TaskStatus.RUNNING) is None  # told by worker_spawned


def test_the_operators_moves_go_through_the_one_transition(task: TaskDir) -> None:
    record = recorded(task, TaskStatus.CANCELLED)
    for move in (TaskRecord.retry, TaskRecord.requeue, TaskRecord.release_hold):
        with pytest.raises(StateConflictError):
            move(record, task.id)
    assert record.state == TaskStatus.CANCELLED
