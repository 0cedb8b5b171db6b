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

``by`` is what the system authenticated, never what a process says of itself
(``user_name``): the name the password database gives the process's real uid, not
``$USER`` or ``$LOGNAME``, which anyone sets. A console login carries the uid of the
``agentd console`` that made it (the owner of its ticket's file), an API token the name of
the uid that minted it. A name that is not a plain user name (``PLAIN_NAME``: a name with
a newline, a space or a control character could forge a line of ``agentd logs``), or a uid
the database does not know, is recorded as the uid's number.
"""

from __future__ import annotations

import json
import os
import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from worker.records import Who

#: A plain user name (at most ``MAX_NAME`` characters): else ``by`` is the uid's number.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_NAME = 32


def user_name(uid: int) -> str:
    """``by`` for the user ``uid``: its name in the password database when that is a plain
    user name, else the uid's number (a name the database does not have, or an odd one)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
    return name if plain(name) else str(uid)


def plain(name: str) -> bool:
    """Whether ``name`` is a plain user name (what ``by`` is shown as it is)."""
    return len(name) <= MAX_NAME and PLAIN_NAME.fullmatch(name) is not None


def shown_by(by: str) -> str:
    """``by`` as a line of text shows it: a plain name as it is, anything else (a record
    of an earlier release that took ``$LOGNAME``, a hand-made one) quoted as JSON, so that
    no newline or control character of it reaches a terminal."""
    return by if plain(by) else json.dumps(by)


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
        """The user this process runs for (its real uid, ``user_name``: never an
        environment variable), acting through ``via``."""
        return cls(user_name(os.getuid()), via)

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
        return f"by {shown_by(self.by)} via {self.via}"


def fields_of(operator: Operator | None) -> Who:
    """``operator.fields()``, or nothing for an automatic action."""
    return operator.fields() if operator is not None else {}
