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
| ``POST /api/tasks``                       | ``submit_task`` | ``submit``            |
| ``POST /api/tasks/ID/continue``           | ``continue_task`` | ``continue``        |
| ``POST /api/tasks/ID/messages``           | ``say``     | ``say``                   |

``ROUTES`` is the table the console dispatches on: a new request is one more ``Route``.
A function runs on one of the console's threads (never its event loop: the CLI's code
reads and waits), gets a ``Call`` (the spool, the config, who acts and the request's
parts) and returns the JSON to answer with; what it raises is answered as its exit code
says (``refusal``): 404 for no such task or call, 409 for a state that does not allow it,
400 for bad input (with ``calls`` for a rewind that needs ``yes``), 503 with
``Retry-After`` while the store is at fault, each with the CLI's one line without the
spool's path (``unplaced``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar

from supervisor import actions, history, overview, transcript
from supervisor.budgets import KEEP, Unchanged, change_budget, parse_tokens, parse_usd
from supervisor.control import Fenced
from supervisor.operator import Operator
from supervisor.record import TaskRecord
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


def tasks(call: Call) -> list[Any] | JSON:
    """``status --json``'s tasks; with ``state``, ``q``, ``sort``, ``limit`` or ``after``
    (docs/design.md section 20), ``{"tasks": [the rows that match], "next": CURSOR}``."""
    rows = list(overview.status_document(call.spool, prices=call.config.price_table)["tasks"])
    asked = {k: call.query.get(k) for k in ("state", "q", "sort", "limit", "after")}
    if all(value is None for value in asked.values()):
        return rows
    from supervisor.selection import Selection  # noqa: PLC0415  (a selection alone needs it)

    selection = Selection.parse(
        states=asked["state"],
        text=asked["q"],
        sort=asked["sort"],
        limit=asked["limit"],
        after=asked["after"],
    )
    page, following = selection.apply(rows)
    return {"tasks": page, "next": following}


def task(call: Call) -> JSON:
    found = existing_task(call.spool, call.task)
    events, _ = store_for(call.spool).read_events(found.id)
    return {
        "task": _row(call, found.id),
        "history": history.history_rows(found),
        "events": events,
        "actions": TaskRecord.load(found).moves(),  # what the page offers (the CLI's checks)
    }


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
    answers the attempt held now (docs/design.md section 17)."""
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


def submit_task(call: Call) -> JSON:
    """``agentd submit``: the same fields (``prompt``, ``name``, ``model``, ``script``,
    ``tools``, ``system``, ``max_turns``, ``workspace``, ``budget_usd``,
    ``budget_tokens``, ``ask``), the same defaults and the same checks and refusals. A
    ``script`` is the script itself (an object, or its JSON text), not a file's name."""
    from supervisor.budgets import parse_tokens, parse_usd  # noqa: PLC0415  (submit alone)
    from supervisor.coordination import ring  # noqa: PLC0415  (the same)
    from supervisor.submit import submit  # noqa: PLC0415  (the same)
    from worker.budget import Budget  # noqa: PLC0415  (the same)

    body = call.body
    if body.get("harness") is not None:
        raise UsageError('"harness": this agentd runs its own loop only; leave it out')
    prompt = _text(body, "prompt", required=True) or ""
    budget = call.config.budget  # each field given replaces its [budget] default
    if body.get("budget_usd") is not None:
        budget = Budget(parse_usd(_number(body, "budget_usd"), '"budget_usd"'), budget.tokens)
    if body.get("budget_tokens") is not None:
        tokens = parse_tokens(_number(body, "budget_tokens"), '"budget_tokens"')
        budget = Budget(budget.usd, tokens)
    max_turns = (
        _int(body, "max_turns", "the most turns it may take") if "max_turns" in body else 100
    )
    workspace = _text(body, "workspace")
    with _script_file(call, body.get("script")) as script:
        made = submit(
            call.spool,
            call.config,
            prompt=prompt,
            name=_text(body, "name") or None,
            model=_text(body, "model") or None,
            script=script,
            tools=_names(body, "tools"),
            system=_text(body, "system") or None,
            max_turns=max_turns,
            workspace=Path(workspace) if workspace else None,
            existing_workspace=True,  # (as the CLI: a typo never makes an empty folder)
            budget=budget,
            ask=_names(body, "ask") or (),
        )
    ring(call.spool, made.id)
    return {"task": _row(call, made.id)}


@contextlib.contextmanager
def _script_file(call: Call, script: Any) -> Iterator[Path | None]:
    """The request's ``script`` as the file ``submit`` reads (in the spool's own temp
    folder, removed after), or None."""
    if script is None:
        yield None
        return
    if isinstance(script, dict):
        data = json.dumps(script).encode()
    elif isinstance(script, str):
        data = script.encode()
    else:
        raise UsageError('"script" must be the script: an object with "responses"')
    import tempfile  # noqa: PLC0415  (a submit with a script alone)

    from worker.store.durable import private_dir  # noqa: PLC0415  (the same)

    folder = private_dir(call.spool.tmp_dir)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".script-", suffix=".json") as f:
        f.write(data)
        f.flush()
        yield Path(f.name)


def _number(body: Mapping[str, Any], name: str) -> str:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise UsageError(f'"{name}" must be a number, or "none" for no limit')
    return str(value)


def _names(body: Mapping[str, Any], name: str) -> list[str] | None:
    """A list of tool names and globs: a JSON array, or a comma-separated string."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f'"{name}" must be a list of tool names (or "a,b")')
    return [v.strip() for v in value]


def continue_task(call: Call) -> JSON:
    """``agentd continue``: ``prompt``, the done task's new instruction."""
    from supervisor.conversations import continue_task as go_on  # noqa: PLC0415

    prompt = _text(call.body, "prompt", required=True) or ""
    turn, _ = go_on(call.spool, call.config, call.task, prompt, operator=call.operator)
    return {"task": _row(call, call.task), "after_turn": turn}


def say(call: Call) -> JSON:
    """``agentd say``: ``text``, a message for the live task."""
    from supervisor.conversations import say as add  # noqa: PLC0415

    number = add(
        call.spool, call.task, _text(call.body, "text", required=True) or "", operator=call.operator
    )
    return {"task": _row(call, call.task), "message": number}


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
    Route("POST", "/api/tasks", submit_task, HTTPStatus.CREATED),
    Route("POST", "/api/tasks/{task}/continue", continue_task),
    Route("POST", "/api/tasks/{task}/messages", say),
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


def refusal(exc: BaseException, spool: Spool) -> tuple[int, JSON, dict[str, str]] | None:
    """The status, body and headers that answer ``exc`` (raised by an API function), or
    None when it is no refusal the CLI knows (a bug: 500, and the log says). The body's
    line is the CLI's, without ``spool``'s path (``unplaced``)."""
    fault = storage_fault(exc)
    if fault is not None:  # a wait, never a verdict (invariant 8): try again
        return (
            HTTPStatus.SERVICE_UNAVAILABLE,
            {"error": unplaced(str(fault), spool)},
            {"Retry-After": str(RETRY_AFTER)},
        )
    line = unplaced(str(exc), spool)
    if isinstance(exc, IrreversibleError):
        return HTTPStatus.BAD_REQUEST, {"error": line, "calls": exc.calls}, {}
    if isinstance(exc, UsageError):
        return HTTPStatus.BAD_REQUEST, {"error": line}, {}
    if isinstance(exc, NotFoundError):
        return HTTPStatus.NOT_FOUND, {"error": line}, {}
    if isinstance(exc, StateConflictError):
        return HTTPStatus.CONFLICT, {"error": line}, {}
    if isinstance(exc, AgentdError):
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": line}, {}
    return None


def unplaced(line: str, spool: Spool) -> str:
    """The CLI's ``line`` without the spool's absolute path, which tells a client of the
    console where the daemon keeps its files (and its user's home): a file of the spool is
    named by its path within it (``tasks/ID/journal``), "in SPOOL" is left out, and the
    spool itself is "the spool"."""
    for root in {str(spool.root), os.path.realpath(spool.root)}:
        line = line.replace(root + os.sep, "")
        line = re.sub(rf" (?:in|on|under) {re.escape(root)}(?=[;:,.)\s]|$)", "", line)
        line = line.replace(root, "the spool")
    return line
