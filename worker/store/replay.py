"""The one replay: a snapshot and the records after it, folded into a ``TaskState``.

The worker (``resume``: it opens the journal for appending, which cuts a torn tail) and
the daemon (``load``: read-only) both come here, so they can never disagree on a task's
state. A snapshot is a cache: one that is damaged, stale or that does not fit the records
after it (a record that needs history a snapshot does not carry: ``NeedsFullReplay``) is
dropped, and the journal is folded from its start; ``on_ignored`` hears of a damaged one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from worker.errors import JournalCorruptError
from worker.state import NeedsFullReplay, OutdatedSnapshot, TaskState, fold
from worker.store.base import JSON, START, Cursor, JournalWriter, Owner, Snapshot, TaskStore

#: What a snapshot or a record that does not have the shape of ours raises when folded.
MISFITS = (KeyError, TypeError, ValueError, AttributeError)

Ignored = Callable[[Exception], None]


def latest_snapshot(store: TaskStore, task_id: str, on_ignored: Ignored | None) -> Snapshot | None:
    """The task's snapshot, or None when there is none or it cannot be used (an earlier
    format's is no damage: it is passed over in silence)."""
    try:
        snapshot = store.get_snapshot(task_id)
        if snapshot is not None and snapshot.cursor <= START:
            # a snapshot follows the journal's header at least: replayed from the start,
            # the whole journal would be folded onto a state that already holds it
            raise ValueError("a snapshot at the start of the journal")
    except OutdatedSnapshot:
        return None
    except (OSError, *MISFITS) as exc:
        if on_ignored is not None:
            on_ignored(exc)
        return None
    return snapshot


def replay(
    prompt: str,
    snapshot: Snapshot | None,
    read: Callable[[Cursor], list[JSON]],
    *,
    on_ignored: Ignored | None = None,
) -> tuple[TaskState, Snapshot | None]:
    """The state ``read`` (the records after a cursor) folds into, from ``snapshot`` when
    it fits, and the snapshot used (None: folded from the start). A journal that cannot
    be folded from its start raises: that is the task's verdict, not a cache miss."""
    if snapshot is not None:
        try:
            return fold(prompt, read(snapshot.cursor), snapshot.state), snapshot
        except JournalCorruptError:
            pass  # damage after the snapshot, or no record at its cursor: distrust it too
        except (NeedsFullReplay, *MISFITS) as exc:
            if on_ignored is not None and not isinstance(exc, NeedsFullReplay):
                on_ignored(exc)
    return fold(prompt, read(START)), None


def load(
    store: TaskStore, task_id: str, *, full: bool = True, prompt: str | None = None
) -> TaskState:
    """The task's state, read-only. ``full=False`` starts from the snapshot when there is
    a usable one: fast, but without the per-turn boundaries that rewind and fork need.
    ``prompt``: the spec's, from a caller that loaded the spec already (no second read)."""
    if prompt is None:
        prompt = store.load_spec(task_id).prompt
    snapshot = None if full else latest_snapshot(store, task_id, None)
    state, _ = replay(prompt, snapshot, lambda after: store.replay(task_id, after))
    return state


def resume(
    store: TaskStore,
    owner: Owner,
    prompt: str,
    *,
    header: Mapping[str, Any] | None = None,
    on_ignored: Ignored | None = None,
) -> tuple[JournalWriter, TaskState, Snapshot | None]:
    """Open ``owner``'s journal for appending and replay it: the writer, the state and the
    snapshot it started from."""
    opened: list[JournalWriter] = []

    def read(after: Cursor) -> list[JSON]:
        while opened:  # a second read: the snapshot did not fit
            opened.pop().close()
        writer, records = store.open_journal(owner, after=after, header=header)
        opened.append(writer)
        return records

    snapshot = latest_snapshot(store, owner.task_id, on_ignored)
    try:
        state, used = replay(prompt, snapshot, read, on_ignored=on_ignored)
    except BaseException:
        while opened:
            opened.pop().close()
        raise
    return opened[0], state, used
