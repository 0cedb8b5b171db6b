"""Who did what (docs/design.md section 15): the person behind an operator's action.

Every action an operator takes on a task (a decision on a held call, a cancel, a retry, a
rewind, a fork) records ``by``, the Unix user who took it, and ``via``, the way it came:

* ``cli``: an ``agentd`` command (``by``: the user who ran it);
* ``console``: the web page (``by``: the user who opened it with ``agentd console``);
* ``api``: a script with an API token (``by``: the user who minted it with ``agentd
  console --token``);
* ``run``: ``agentd run``'s prompt at the terminal.

The two fields are added to what each action writes already (the decision, the cancel
record, the retry request, the rewind's journal record, the fork's spec and base record)
and to its event, so that ``history``, ``logs``, ``show``, the daemon's log and the hooks'
payloads show them. Readers of an earlier release ignore them: nothing is renamed. An
automatic action (a re-run the rules allow, a restart, a rescan) carries neither, and the
mark the daemon puts on its own event lines is another field (``origin``,
``supervisor.relay``): ``by`` is always a person.
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from worker.records import Who


class Via(StrEnum):
    """How an operator's action came (the ``via`` field)."""

    CLI = "cli"
    CONSOLE = "console"
    API = "api"
    RUN = "run"


@dataclass(frozen=True)
class Operator:
    """The person an action is recorded for, and the way it came."""

    by: str
    via: Via

    @classmethod
    def here(cls, via: Via = Via.CLI) -> Operator:
        """The user this process runs for (``getpass.getuser``: ``$LOGNAME``, ``$USER``,
        else the password database), acting through ``via``."""
        return cls(getpass.getuser(), via)

    @classmethod
    def of(cls, record: Mapping[str, Any] | None) -> Operator | None:
        """The operator a stored record or event names, or None (an automatic action, a
        record of an earlier release, or fields of another shape)."""
        if record is None:
            return None
        by, via = record.get("by"), record.get("via")
        if not isinstance(by, str) or not by or via not in tuple(Via):
            return None
        return cls(by, Via(via))

    def fields(self) -> Who:
        """``{"by": ..., "via": ...}``: what a record or an event carries."""
        return {"by": self.by, "via": str(self.via)}

    def __str__(self) -> str:
        return f"by {self.by} via {self.via}"


def fields_of(operator: Operator | None) -> Who:
    """``operator.fields()``, or nothing for an automatic action."""
    return operator.fields() if operator is not None else {}
