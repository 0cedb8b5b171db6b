"""The console's JSON API (docs/design.md section 12): each request one function, on the
same code as the CLI command of the same name.

| request                                   | function    | CLI                       |
|-------------------------------------------|-------------|---------------------------|
| ``GET /api/tasks``                        | ``tasks``   | ``status --json``         |
| ``GET /api/tasks/ID``                     | ``task``    | ``status``, ``history``, ``logs`` |
| ``GET /api/tasks/ID/messages[?turn=N]``   | ``messages``| ``show --json``           |
| ``GET /api/held``                         | ``held``    | ``dangling --json``       |
| ``POST /api/tasks/ID/decisions``          | ``decide``  | ``approve-dangling``      |
| ``POST /api/tasks/ID/cancel``             | ``cancel``  | ``cancel``                |
| ``POST /api/tasks/ID/retry``              | ``retry``   | ``retry``                 |
| ``POST /api/tasks/ID/rewind``             | ``rewind``  | ``rewind``                |
| ``POST /api/tasks/ID/fork``               | ``fork``    | ``fork``                  |

``ROUTES`` is the table the console dispatches on: a new request is one more ``Route``.
A function runs on one of the console's threads (never its event loop: the CLI's code
reads and waits), gets a ``Call`` (the spool, the config, who acts and the request's
parts) and returns the JSON to answer with; what it raises is answered as its exit code
says (``refusal``): 404 for no such task or call, 409 for a state that does not allow it,
400 for bad input (with ``calls`` for a rewind that needs ``yes``), 503 with
``Retry-After`` while the store is at fault, each with the CLI's one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from supervisor import actions, history, overview, transcript
from supervisor.budgets import KEEP, Unchanged, change_budget, parse_tokens, parse_usd
from supervisor.control import Fenced
from supervisor.operator import Operator
from supervisor.stores import store_for
from supervisor.submit import checked_text, existing_task
from worker.config import Config
from worker.errors import (
    AgentdError,
    IrreversibleError,
    NotFoundError,
    StateConflictError,
    UsageError,
    storage_fault,
)
from worker.spool import Spool

JSON = dict[str, Any]
#: Seconds a client is told to wait (``Retry-After``) while the store is at fault.
RETRY_AFTER = 5


@dataclass(frozen=True)
class Call:
    """One request, as an API function sees it."""

    spool: Spool
    config: Config
    operator: Operator
    task: str  # the ID of the path, "" for none
    body: Mapping[str, Any]
    query: Mapping[str, str]


@dataclass(frozen=True)
class Route:
    method: str
    pattern: str  # a path, ``{task}`` for a task's id
    run: Callable[[Call], JSON | list[Any]]
    status: int = HTTPStatus.OK
    redacted: bool = False  # its answer passed the redactor already (``show``'s lines)

    def match(self, method: str, path: str) -> str | None:
        """The task id the path names ("" for none) when this route takes it, else None."""
        if method != self.method and not (method == "HEAD" and self.method == "GET"):
            return None
        found = _compiled(self.pattern).fullmatch(path)
        return None if found is None else found.groupdict().get("task", "")


def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\{task\}", r"(?P<task>[^/]+)"))


# -- reads --------------------------------------------------------------------------------


def tasks(call: Call) -> list[Any]:
    return list(overview.status_document(call.spool, prices=call.config.price_table)["tasks"])


def task(call: Call) -> JSON:
    found = existing_task(call.spool, call.task)
    events, _ = store_for(call.spool).read_events(found.id)
    return {"task": _row(call, found.id), "history": history.history_rows(found), "events": events}


def messages(call: Call) -> list[Any]:
    turn = call.query.get("turn")
    if turn is not None and not (turn.isascii() and turn.lstrip("-").isdigit()):
        raise UsageError(f"turn={turn[:20]!r} is no turn: give a number (0: the prompt)")
    shown = None if turn is None else int(turn)
    return transcript.task_lines(call.spool, call.task, turn=shown, prices=call.config.price_table)


def held(call: Call) -> JSON:
    return overview.held_document(call.spool)


# -- actions ------------------------------------------------------------------------------


def _row(call: Call, task_id: str) -> JSON:
    """The task's row as ``GET /api/tasks`` lists it, after an action."""
    return dict(overview.status_document(call.spool, task_id, call.config.price_table)["tasks"][0])


def decide(call: Call) -> JSON:
    """``approve-dangling``: ``attempt``, when given, is the attempt of the call the
    decision answers (refused, 409, once the call was held again); left out, the decision
    answers the attempt held now (docs/guides/tools.md)."""
    call_id = _text(call.body, "call_id", required=True) or ""
    action = _text(call.body, "action", required=True) or ""
    attempt = call.body.get("attempt")
    if attempt is not None:
        attempt = _int(call.body, "attempt", "the attempt of the held call it answers")
    decided = actions.approve(
        call.spool,
        call.task,
        call_id,
        action=action,
        reason=_text(call.body, "reason"),
        result=_text(call.body, "result"),
        operator=call.operator,
        attempt=attempt,
    )
    done = [{"call_id": c, "attempt": n, "action": action} for c, n in decided]
    return {"task": _row(call, call.task), "decided": done}


def cancel(call: Call) -> JSON:
    done = actions.cancel(
        call.spool, call.task, call.config.restart.stop_grace + 5, operator=call.operator
    )
    if isinstance(done, Fenced):  # taken from a frozen node: what may still complete
        return {"task": _row(call, call.task), "fenced": done.to_json()}
    return {"task": _row(call, call.task)}


def retry(call: Call) -> JSON:
    actions.retry(call.spool, call.task, operator=call.operator)
    return {"task": _row(call, call.task)}


def budget(call: Call) -> JSON:
    """``agentd budget``: ``usd`` and ``tokens`` each a limit to set, ``null`` (or
    ``"none"``) to remove it, or left out to keep it (docs/design.md section 13)."""
    change_budget(
        call.spool,
        call.config,
        call.task,
        usd=_limit(call.body, "usd", parse_usd),
        tokens=_limit(call.body, "tokens", parse_tokens),
        operator=call.operator,
    )
    return {"task": _row(call, call.task)}


def rewind(call: Call) -> JSON:
    report = history.rewind(
        call.spool,
        call.config,
        call.task,
        _int(call.body, "to"),
        restore_workspace=_flag(call.body, "restore_workspace"),
        yes=_flag(call.body, "yes"),
        operator=call.operator,
    )
    done = {
        "from_turn": report.from_turn,
        "to": report.to,
        "not_undone": report.irreversible,
        "cut_off": report.cut_off,
        "workspace": report.workspace,
    }
    return {"task": _row(call, call.task), "rewind": done}


def fork(call: Call) -> JSON:
    report = history.fork(
        call.spool,
        call.config,
        call.task,
        _int(call.body, "at"),
        name=_text(call.body, "name") or None,
        prompt=_text(call.body, "prompt") or None,
        operator=call.operator,
    )
    return {"task": _row(call, report.task), "fork": {"workspace": report.workspace}}


#: What the console answers, in the order it looks.
ROUTES: tuple[Route, ...] = (
    Route("GET", "/api/tasks", tasks),
    Route("GET", "/api/held", held),
    Route("GET", "/api/tasks/{task}", task),
    Route("GET", "/api/tasks/{task}/messages", messages, redacted=True),
    Route("POST", "/api/tasks/{task}/decisions", decide),
    Route("POST", "/api/tasks/{task}/cancel", cancel),
    Route("POST", "/api/tasks/{task}/retry", retry),
    Route("POST", "/api/tasks/{task}/rewind", rewind),
    Route("POST", "/api/tasks/{task}/budget", budget),
    Route("POST", "/api/tasks/{task}/fork", fork, HTTPStatus.CREATED),
)


# -- the body's fields ----------------------------------------------------------------------


def _text(body: Mapping[str, Any], name: str, *, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise UsageError(f'the request body has no "{name}"; give it as a string')
        return None
    if not isinstance(value, str):
        raise UsageError(f'"{name}" must be a string, not {type(value).__name__}')
    return checked_text(value, f'"{name}"')


def _int(body: Mapping[str, Any], name: str, what: str = "a turn number") -> int:
    value = body.get(name)
    if isinstance(value, str) and value.isascii() and value.lstrip("-").isdigit():
        value = int(value)  # (a form's field)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f'the request body needs "{name}", {what}')
    return value


T = TypeVar("T")


def _limit(body: Mapping[str, Any], name: str, parse: Callable[[str, str], T]) -> T | Unchanged:
    """A budget's limit from the body: as ``agentd budget`` reads ``--usd``/``--tokens``
    (a number, or ``none``), ``null`` for none, left out for no change."""
    if name not in body:
        return KEEP
    value = body[name]
    if value is None:
        return parse("none", f'"{name}"')
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise UsageError(f'"{name}" must be a number, or null for none')
    return parse(str(value), f'"{name}"')


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if isinstance(value, str):  # (a form's field: a checkbox says "on")
        return value.lower() in ("1", "true", "on", "yes")
    if not isinstance(value, bool):
        raise UsageError(f'"{name}" must be true or false')
    return value


def parse_body(data: bytes, content_type: str | None) -> dict[str, Any]:
    """A POST's body: a JSON object, or a form's fields (``csrf`` among them)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if not data.strip():
        return {}
    if kind == "application/x-www-form-urlencoded" and not data.lstrip().startswith(b"{"):
        # (a JSON object sent as a form, as `curl -d` does, is read as the JSON it is)
        from urllib.parse import parse_qsl  # noqa: PLC0415  (forms are rare: the page sends JSON)

        try:
            pairs = parse_qsl(data.decode(), keep_blank_values=True, strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            raise UsageError("the form's body is not URL-encoded UTF-8") from None
        return dict(reversed(pairs))
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise UsageError("the request body is not JSON; send a JSON object") from None
    if not isinstance(body, dict):
        raise UsageError("the request body is not a JSON object")
    return body


# -- refusals -------------------------------------------------------------------------------


def refusal(exc: BaseException) -> tuple[int, JSON, dict[str, str]] | None:
    """The status, body and headers that answer ``exc`` (raised by an API function), or
    None when it is no refusal the CLI knows (a bug: 500, and the log says)."""
    fault = storage_fault(exc)
    if fault is not None:  # a wait, never a verdict (invariant 8): try again
        return (
            HTTPStatus.SERVICE_UNAVAILABLE,
            {"error": str(fault)},
            {"Retry-After": str(RETRY_AFTER)},
        )
    if isinstance(exc, IrreversibleError):
        return HTTPStatus.BAD_REQUEST, {"error": str(exc), "calls": exc.calls}, {}
    if isinstance(exc, UsageError):
        return HTTPStatus.BAD_REQUEST, {"error": str(exc)}, {}
    if isinstance(exc, NotFoundError):
        return HTTPStatus.NOT_FOUND, {"error": str(exc)}, {}
    if isinstance(exc, StateConflictError):
        return HTTPStatus.CONFLICT, {"error": str(exc)}, {}
    if isinstance(exc, AgentdError):
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)}, {}
    return None
