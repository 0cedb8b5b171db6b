"""Every error agentd raises on purpose, in one tree.

Each class carries the process exit code the CLI maps it to (DESIGN.md section 2), and
every message is one full sentence that says what is wrong and what to do next::

    AgentdError                      exit 1  operational error
    ├── UsageError                   exit 2  bad arguments or input from the user
    │   └── InvalidIdError                   a task id or call id that is not allowed
    ├── NotFoundError                exit 3  no such task or call
    ├── StateConflictError           exit 3  the task is not in a state that allows it
    ├── ConfigError                  exit 78 a bad configuration file or value
    ├── SpoolError                   exit 1  the spool cannot be used as it is
    │   ├── JournalCorruptError              damage before the tail of a journal
    │   ├── StorageError                     a write or fsync failed (ENOSPC, EIO, ...)
    │   └── LockBusyError                    another process holds the lock
    ├── TaskSpecError                exit 1  a task's spec or script cannot be used
    └── ModelError                   exit 1  the model backend failed
        └── RetryableModelError              a fault worth retrying (429, 5xx, cut stream)

The supervisor imports this module; it never defines a second tree.
"""

from __future__ import annotations


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
    pass


class LockBusyError(SpoolError):
    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class TaskSpecError(AgentdError):
    pass


class ModelError(AgentdError):
    """A model call failed for good (bad request, bad key, refusal of the request)."""


class RetryableModelError(ModelError):
    """A model call failed in a way that a later attempt may not (429, 5xx, 529, cut stream)."""
