"""Every error agentd raises on purpose, in one tree.

Each class carries the process exit code the CLI maps it to (docs/design.md section 2), and
every message is one full sentence that says what is wrong and what to do next::

    AgentdError                      exit 1  operational error
    ├── UsageError                   exit 2  bad arguments or input from the user
    │   ├── InvalidIdError                   a task id or call id that is not allowed
    │   └── IrreversibleError                a rewind past calls it cannot undo, unconfirmed
    ├── NotFoundError                exit 3  no such task or call
    ├── StateConflictError           exit 3  the task is not in a state that allows it
    ├── ConfigError                  exit 78 a bad configuration file or value
    ├── SpoolError                   exit 1  the spool cannot be used as it is
    │   ├── JournalCorruptError              damage before the tail of a journal
    │   ├── StorageError                     a write or fsync failed (ENOSPC, EIO, ...)
    │   ├── LockBusyError                    another process holds the lock
    │   ├── FencedError                      a step of an owner whose ownership moved
    │   │   └── SupersededError              a node whose name another daemon registered
    │   ├── RecordConflictError              a task record changed since it was read
    │   └── SchemaVersionError       exit 78 the database's schema is not this release's
    ├── AddressInUseError            exit 1  a listener's address is another process's
    ├── ClusterError                 exit 1  a throwaway PostgreSQL could not be started
    ├── TaskSpecError                exit 1  a task's spec or script cannot be used
    └── ModelError                   exit 1  the model backend failed
        ├── RetryableModelError              a fault worth retrying (429, 5xx, cut stream)
        └── ContextTooLongError              the prompt does not fit the context window

A *storage fault* (``storage_fault``) is a StorageError or OSError whose errno is one of
``STORAGE_ERRNOS``: the disk is full, failing or read-only. It is a wait, never a verdict
on the task (docs/design.md invariant 8): a worker exits with the storage code and the daemon
retries once the fault may have cleared. Any other StorageError (a record over the size
limit, a permission refused) is an error that a retry will not fix by itself.

The supervisor imports this module; it never defines a second tree.
"""

from __future__ import annotations

import errno as errnos

#: The most characters of a value an error line quotes (``quoted``): an argument of
#: 10,000 characters must not make a line of 10,000.
QUOTED_LIMIT = 80


def quoted(value: str, limit: int = QUOTED_LIMIT) -> str:
    """``value`` as an error line quotes it (``repr``), cut to ``limit`` characters of it,
    saying how long it was when it was cut."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


#: The errnos of a disk that is full, failing or read-only: faults that clear by themselves
#: or by an operator's hand (space freed, a disk remounted), never the task's fault.
STORAGE_ERRNOS = frozenset({errnos.ENOSPC, errnos.EDQUOT, errnos.EIO, errnos.EROFS})
#: What a fork or a thread meets when the machine (or the task's cgroup) has no process
#: or memory left: another task's tools may hold them all.
RESOURCE_ERRNOS = frozenset({errnos.EAGAIN, errnos.ENOMEM})


class AgentdError(Exception):
    """Base class: an expected failure with a one-line, actionable message."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(AgentdError):
    exit_code = 2


class InvalidIdError(UsageError):
    pass


class IrreversibleError(UsageError):
    """A rewind would go back past calls whose effects it cannot undo, and was not
    confirmed (``--yes``); ``calls`` lists them (turn, call_id, tool, effect)."""

    def __init__(self, message: str, calls: list[dict[str, object]]) -> None:
        super().__init__(message)
        self.calls = calls


class NotFoundError(AgentdError):
    exit_code = 3


class StateConflictError(AgentdError):
    exit_code = 3


class ConfigError(AgentdError):
    exit_code = 78


class SpoolError(AgentdError):
    pass


class JournalCorruptError(SpoolError):
    pass


class StorageError(SpoolError):
    """A write or sync failed; ``errno`` is the OSError's (None when no syscall failed).
    ``cause`` names a database's fault (``worker.store.pgdatabase.DatabaseFault``: ``login``,
    ``read_only``...), None for a disk's."""

    def __init__(self, message: str, errno: int | None = None, *, cause: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.cause = cause

    @property
    def fault(self) -> bool:
        """Whether this is a storage fault (``STORAGE_ERRNOS``): a wait, not an error."""
        return self.errno in STORAGE_ERRNOS


class LockBusyError(SpoolError):
    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class FencedError(SpoolError):
    """The task's ownership moved (a lock released, a lease taken over): the step of its
    old owner is refused, so no task is ever advanced by two workers (invariant 10)."""


class SupersededError(FencedError):
    """Another daemon registered this node's name since this one did (it was frozen past
    its lease, say): this daemon's claims and renewals are refused. ``epoch`` is the
    registration it held; ``now`` the one the name has (epoch, pid, host), None when no
    daemon holds the name any more."""

    def __init__(self, message: str, epoch: int, now: tuple[int, int, str] | None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.now = now


class RecordConflictError(SpoolError):
    """A task record was changed by someone else since it was read: read it again."""


class SchemaVersionError(SpoolError):
    """The shared store's schema is newer than this release, or not agentd's: running
    against it could corrupt what newer nodes wrote, and a restart will not fix it."""

    exit_code = 78


class AddressInUseError(AgentdError):
    """A listener of the daemon (``[metrics] listen``) cannot bind: another process has
    the address. (An address that is not this machine's is a ``ConfigError``.)"""


class ClusterError(AgentdError):
    """A throwaway PostgreSQL (``supervisor.pgcluster``) could not be made or started."""


class TaskSpecError(AgentdError):
    pass


class ModelError(AgentdError):
    """A model call failed for good (bad request, bad key, refusal of the request)."""


class RetryableModelError(ModelError):
    """A model call failed in a way that a later attempt may not (429, 5xx, 529, cut stream)."""


class ContextTooLongError(ModelError):
    """The API refused the prompt as longer than the model's context window: the loop
    compacts the transcript once and retries (docs/design.md section 4)."""


def resource_fault(exc: BaseException) -> str | None:
    """Why ``exc`` (itself, or what caused it) is the machine refusing a process, a thread
    or memory, in one line; None for any other error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in RESOURCE_ERRNOS:
            return f"no process or memory to be had ({current})"
        if isinstance(current, RuntimeError) and "can't start new thread" in str(current):
            return "no thread to be had (the machine's processes are used up)"
        if isinstance(current, MemoryError):
            return "no memory to be had"
        current = current.__cause__ or current.__context__
    return None


def storage_fault(exc: BaseException) -> StorageError | None:
    """The storage fault behind ``exc`` (itself, or what caused it), or None.

    The one place that tells a full, failing or read-only disk from every other error,
    whatever raised it: a StorageError of ours, or a bare OSError from any write (the
    events file, a folder, the lock). An OSError is named as a StorageError."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StorageError) and current.fault:
            return current
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            name = errnos.errorcode.get(current.errno, "error")
            where = f" on {current.filename}" if current.filename else ""
            return StorageError(
                f"a write{where} failed ({name}: {current.strerror}); nothing recorded was "
                "changed. Free space or fix the disk: agentd goes on by itself once it can write.",
                current.errno,
            )
        current = current.__cause__ or current.__context__
    return None
