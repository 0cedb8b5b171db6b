"""Months of tasks (docs/design.md section 20): which ended tasks may go, removing them
whole, and archives that bring them back byte for byte.

* A task may be removed or archived only when it has ended (``done``, ``failed``,
  ``cancelled``) and no worker holds it (``agentd run`` may still own a task whose record
  says it ended); ``refuse_live`` says why not, in the CLI's one line.
* Its age is counted from when it ended: the time its record was last written, which for
  an ended task is its arrival in that state (``TaskRecord.updated_at``).
* ``remove`` is crash-safe: under the task's operator lock (so no retry, rewind or
  decision races it) the task's folder is renamed into ``SPOOL/removed/`` in one step,
  and only then deleted. A kill at any point leaves the task whole in ``tasks/`` or gone
  from it; what a kill left in ``removed/`` is deleted by ``finish_removals``, which every
  prune and every daemon start runs. The task's private GIT_DIR (its snapshot refs) and
  its default workspace live in its folder and go with it; a workspace of the user's
  own, elsewhere, is never touched.
* An archive is a gzip'd tar: ``manifest.json`` first (``ARCHIVE_FORMAT``,
  ``ARCHIVE_VERSION``, each task's state and every file's size and SHA-256), then each
  task's files under ``tasks/ID/``. The workspace and the lock files are left out; the
  rest (spec, record, journal, snapshot, decisions, events, the worker's output and
  exit, the private GIT_DIR) goes in whole. ``restore`` checks every byte against the
  manifest before it moves a task into place, and refuses a name in use.

Only the spool's files are handled here: a shared store (PostgreSQL) is refused in one
line by the commands.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import stat
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from supervisor.coordination import operator_lock
from supervisor.record import TaskRecord
from supervisor.stores import store_for
from supervisor.submit import existing_task
from worker.config import RETENTION_STATES, RetentionConfig, age_text, period_text
from worker.errors import StateConflictError, UsageError
from worker.events import utc_now
from worker.protocol import FINAL_STATES, TaskStatus
from worker.spool import Spool, TaskDir, validate_task_id
from worker.store.durable import (
    DIR_MODE,
    FILE_MODE,
    dump_json,
    fsync_dir,
    load_json,
    move_exclusive,
    private_dir,
)

#: What an archive's manifest says it is, and the version of its layout.
ARCHIVE_FORMAT = "agentd-archive"
ARCHIVE_VERSION = 1
MANIFEST = "manifest.json"
#: ``SPOOL/removed/``: task folders being deleted (renamed here first, in one step).
REMOVED = "removed"
#: What an archive leaves out of a task's folder: the workspace (the user's files, not
#: the task's record) and the locks, which only mean something while held.
LEFT_OUT = frozenset({"workspace", "lock", "operator.lock"})
#: The most bytes a restore unpacks (a hostile archive cannot fill the disk).
RESTORE_LIMIT = 64 * 1024**3
_READ = 1 << 20


@dataclass(frozen=True)
class Ended:
    """An ended task, as retention sees it."""

    id: str
    state: TaskStatus
    ended_at: datetime | None  # None: its record names no time (an older release's)

    def age(self, now: datetime) -> float:
        """Seconds since it ended (0 when unknown: never old enough by age alone)."""
        return 0.0 if self.ended_at is None else max(0.0, (now - self.ended_at).total_seconds())


def _stamp(text: str) -> datetime | None:
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


def ended(task: TaskDir) -> Ended | None:
    """The task as retention sees it, or None while it has not ended."""
    record = TaskRecord.load(task)
    if record.state not in FINAL_STATES:
        return None
    return Ended(task.id, record.state, _stamp(record.updated_at))


def refuse_live(spool: Spool, task: TaskDir, verb: str) -> Ended:
    """The task if it may be removed or archived, else ``StateConflictError`` (exit 3):
    it has not ended, or a worker (``agentd run``'s, or one not yet reaped) holds it."""
    found = ended(task)
    if found is None:
        state = TaskRecord.load(task).state
        raise StateConflictError(
            f"task {task.id} is {state}; only a done, failed or cancelled task can be "
            f"{verb} (`agentd cancel {task.id}` ends it for good)."
        )
    if store_for(spool).owned(task.id):
        raise StateConflictError(
            f"task {task.id} is {found.state} but a worker still holds it (`agentd run`?); "
            f"{verb.rstrip('d')} it once that process has ended."
        )
    return found


# -- choosing ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PruneRequest:
    """What ``agentd prune`` was asked to remove: names, an age, states; or, with none of
    them, the ``[retention]`` periods."""

    names: tuple[str, ...] = ()
    older_than: float | None = None
    states: tuple[str, ...] = ()

    @property
    def by_retention(self) -> bool:
        return not self.names and self.older_than is None and not self.states


def checked_states(text: str | None) -> tuple[str, ...]:
    """``--state done,failed``: end states only (a live task is never removed)."""
    if text is None:
        return ()
    states = tuple(part.strip() for part in text.split(",") if part.strip())
    wrong = [s for s in states if s not in RETENTION_STATES]
    if not states or wrong:
        raise UsageError(
            f"--state takes end states ({', '.join(RETENTION_STATES)}), got "
            f"{', '.join(wrong) or repr(text)}; a queued, running, backoff or held task is "
            "never removed."
        )
    return states


def why_due(found: Ended, asked: PruneRequest, retention: RetentionConfig, now: datetime) -> str:
    """Why ``found`` goes, or "" when it stays."""
    age = found.age(now)
    if asked.by_retention:
        period = retention.period(found.state)
        if period is None or found.ended_at is None or age < period:
            return ""
        kept = period_text(period)
        return f"{found.state} {age_text(age)} ago; [retention] {found.state} = {kept}"
    if asked.states and found.state not in asked.states:
        return ""
    if asked.older_than is not None:
        if found.ended_at is None or age < asked.older_than:
            return ""
        bound = period_text(asked.older_than)
        return f"{found.state} {age_text(age)} ago, older than {bound}"
    if asked.names:
        return f"{found.state}, named"
    return f"{found.state}, --state"


def candidates(
    spool: Spool, selection: PruneRequest, retention: RetentionConfig, now: datetime
) -> Iterator[tuple[Ended, str]]:
    """Each task the selection removes, with why: named tasks that have not ended are
    refused (before anything is removed), other live tasks are passed over."""
    if selection.by_retention and not retention.any:
        raise UsageError(
            "agentd prune needs a TASK, --older-than or --state, or a [retention] period in "
            "the config; it never means every task."
        )
    store = store_for(spool)
    if selection.names:
        tasks = [existing_task(spool, name) for name in selection.names]
        found = [refuse_live(spool, task, "removed") for task in tasks]
    else:
        found = []
        for task_id in store.task_ids():
            with contextlib.suppress(OSError):
                task = ended(spool.task(task_id))
                if task is not None:
                    found.append(task)
    for task in sorted(found, key=lambda t: (t.ended_at is None, t.ended_at or now, t.id)):
        why = why_due(task, selection, retention, now)
        if why:
            yield task, why


# -- removing ----------------------------------------------------------------------------


def removed_dir(spool: Spool) -> Path:
    return private_dir(spool.root / REMOVED)


def remove(spool: Spool, task_id: str, *, archive_to: Path | None = None) -> Path | None:
    """Remove one ended task whole (module docstring): archived first into ``archive_to``
    when given (the archive's path is returned). Checked again under the operator lock,
    so a retry, rewind or decision that came meanwhile wins and the task stays."""
    task = existing_task(spool, task_id)
    archive: Path | None = None
    with operator_lock(task):
        refuse_live(spool, task, "removed")
        if archive_to is not None:
            archive = archive_path(archive_to, task.id)
            write_archive(spool, [task], archive, locked=True)
        trash = removed_dir(spool) / f"{task.id}.{os.getpid()}.{time.monotonic_ns()}"
        os.rename(task.path, trash)
        fsync_dir(task.path.parent)
        fsync_dir(trash.parent)
    _delete(trash)
    with contextlib.suppress(FileNotFoundError):
        (spool.relay_dir / f"{task.id}.json").unlink()
    return archive


def _delete(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def finish_removals(spool: Spool) -> list[str]:
    """Delete what a removal killed midway left in ``SPOOL/removed/``: each task there was
    already gone from ``tasks/``. Returns the task ids finished."""
    folder = spool.root / REMOVED
    try:
        left = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    for name in left:
        _delete(folder / name)
    return [name.split(".", 1)[0] for name in left]


# -- archives ----------------------------------------------------------------------------


def archive_path(folder: Path, task_id: str) -> Path:
    """Where ``[retention] archive_to`` keeps a task's archive: ``ID-YYYYmmddTHHMMSSZ``."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return _folder_of_archives(folder) / f"{task_id}-{stamp}.tar.gz"


def _folder_of_archives(folder: Path) -> Path:
    """``folder``, made 0700 (with its parents) when missing; one that exists is the
    operator's and keeps its mode (an archive written into /tmp never tightens /tmp)."""
    if not folder.is_dir():
        folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return folder


def _files(task: TaskDir) -> Iterator[tuple[str, Path]]:
    """Each regular file of the task's folder an archive keeps, by its path under it, in
    a stable order; the workspace and the locks left out, symlinks never followed."""
    root = task.path
    for folder, dirs, names in os.walk(root, followlinks=False):
        here = Path(folder)
        rel_dir = here.relative_to(root)
        if rel_dir == Path("."):
            dirs[:] = [d for d in dirs if d not in LEFT_OUT]
        dirs.sort()
        for name in sorted(names):
            if rel_dir == Path(".") and name in LEFT_OUT:
                continue
            path = here / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                yield (rel_dir / name).as_posix(), path


def _digest(path: Path) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_READ):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def write_archive(
    spool: Spool, tasks: Iterable[TaskDir], dest: Path, *, locked: bool = False
) -> dict[str, Any]:
    """Write ``tasks`` (each ended: checked) whole into the archive ``dest``, durably
    (a temp file beside it, fsynced, renamed); returns the manifest. Each task is read
    under its operator lock (``locked``: the caller holds it) so that no retry or rewind
    changes it midway."""
    dest = dest.absolute()
    if dest.exists():
        raise StateConflictError(
            f"{dest} exists; give a new file name (an archive is never overwritten)."
        )
    entries: list[dict[str, Any]] = []
    members: list[tuple[str, Path]] = []
    for task in tasks:
        with contextlib.nullcontext() if locked else operator_lock(task):
            found = refuse_live(spool, task, "archived")
            files: dict[str, dict[str, Any]] = {}
            for rel, path in _files(task):
                digest, size = _digest(path)
                files[rel] = {"sha256": digest, "size": size}
                members.append((f"tasks/{task.id}/{rel}", path))
            entries.append({"id": task.id, "state": str(found.state), "files": files})
    manifest = {
        "format": ARCHIVE_FORMAT,
        "version": ARCHIVE_VERSION,
        "created_at": utc_now(),
        "tasks": entries,
    }
    _folder_of_archives(dest.parent)
    temp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz") as tar:
                body = dump_json(manifest)
                info = tarfile.TarInfo(MANIFEST)
                info.size, info.mode, info.mtime = len(body), FILE_MODE, int(time.time())
                tar.addfile(info, io.BytesIO(body))
                for name, path in members:
                    info = tar.gettarinfo(str(path), arcname=name)
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    info.mode = FILE_MODE
                    with path.open("rb") as f:
                        tar.addfile(info, f)
            raw.flush()
            os.fsync(raw.fileno())
        os.rename(temp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return manifest


def _bad(archive: Path, why: str) -> UsageError:
    return UsageError(f"{archive} is not an agentd archive that can be restored: {why}.")


_MEMBER = re.compile(r"tasks/([^/]+)/(.+)")


def read_manifest(archive: Path, tar: tarfile.TarFile) -> dict[str, Any]:
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isfile():
        raise _bad(archive, f"its first member is not {MANIFEST}")
    extracted = tar.extractfile(first)
    if extracted is None or first.size > 64 * 1024**2:
        raise _bad(archive, f"{MANIFEST} cannot be read")
    try:
        manifest = load_json(extracted.read())
    except ValueError as exc:
        raise _bad(archive, f"{MANIFEST} is not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        raise _bad(archive, "its manifest is not an agentd archive's")
    if manifest.get("version") != ARCHIVE_VERSION:
        raise _bad(
            archive,
            f"its version is {manifest.get('version')!r}; this agentd reads version "
            f"{ARCHIVE_VERSION}",
        )
    tasks = manifest.get("tasks")
    if not isinstance(tasks, list) or not all(
        isinstance(t, dict) and isinstance(t.get("id"), str) and isinstance(t.get("files"), dict)
        for t in tasks
    ):
        raise _bad(archive, "its manifest lists no tasks")
    return manifest


def _safe_rel(rel: str) -> bool:
    path = PurePosixPath(rel)
    return (
        not path.is_absolute()
        and ".." not in path.parts
        and "\0" not in rel
        and path.parts[:1] != ("workspace",)
        and path.parts != ("lock",)
    )


def restore(spool: Spool, archive: Path) -> list[str]:
    """Bring the archive's tasks back into the spool byte for byte, checked against the
    manifest before any task is moved into place; a task id in use is refused (exit 3)
    and nothing is restored then. Returns the ids restored."""
    store = store_for(spool)
    try:
        tar = tarfile.open(archive, mode="r:gz")  # noqa: SIM115  (closed by the with below)
    except (OSError, tarfile.TarError) as exc:
        raise _bad(archive, str(exc)) from exc
    staging = Path(spool.ensure().tmp_dir) / f".restore-{os.getpid()}-{time.monotonic_ns()}"
    private_dir(staging)
    try:
        with tar:
            manifest = read_manifest(archive, tar)
            wanted: dict[str, dict[str, Any]] = {}
            for entry in manifest["tasks"]:
                task_id = validate_task_id(entry["id"])
                if task_id in wanted:
                    raise _bad(archive, f"it lists task {task_id} twice")
                for rel in entry["files"]:
                    if not isinstance(rel, str) or not _safe_rel(rel):
                        raise _bad(archive, f"task {task_id} names the file {rel!r}")
                wanted[task_id] = entry
            in_use = [task_id for task_id in wanted if store.exists(task_id)]
            if in_use:
                raise StateConflictError(
                    f"task {in_use[0]} exists in this spool; nothing was restored "
                    f"(`agentd prune {in_use[0]}` removes it, or restore into another spool)."
                )
            seen: set[tuple[str, str]] = set()
            folders: set[Path] = set()
            unpacked = 0
            for index, member in enumerate(tar):
                if index == 0:
                    continue  # the manifest, read above
                match = _MEMBER.fullmatch(member.name)
                if match is None or not member.isfile():
                    raise _bad(archive, f"it holds {member.name!r}, which no task lists")
                task_id, rel = match[1], match[2]
                entry = wanted.get(task_id)
                listed = entry["files"].get(rel) if entry is not None else None
                if not isinstance(listed, dict) or (task_id, rel) in seen:
                    raise _bad(archive, f"it holds {member.name!r}, which no task lists")
                unpacked += member.size
                if unpacked > RESTORE_LIMIT:
                    raise _bad(archive, "it unpacks to more than 64 GiB")
                _unpack(tar, member, staging / task_id / rel, listed, archive, folders)
                seen.add((task_id, rel))
            for task_id, entry in wanted.items():
                missing = [rel for rel in entry["files"] if (task_id, rel) not in seen]
                if missing:
                    raise _bad(archive, f"task {task_id}'s {missing[0]} is missing")
                _private_dirs(staging / task_id, folders)
        for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
            fsync_dir(folder)
        restored: list[str] = []
        tasks_dir = private_dir(spool.tasks_dir)
        for task_id in wanted:
            if not move_exclusive(staging / task_id, tasks_dir / task_id):
                raise StateConflictError(
                    f"task {task_id} came into this spool while restoring; "
                    f"{', '.join(restored) or 'nothing'} restored."
                )
            restored.append(task_id)
        return restored
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _private_dirs(folder: Path, made: set[Path]) -> None:
    """Make ``folder`` and the folders above it that are missing, each 0700, noting each
    in ``made`` (to be synced once every file is in)."""
    if folder in made or folder.is_dir():
        made.add(folder)
        return
    _private_dirs(folder.parent, made)
    os.mkdir(folder, DIR_MODE)
    made.add(folder)


def _unpack(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    dest: Path,
    listed: dict[str, Any],
    archive: Path,
    folders: set[Path],
) -> None:
    source = tar.extractfile(member)
    if source is None:
        raise _bad(archive, f"{member.name} cannot be read")
    _private_dirs(dest.parent, folders)
    sha = hashlib.sha256()
    fd = os.open(
        dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE
    )
    with os.fdopen(fd, "wb") as out:
        while chunk := source.read(_READ):
            sha.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if sha.hexdigest() != listed.get("sha256") or member.size != listed.get("size"):
        raise _bad(archive, f"{member.name} does not match its SHA-256 in the manifest")
    os.utime(dest, (member.mtime, member.mtime))


def spool_bytes(spool: Spool) -> int:
    """The bytes the spool's files take (their allocated blocks), symlinks not followed."""
    total = 0
    for folder, _, names in os.walk(spool.root, followlinks=False):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total
