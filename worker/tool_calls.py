"""The tool half of the agent loop: one tool call run, its intent and result recorded.

A tool call's ``intent`` is durable (fdatasync) before the tool runs, its ``result``
after; a call with an intent and no result is *dangling* and goes through
``worker.dangling`` instead of being run again blindly. Each call is timed
(``StepMetrics.tool_called``) and, with traces on, has its ``execute_tool`` span.

An MCP call whose outcome is unknown (its server died during it, or it ran past its
timeout: the tool raises ``OutcomeUnknown``) gets no result: it is a dangling call, and
goes through the same reconciliation as after a crash, on a fresh server.

What a tool's process sees of the worker is here too: its environment (a short
allowlist, never the API key: ``tool_environment``), the secret files the sandbox hides
(``tool_secret_files``) and the other tasks' workspaces it covers (``OtherWorkspaces``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from worker import credentials
from worker.approvals import ASK_NOTHING, AskPolicy
from worker.config import Config
from worker.errors import NotFoundError, StorageError, TaskSpecError, storage_fault
from worker.events import Event
from worker.metrics import StepMetrics
from worker.models.base import JSON
from worker.recorder import Recorder
from worker.records import CallOutcome, IntentRecord, RecordKind, ResultRecord
from worker.spans import RunSpans
from worker.state import Call
from worker.store.base import TaskStore
from worker.tools.beneath import Root
from worker.tools.registry import (
    OutcomeUnknown,
    ToolContext,
    ToolError,
    ToolRegistry,
    ToolResult,
)
from worker.tools.sandbox import Sandbox

#: Seconds between two tries of a call's result while the database refuses it.
RESULT_RETRY = 0.5
#: Unknown outcomes of one call in a row (its server died in it, or it ran past its
#: timeout) after which a call that is safe to re-run gets an error result instead.
UNKNOWN_OUTCOMES = 3

_TOOL_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TERM",
    "TZ",
    "USER",
    "LOGNAME",
    "TMPDIR",
)


def idempotency_key(task_id: str, epoch: int, call_id: str) -> str:
    """Stable for every resume of a call; new for a new task (fork) or after a rewind."""
    digest = hashlib.sha256(f"{task_id}\0{epoch}\0{call_id}".encode()).hexdigest()
    return f"agentd-{digest[:32]}"


def tool_environment(environ: Mapping[str, str], task_id: str, workspace: str) -> dict[str, str]:
    """What a tool's process sees: a short allowlist, never the API key."""
    env = {k: environ[k] for k in _TOOL_ENV if k in environ}
    env.update(AGENTD_TASK=task_id, AGENTD_WORKSPACE=workspace)
    return env


def tool_secret_files(environ: Mapping[str, str]) -> tuple[str, ...]:
    """What the sandbox hides of this worker's secrets: the files they were read from,
    and with a store everything libpq could log in with (``credentials.store_paths``)."""
    held = credentials.held()
    url = held.get(credentials.STORE)
    return held.files + (tuple(credentials.store_paths(environ, url)) if url else ())


class OtherWorkspaces:
    """The workspace of every other task of ``store`` that names one (``--workspace``, or
    a shared store's default): what the sandbox covers at each call where it would show
    it, inside this task's workspace (docs/design.md section 5; elsewhere it shows none).
    A spec never changes, so each is read once; after that a call costs a listing of the
    ids. A spec that cannot be read yet (a task being made) is tried again next call.

    The store is read by ``refresh``, which the loop calls before it records a call's
    intent: a storage fault there is a wait with nothing recorded, never the call's
    failure (a fault met as the command was being wrapped would have been recorded as
    its result, though it never ran). Asked for the list (by the sandbox, at each call),
    it answers from the last refresh."""

    def __init__(self, store: TaskStore, task_id: str) -> None:
        self._store = store
        self._task_id = task_id
        self._known: dict[str, Path | None] = {task_id: None}
        self._refreshed = False

    def refresh(self) -> None:
        new = [i for i in self._store.task_ids() if i not in self._known]
        if new:
            with self._store.read_all():
                for task_id in new:
                    with contextlib.suppress(NotFoundError, TaskSpecError):
                        folder = self._store.load_spec(task_id).workspace
                        self._known[task_id] = Path(folder) if folder else None
        self._refreshed = True

    def __call__(self) -> list[Path]:
        if not self._refreshed:  # (a command run outside a call: git's, at a boundary)
            self.refresh()
        return [path for path in self._known.values() if path is not None]


class ToolCalls:
    """Runs the task's tool calls (``tools``, once the loop decided them) in
    ``workspace``, recording each on ``recorder``.

    ``fence``, when given, raises ``FencedError`` once this worker may no longer act (a
    lease it could not renew in time: ``worker.lease``); it is asked right before every
    tool runs, the one step the store cannot fence itself. ``result_wait``, on a shared
    store, is what a call's result waits in when the database refuses its write
    (``keep_result``). ``asks`` names the tools whose calls wait for an operator's
    approval before they run (docs/design.md section 17)."""

    def __init__(
        self,
        recorder: Recorder,
        config: Config,
        tools: ToolRegistry,
        *,
        workspace: Path,
        env: dict[str, str],
        sandbox: Sandbox,
        others: OtherWorkspaces,
        metrics: StepMetrics,
        spans: RunSpans | None,
        sleep: Callable[[float], None],
        fence: Callable[[], None] | None,
        result_wait: Callable[[], AbstractContextManager[object]] | None,
        asks: AskPolicy = ASK_NOTHING,
    ) -> None:
        self.recorder = recorder
        self.asks = asks
        self.task_id = recorder.task_id
        self.config = config
        self.tools = tools
        self.workspace = workspace
        self.env = env
        self.sandbox = sandbox
        self.others = others
        self.metrics = metrics
        self.spans = spans
        self.sleep = sleep
        self.fence = fence
        self.result_wait = result_wait
        self._unknown: dict[str, int] = {}  # unknown outcomes in a row, by call

    @functools.cached_property
    def workspace_root(self) -> Root:
        """The workspace, opened once (``O_DIRECTORY | O_NOFOLLOW``) at the first tool call:
        every path of the file tools is resolved beneath this fd."""
        return Root(self.workspace)

    def key_of(self, call: Call) -> str:
        """The call's idempotency key: recorded with its intent, else derived."""
        return call.key or idempotency_key(self.task_id, self.recorder.state.epoch, call.call_id)

    def context(self, call: Call, key: str) -> ToolContext:
        return ToolContext(
            workspace=self.workspace,
            task_id=self.task_id,
            call_id=call.call_id,
            idempotency_key=key,
            timeout=self.config.deadlines.tool_call,
            env=self.env,
            sandbox=self.sandbox,
            root=self.workspace_root,
        )

    def error_result(
        self, call: Call, message: str, outcome: CallOutcome = CallOutcome.ERROR
    ) -> None:
        self.recorder.record(
            {
                "k": RecordKind.RESULT,
                "call_id": call.call_id,
                "content": message,
                "is_error": True,
                "outcome": outcome,
            }
        )

    def run(
        self,
        call: Call,
        *,
        attempt: int,
        outcome: CallOutcome = CallOutcome.RAN,
        ask: bool = False,
    ) -> None:
        """Run ``call``: its intent recorded (durable) first, its result after. With
        ``ask`` (the model's call, before any decision), a call of a tool that ``asks``
        names is not run: its intent is recorded with ``"asked": true``, and the loop
        finds it dangling and holds it for an operator (``worker.dangling``)."""
        recorder = self.recorder
        begun = time.time_ns()
        tool = self.tools.get(call.tool)
        if tool is None:
            message = f"unknown tool {call.tool!r}; available: {self.tools.names()}"
            self.error_result(call, message)
            self.span(call, begun, None, CallOutcome.ERROR, "unknown_tool", message, attempt)
            return
        try:
            data = tool.check_input(call.input)
        except ToolError as exc:
            self.error_result(call, str(exc))
            self.span(
                call, begun, tool.effect.value, CallOutcome.ERROR, "invalid_input", exc, attempt
            )
            return
        key = self.key_of(call)
        intent: IntentRecord = {
            "k": RecordKind.INTENT,
            "call_id": call.call_id,
            "tool": tool.name,
            "effect": tool.effect.value,
            "key": key,
            "attempt": attempt,
        }
        if ask and self.asks.asks(tool):
            recorder.record({**intent, "asked": True})
            return
        if self.sandbox.verdict() == "bwrap":  # what it hides, read before anything is recorded
            self.others.refresh()
        recorder.record(intent)
        if self.fence is not None:
            self.fence()  # (FencedError: the worker stops, the intent dangling for the next owner)
        recorder.phase(f"tool:{tool.name}")
        started = time.perf_counter()
        content: str | list[JSON]
        error_type: str | None = None
        try:
            output = tool.result(self.context(call, key), data)
            if isinstance(output, ToolResult):
                content, is_error = output.content, output.is_error
            else:
                content, is_error = output, False
        except OutcomeUnknown as exc:
            self.metrics.tool_called(tool.name, time.perf_counter() - started)
            recorder.phase("idle")
            self._outcome_unknown(call, str(exc))
            return
        except ToolError as exc:
            content, is_error, error_type = str(exc), True, "tool_error"
        except Exception as exc:
            content, is_error = f"{tool.name} failed: {type(exc).__name__}: {exc}", True
            error_type = type(exc).__name__
        self._unknown.pop(call.call_id, None)
        self.metrics.tool_called(tool.name, time.perf_counter() - started)
        recorder.phase("idle")
        self.keep_result(
            {
                "k": RecordKind.RESULT,
                "call_id": call.call_id,
                "content": content,
                "is_error": is_error,
                "outcome": outcome,
            }
        )
        self.span(call, begun, tool.effect.value, outcome, error_type, content, attempt)

    def span(
        self,
        call: Call,
        begun: int,
        effect: str | None,
        outcome: CallOutcome,
        error_type: str | None,
        result: Any,
        attempt: int,
    ) -> None:
        """The call's ``execute_tool`` span, once its result is recorded (traces on)."""
        if self.spans is not None:
            self.spans.tool(
                call.tool,
                call.call_id,
                start=begun,
                effect=effect,
                outcome=outcome,
                error_type=error_type,
                arguments=call.input,
                result=result,
                attempt=attempt,
            )

    def _outcome_unknown(self, call: Call, why: str) -> None:
        """A call that may or may not have taken effect (an MCP server died during it, or
        it ran past its timeout and its server was killed): no result is recorded, so the
        loop finds it dangling and settles it as after a crash (re-run on a fresh server
        when safe, held when unsafe). One that stays unknown ``UNKNOWN_OUTCOMES`` times in
        a row gets an error result instead of another re-run."""
        count = self._unknown.get(call.call_id, 0) + 1
        self._unknown[call.call_id] = count
        self.recorder.event(
            Event.MCP_SERVER_FAILED, level="warning", call_id=call.call_id, error=why
        )
        if count >= UNKNOWN_OUTCOMES:
            self._unknown.pop(call.call_id, None)
            self.error_result(
                call,
                f"{why}; its outcome was unknown {count} times in a row, so it was not tried "
                "again: it may or may not have taken effect",
            )

    def keep_result(self, result: ResultRecord) -> None:
        """Record the result of a call that ran. Deferred: the next intent's sync, or the
        background sync during the next model call, or the end record makes it durable; a
        kill loses nothing written.

        On a shared store (``result_wait``) a storage fault does not lose it: the call ran
        once and its result is in hand, so the worker waits for the database (invariant 8)
        rather than leave the call dangling, to be held for an operator. Each try first
        reads back what the journal holds after the last record (the write whose reply
        was lost may have committed), then writes it if it is not there. Only the fence
        bounds the wait: a lease taken over meanwhile refuses both (``FencedError``), the
        worker stops with nothing written, and the new owner finds the call dangling (held
        when unsafe: invariant 2). No tool runs in the wait (one runs only after ``fence``)."""
        recorder = self.recorder
        try:
            recorder.record(result, sync=False)
            return
        except (StorageError, OSError) as exc:
            if self.result_wait is None or storage_fault(exc) is None:
                raise
            fault = storage_fault(exc)
        recorder.event(
            Event.RESULT_WAITING, level="warning", call_id=result["call_id"], error=str(fault)
        )
        with self.result_wait():
            while True:
                self.sleep(RESULT_RETRY)
                try:
                    if not self._written_meanwhile(result):
                        recorder.record(result, sync=False)
                    break
                except (StorageError, OSError) as exc:
                    if storage_fault(exc) is None:
                        raise
        recorder.event(Event.RESULT_WRITTEN, call_id=result["call_id"])

    def _written_meanwhile(self, result: ResultRecord) -> bool:
        """Whether ``result`` is among what the journal holds after its last record known
        here (``Recorder.reopen``)."""
        records = self.recorder.reopen()
        return any(
            r.get("k") == RecordKind.RESULT and r.get("call_id") == result["call_id"]
            for r in records
        )

    def close(self) -> None:
        if "workspace_root" in self.__dict__:
            self.workspace_root.close()
