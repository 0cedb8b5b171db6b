"""The agent loop: call the model, record the turn, run each tool call, record each
result, send the results back, until the task ends.

The loop never keeps state of its own: every step is chosen by ``_next_step`` from the
folded ``TaskState``, so a fresh start and a resume after ``kill -9`` are the same code
path. The only ordering rules that matter for safety are here:

* a tool call's ``intent`` is durable (fdatasync) before the tool runs, its ``result``
  after; a call with an intent and no result is *dangling* and goes through
  ``worker.reconcile`` instead of being run again blindly;
* a model reply is recorded as one ``turn`` record once it has fully arrived, so a
  retried or interrupted call records nothing and counts no usage.

Three timing points feed the worker's metrics (``worker.metrics``, published with the
heartbeat): each journal write in ``_record``, each model call and each tool call, a
``perf_counter`` pair apiece.

A transcript that outgrows ``[context] window`` is compacted at a turn boundary
(``_compact``, the pure half in ``worker.compaction``): one summary call, then a
``compaction`` record, synced before the next model call reads the transcript it makes.
A crash before the record only means the summary call is made again. With ``[context]
strategy = "server"`` on a backend that offers it, the API compacts instead, in the
request itself: its compaction block comes back as a turn (``stop_reason``
``compaction``), recorded like any other, and the loop goes on from it.

A task's tools are decided once, at its first start (``_offer_tools``): the built-in and
module tools and the MCP tools its ``--tools`` (or ``[tools] default``) names, each MCP
server it may reach started and listed, the list recorded (a ``tools`` record) before the
first model call. Every later start, rewind and fork offers that list. An MCP call whose
outcome is unknown (its server died during it, or it ran past its timeout: the tool raises
``OutcomeUnknown``) gets no result: it is a dangling call, and goes through the same
reconciliation as after a crash, on a fresh server.

Stopping on SIGTERM is only immediate while the worker waits on the model (nothing is
recorded then); during a tool call it takes effect once the result is recorded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from worker import compaction, credentials, vcs
from worker.budget import Budget, current_budget, price_of, spend_json
from worker.config import Config
from worker.errors import (
    ConfigError,
    ContextTooLongError,
    FencedError,
    InvalidIdError,
    JournalCorruptError,
    ModelError,
    NotFoundError,
    StorageError,
    TaskSpecError,
    storage_fault,
)
from worker.events import event_line, utc_now
from worker.heartbeat import Heartbeat
from worker.mcp import catalog
from worker.mcp import tools as mcp_tools
from worker.mcp.servers import Backoff, Placement, ServerFailed, ToolServers
from worker.metrics import StepMetrics
from worker.models.base import (
    JSON,
    Model,
    ModelReply,
    ModelRequest,
    SummaryOf,
    offers_server_compaction,
)
from worker.models.retry import call_with_retries
from worker.protocol import ExitCode, decision_fields, exit_record
from worker.reconcile import Action, plan
from worker.redactor import redact
from worker.spans import ChatSpan, RunSpans
from worker.spool import Spool, TaskSpec
from worker.state import Call, TaskState
from worker.store import replay
from worker.store.base import START, Cursor, JournalWriter, Owner, Snapshot, TaskStore, Unreadable
from worker.store.snapshots import SnapshotWriter
from worker.tools.beneath import Root
from worker.tools.registry import (
    OutcomeUnknown,
    ToolContext,
    ToolError,
    ToolRegistry,
    ToolResult,
)
from worker.tools.sandbox import mode_for, sandbox_for

SNAPSHOT_EVERY = 100  # turns between snapshots, at least
# ...and journal bytes between snapshots, at least the last snapshot's size over this: a
# snapshot costs time in proportion to the transcript, so for long tasks they come further
# apart, and the bytes written for snapshots stay within 3x the journal's own.
SNAPSHOT_GROWTH = 3
#: Seconds between two tries of a call's result while the database refuses it.
RESULT_RETRY = 0.5
#: Unknown outcomes of one call in a row (its server died in it, or it ran past its
#: timeout) after which a call that is safe to re-run gets an error result instead.
UNKNOWN_OUTCOMES = 3

CONTINUE_PROMPT = "Your reply was cut off by the max_tokens limit. Please continue."
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


@dataclass(frozen=True)
class Outcome:
    state: str  # done, failed, held, stopped
    reason: str
    exit_code: ExitCode
    fenced: bool = False  # the task has a new owner: it, not this worker, speaks for it


def storage_outcome(exc: BaseException) -> Outcome:
    """How a worker ends on ``exc``, a write's error: a storage fault is a wait (exit 7,
    nothing recorded was changed); any other error is re-raised, except a StorageError of
    ours, which is a crash with a one-line reason (a restart re-reads what is on disk). A
    step refused by the fence (``FencedError``: ownership moved) stops the worker at once,
    with nothing recorded and no tool run: ``lease_lost``, never a crash."""
    if isinstance(exc, FencedError):
        return Outcome("stopped", f"lease_lost: {exc}", ExitCode.STOPPED, fenced=True)
    fault = storage_fault(exc)
    if fault is not None:
        return Outcome("stopped", str(fault), ExitCode.STORAGE)
    if isinstance(exc, StorageError):
        return Outcome("stopped", str(exc), ExitCode.ERROR)
    raise exc


class StopRequested(BaseException):
    """Raised out of a model call when SIGTERM asks the worker to stop."""


class BudgetReached(Exception):
    """Raised before a model call when the task's spend is at or past its budget: the
    task is held (``reason``), nothing recorded for the call it would have made."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
    a shared store's default): what the sandbox hides at each call (docs/design.md section 5).
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


def without_secrets(record: JSON) -> JSON:
    """``record`` as it may be recorded and sent to the model: a result's content (a tool's
    output, a reconcile answer, an operator's; its text, or the text of each of its text
    blocks) with every secret the worker knows of replaced, so a tool that found the key
    cannot hand it on (docs/design.md section 5)."""
    content = record.get("content")
    if record.get("k") != "result":
        return record
    if isinstance(content, str):
        return {**record, "content": redact.clean_secrets(content)}
    if isinstance(content, list):
        blocks = [
            {**b, "text": redact.clean_secrets(b["text"])}
            if isinstance(b, dict) and isinstance(b.get("text"), str)
            else b
            for b in content
        ]
        return {**record, "content": blocks}
    return record


class AgentLoop:
    """One task's loop on a ``TaskStore``: it never knows which backend it has.

    ``owner`` is the loop's ownership of the task (the worker takes it before it reads
    anything); without one, ``open`` takes it and ``close`` gives it back. ``fence``,
    when given, raises ``FencedError`` once this worker may no longer act (a lease it
    could not renew in time: ``worker.lease``); it is asked right before every tool runs,
    the one step the store cannot fence itself. ``result_wait``, on a shared store, is
    what a call's result waits in when the database refuses its write (``_keep_result``):
    a block within which the worker is not ended for beats or renewals that fail.
    ``workspace`` is where the tools work; ``spool`` the folder the sandbox hides from
    them, if any."""

    def __init__(
        self,
        store: TaskStore,
        spec: TaskSpec,
        config: Config,
        model: Model,
        tools: ToolRegistry,
        heartbeat: Heartbeat | None = None,
        *,
        workspace: Path,
        spool: Path | None = None,
        owner: Owner | None = None,
        snapshot_every: int = SNAPSHOT_EVERY,
        sleep: Callable[[float], None] = time.sleep,
        metrics: StepMetrics | None = None,
        fence: Callable[[], None] | None = None,
        result_wait: Callable[[], AbstractContextManager[object]] | None = None,
        retries: int = 0,
        spans: RunSpans | None = None,
    ) -> None:
        self.store = store
        self.spans = spans  # the run's trace spans (``worker.spans``); None: traces are off
        self.result_wait = result_wait
        self.retries = retries  # the operator's, by the task's record (``RETRIES_ENV``)
        self.fence = fence
        self.task_id = spec.id
        self.owner = owner
        self._own_owner = owner is None
        self.spec = spec
        self.config = config
        self.model = model
        self.local_tools = tools  # the built-in and module tools this worker has
        self.tools = tools  # the task's own, once _offer_tools decided them
        self.heartbeat = heartbeat
        self.snapshot_every = snapshot_every
        self.sleep = sleep
        self.metrics = metrics if metrics is not None else StepMetrics()
        self.workspace = workspace
        self.tool_env = tool_environment(os.environ, self.task_id, str(self.workspace))
        self._others = OtherWorkspaces(store, self.task_id)
        self.sandbox = sandbox_for(
            mode_for(
                config.tools.sandbox, store=credentials.held().get(credentials.STORE) is not None
            ),
            config.tools.network,
            spool=spool,
            config=config.source,
            secret_files=tool_secret_files(os.environ),
            on_verdict=(lambda verdict: heartbeat.update(sandbox=verdict)) if heartbeat else None,
            others=self._others,
        )
        #: the MCP servers this worker may start ([mcp.servers]), none until a call needs one
        self.servers = (
            ToolServers(
                config.mcp.servers,
                Placement(self.workspace, self.tool_env, self.sandbox, config.restart.stop_grace),
                backoff=Backoff(config.restart.backoff_initial, config.restart.backoff_max),
                on_event=lambda event, level, fields: self._event(event, level, **fields),
            )
            if config.mcp.servers
            else None
        )
        self._unknown: dict[str, int] = {}  # unknown outcomes in a row, by call
        self.stop_requested = False
        self._interruptible = False
        self.journal: JournalWriter | None = None
        self.state = TaskState(spec.prompt)
        self._snapshot_turn = 0
        self._snapshot_at: Cursor = START  # where the last snapshot was taken
        self._snapshot_size = 0  # and the bytes it took
        self._snapshots = SnapshotWriter(store)  # writes them while the model thinks
        #: the workspace's git, as decided at submit (None: its files are not recorded)
        self._git = (
            vcs.git_of(spec.git, Spool(spool).task(spec.id).git, self.sandbox) if spool else None
        )
        #: [context] strategy "server" on a backend that offers it: the API compacts
        self._server_compacts = config.context.strategy == "server" and (
            offers_server_compaction(model)
        )
        #: the price table (``worker.budget``) and the task's budget as last read, with
        #: the number of changes that made it (``current_budget``)
        self.prices = config.price_table
        self._budget: tuple[Budget, int] | None = None
        self._budget_refused = 0  # the change that could not be read, said once

    # -- opening ----------------------------------------------------------------------

    def open(self) -> TaskState:
        """Load the snapshot (if usable) and replay the journal after it
        (``worker.store.replay``: the daemon's replay too)."""
        if self.owner is None:
            self.owner = self.store.acquire(self.task_id)
        journal, state, snapshot = replay.resume(
            self.store,
            self.owner,
            self.spec.prompt,
            header={"task": self.task_id},
            on_ignored=self._snapshot_ignored,
        )
        self.journal, self.state = journal, state
        if self.heartbeat:  # ``PROGRESS``: a journal found shorter is damage, not a new task
            self.heartbeat.follow(journal=lambda: journal.durable.position)
        self._snapshot_turn = state.turn
        if snapshot is not None:
            self._snapshot_at, self._snapshot_size = snapshot.cursor, snapshot.size
        return state

    def _snapshot_ignored(self, exc: Exception) -> None:
        self._event("snapshot_ignored", level="warning", error=str(exc)[:200])

    # -- recording ----------------------------------------------------------------------

    @property
    def _journal(self) -> JournalWriter:
        if self.journal is None:
            raise RuntimeError("AgentLoop.open() must be called before recording")
        return self.journal

    def _record(self, *records: JSON, sync: bool = True, hold: bool = False) -> None:
        """Append ``records`` (durable when this returns, unless ``sync`` is False) and
        fold them in; with ``hold``, they ride on the next record's write instead."""
        stamped = [{**without_secrets(r), "at": utc_now()} for r in records]
        if hold:
            self._journal.hold(stamped)
        else:
            started = time.perf_counter()
            self._journal.append(stamped, sync=sync)
            self.metrics.checkpointed(time.perf_counter() - started)
        for record in stamped:
            self.state.apply(record)
        if self.heartbeat:
            self.heartbeat.update(
                turn=self.state.turn,
                usage=self.state.usage_total.to_json(),
                spend=spend_json(self.state.spend_total),
                tokens_used=self.state.tokens_used,
                compactions=self.state.compaction_count,
            )

    def _checkpoint_workspace(self) -> None:
        """Record the workspace's git state at this turn boundary, once per boundary."""
        if self._git is None or self.state.turn in self.state.vcs:
            return
        try:
            point = self._git.capture(self.task_id, self.state.turn)
        except vcs.VcsError as exc:
            self._event("vcs_capture_failed", level="warning", error=str(exc))
            self._git = None
            return
        record = {"k": "vcs", "turn": self.state.turn, "commit": point.commit}
        # not synced on its own: the next record's fdatasync carries it, and a lost one
        # only means this boundary has no file snapshot
        self._record({**record, "snapshot": point.snapshot}, sync=False)

    def _maybe_snapshot(self) -> None:
        """Take a snapshot at this boundary when one is due; it is written on the
        snapshot thread (``worker.store.snapshots``) while the model thinks. A snapshot
        that failed is raised at the first boundary after it, due or not, as a synchronous
        write would have been (a full disk stops the worker now, not a hundred turns on)."""
        written = self._snapshots.collect()
        if written is not None:
            self._snapshot_size = written
        if (
            self.state.turn - self._snapshot_turn < self.snapshot_every
            or self.state.pending_calls()
        ):
            return
        written = self._snapshots.wait()  # the last one: long written, unless every turn
        if written is not None:
            self._snapshot_size = written
        if self._journal.volume_since(self._snapshot_at) < self._snapshot_size // SNAPSHOT_GROWTH:
            return
        self._journal.sync()  # a snapshot never covers records that are not durable
        at = self._journal.cursor
        self._snapshots.put(self._journal.owner, Snapshot(at, self.state.detached()))
        self._snapshot_turn, self._snapshot_at = self.state.turn, at

    def _event(self, event: str, level: str = "info", **fields: Any) -> None:
        line = event_line(
            event, level, task=self.task_id, pid=os.getpid(), turn=self.state.turn, **fields
        )
        try:  # events are advisory: a full disk, or a database away, loses them
            self.store.append_event(self.task_id, line)
        except OSError:
            pass
        except StorageError as exc:
            if storage_fault(exc) is None:
                raise

    def _phase(self, phase: str) -> None:
        if self.heartbeat:
            self.heartbeat.phase(phase)

    # -- running ------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Run the task until it ends, holds or stops; the run's span (traces on) closes
        with how it ended."""
        if self.spans is not None:
            self.spans.run_started(self.model_name)
        outcome = self._run()
        if self.spans is not None:
            error = outcome.exit_code not in (ExitCode.DONE, ExitCode.HELD, ExitCode.STOPPED)
            self.spans.run_ended(outcome.state, outcome.reason, error=error)
        return outcome

    def _run(self) -> Outcome:
        try:
            if self.journal is None:
                self.open()
            if self.state.records > 1:
                self._event("task_resumed")
            self._check_prices()
            self._reopen_if_retried()
            waiting = self._offer_tools()
            if waiting is not None:
                return waiting
            if self.config.context.strategy == "server" and not self._server_compacts:
                self._event(
                    "context_strategy_fallback",
                    level="warning",
                    error='[context] strategy "server": this model backend offers no server '
                    'compaction; compacting as "client"',
                )
            return self._loop()
        except StopRequested:
            return Outcome("stopped", "stopped at a safe point", ExitCode.STOPPED)
        except BudgetReached as exc:
            return self._hold_on_budget(exc.reason)
        except ConfigError as exc:
            return Outcome("failed", str(exc), ExitCode.CONFIG)
        except (StorageError, FencedError, OSError) as exc:
            return storage_outcome(exc)
        except JournalCorruptError as exc:
            return Outcome("failed", str(exc), ExitCode.FAILED)
        except (ModelError, TaskSpecError) as exc:
            return self._end("failed", str(exc))
        finally:
            self._phase("idle")

    def _loop(self) -> Outcome:
        while True:
            if self.state.ended:
                return self._outcome_of_end()
            if self.stop_requested:
                return Outcome("stopped", "stopped at a safe point", ExitCode.STOPPED)
            pending = self.state.pending_calls()
            if pending:
                call = pending[0]
                if call.dangling:
                    held = self._settle_dangling(call)
                    if held is not None:
                        return held
                else:
                    self._run_call(call, attempt=1)
                continue
            self._checkpoint_workspace()
            self._maybe_snapshot()
            ending = self._ending()
            if ending is not None:
                return self._end(*ending)
            if self.state.last_role == "assistant" and self.state.stop_reason == "max_tokens":
                self._record({"k": "user", "content": [{"type": "text", "text": CONTINUE_PROMPT}]})
                continue
            if self._compaction_due():
                self._compact("threshold")
            self._call_model()

    def _ending(self) -> tuple[str, str] | None:
        """Why the task ends now, or None to call the model again."""
        stop = self.state.stop_reason
        if stop in ("end_turn", "stop_sequence"):
            return "done", stop
        if stop == "refusal":
            return "failed", "refusal: the model declined to continue this task"
        if stop == "model_context_window_exceeded":  # recorded before compaction existed
            return "failed", "model_context_window_exceeded: the transcript no longer fits"
        # pause_turn and compaction (the API compacted and paused): the model goes on
        if stop not in (None, "tool_use", "max_tokens", "pause_turn", "compaction"):
            return "failed", f"unknown stop_reason {stop!r} from the model"
        if self.state.turn >= self.spec.max_turns:
            return "done", "max_turns"
        return None

    def _offer_tools(self) -> Outcome | None:
        """Decide the task's tools from its patterns (``--tools``, else ``[tools]
        default``). With MCP servers configured, the first start lists every server the
        patterns may reach and records the list (a ``tools`` record), which every later
        start offers; a server that cannot list its tools gives an Outcome instead (the
        task waits: exit ``TOOLS``, reason ``mcp: NAME: WHY``). Without servers nothing is
        recorded: the built-in and module tools the patterns name, as before tool lists
        existed (and a task begun before them keeps its local tools alone)."""
        recorded = self.state.tools
        patterns = self.spec.tools if self.spec.tools is not None else self.config.tools.default
        if recorded is None and (self.servers is None or self.state.turn > 0):
            chosen = catalog.offered(patterns, self.local_tools.names(), [])
            self.tools = mcp_tools.registry(chosen, self.local_tools, None)
            return None
        if recorded is None:
            try:
                chosen = mcp_tools.offer(patterns, self.local_tools, self.servers)
            except ServerFailed as exc:
                return Outcome("stopped", str(exc), ExitCode.TOOLS)
            self._record({"k": catalog.RECORD_KIND, **chosen}, sync=False)
            recorded = self.state.tools or {}
        self.tools = mcp_tools.registry(catalog.tool_list(recorded), self.local_tools, self.servers)
        return None

    def _reopen_if_retried(self) -> None:
        """A task whose journal ended ``failed`` (a model or spec error) and that an
        operator retried since goes on: a ``retry`` record, once per retry, reopens it.
        (A worker started again after it wrote its end, with no retry since, ends the
        same way again.)"""
        ended = self.state.ended
        if ended and ended.get("state") == "failed" and self.state.retries < self.retries:
            self._record({"k": "retry", "n": self.retries})

    def _end(self, state: str, reason: str) -> Outcome:
        if self.journal is not None and not self.state.ended:
            self._record({"k": "end", "state": state, "reason": reason})
        return self._outcome_of_end()

    def _outcome_of_end(self) -> Outcome:
        ended = self.state.ended or {}
        state = str(ended.get("state"))
        return Outcome(
            state, str(ended.get("reason")), ExitCode.DONE if state == "done" else ExitCode.FAILED
        )

    # -- the budget (docs/design.md section 13) -------------------------------------------

    @property
    def model_name(self) -> str:
        return self.spec.model or self.config.model.name

    def budget(self) -> Budget:
        """The task's budget now: its spec's, or the latest ``agentd budget`` change (read
        from where the last read ended: one look-up of the next change, per call). A change
        that cannot be read is said once (``decision_invalid``) and the last budget kept."""
        try:
            self._budget = current_budget(self.store, self.task_id, self.spec.budget, self._budget)
        except ValueError as exc:
            number = (self._budget or (self.spec.budget, 0))[1] + 1
            if self._budget_refused != number:
                self._budget_refused = number
                where = getattr(exc, "where", f"budget change {number}")
                self._event("decision_invalid", level="error", file=where, error=str(exc))
            if self._budget is None:
                self._budget = (self.spec.budget, 0)
        return self._budget[0]

    def _check_prices(self) -> None:
        """A USD budget needs the task's model to have a price (ConfigError: exit 78)."""
        if self.state.ended:
            return
        budget = self.budget()
        if budget.usd is not None and price_of(self.model_name, self.prices) is None:
            where = self.config.source or "the config"
            raise ConfigError(
                f"task {self.task_id} has a USD budget, but its model {self.model_name!r} has "
                f'no price; add [prices."{self.model_name}"] (input, output, cache_write, '
                f"cache_write_1h, cache_read in USD per million tokens) to {where}, or "
                f"remove the budget with `agentd budget {self.task_id} --usd none`."
            )

    def _check_budget(self) -> None:
        """``BudgetReached`` when the spend (the whole life, every branch) is at or past
        the budget: checked before every model call, so the call that crossed it is the
        last one (a summary call's spend counts like a turn's)."""
        reason = self.budget().reached(self.state.spend_total, self.prices)
        if reason is not None:
            raise BudgetReached(reason)

    def _hold_on_budget(self, reason: str) -> Outcome:
        """Hold the task on its budget: a ``hold`` record with no call and the reason (what
        ``agentd show`` and ``agentd run`` show), and ``budget_exhausted``."""
        if self.journal is not None:
            try:
                self._record({"k": "hold", "calls": [], "budget": reason})
            except (StorageError, FencedError, OSError) as exc:
                return storage_outcome(exc)
        budget = self.budget()
        self._event("budget_exhausted", level="warning", reason=reason, budget=budget.to_json())
        return Outcome("held", reason, ExitCode.HELD)

    # -- the model ----------------------------------------------------------------------

    def _request(self) -> ModelRequest:
        name = self.spec.model or self.config.model.name
        return ModelRequest(
            model=name,
            max_tokens=self.spec.max_tokens or self.config.model.max_tokens,
            messages=self.state.transcript(),
            system=self.spec.system,
            tools=[t.api_definition() for t in self.tools],
            compact_trigger=self.config.context.threshold_for(name)
            if self._server_compacts
            else None,
        )

    def _ask(self, request: ModelRequest, phase: str) -> ModelReply:
        """One model call, retried on retryable faults, interruptible by SIGTERM; first,
        the budget (``BudgetReached``: nothing is recorded for this call)."""
        self._check_budget()
        self._phase(phase)

        def on_retry(exc: Exception, attempt: int, delay: float) -> None:
            self._event(
                "model_retry", level="warning", attempt=attempt, delay=delay, error=str(exc)
            )
            self._phase(phase)  # a retry is progress: the deadline covers one attempt
            if self.heartbeat:  # what status shows as the task's REASON meanwhile
                retry = {"error": str(exc), "attempt": attempt, "next_try": time.time() + delay}
                self.heartbeat.update(retry=retry)

        self._journal.sync_in_background()  # the last result becomes durable meanwhile
        self._interruptible = True
        started = time.perf_counter()
        try:
            if self.stop_requested:
                raise StopRequested
            with self._chat_span(request, phase) as span:
                reply = call_with_retries(
                    self.model,
                    request,
                    turn_index=self.state.turn,
                    on_retry=on_retry,
                    sleep=self.sleep,
                )
                if span is not None:
                    span.reply = reply
        finally:
            self._interruptible = False
            if self.heartbeat:
                self.heartbeat.update(retry=None)
        self.metrics.model_called(time.perf_counter() - started, reply.model, reply.usage)
        self._phase("idle")
        return reply

    def _chat_span(
        self, request: ModelRequest, phase: str
    ) -> AbstractContextManager[ChatSpan | None]:
        """The model call's ``chat`` span (``worker.spans``), or nothing when traces are off;
        what it captures of the input is the message this call adds (the rest was sent
        before)."""
        if self.spans is None:
            return contextlib.nullcontext()
        purpose = "compaction" if phase == "compaction" else "turn"
        added = request.messages[-1:] if request.messages else []
        return self.spans.chat(request.model, purpose, added)

    def _call_model(self) -> None:
        try:
            reply = self._ask(self._request(), "model")
            if reply.stop_reason == "model_context_window_exceeded":
                # cut off by the window: not recorded (like an interrupted call), retried
                raise ContextTooLongError("the reply hit the model's context window")
        except ContextTooLongError as exc:
            if self.state.compacted_at(self.state.turn) or not self._compact("too_long"):
                raise ModelError(f"{exc}: {self._too_long_advice()}") from None
            return  # the loop asks again, on the compacted transcript
        message = {"role": "assistant", "content": reply.content}
        records: list[JSON] = [
            {
                "k": "turn",
                "turn": self.state.turn + 1,
                "message": message,
                "stop_reason": reply.stop_reason,
                "usage": reply.usage.to_json(),
                "model": reply.model,
            }
            | ({} if reply.context_tokens is None else {"tokens_used": reply.context_tokens})
            | ({"id": reply.id} if reply.id else {})
        ]
        if reply.stop_reason == "max_tokens":  # tool input may be cut: never run it
            records += [
                {
                    "k": "result",
                    "call_id": b["id"],
                    "content": "not executed: the reply was cut off at max_tokens",
                    "is_error": True,
                    "outcome": "not_run",
                }
                for b in reply.content
                if b.get("type") == "tool_use"
            ]
        # A tool_use reply is followed at once by its first call's intent: the turn is
        # written and made durable with it, before any tool acts, which is what matters
        # (a kill before that only means the model is asked again).
        if reply.stop_reason == "tool_use":
            self._record(*records, hold=True)
        else:
            self._record(*records)
        if any(block.get("type") == "compaction" for block in reply.content):
            # the API compacted the transcript as it answered: counted as the client's are
            # (status, ``agentd_compactions_total`` from this event)
            self._event("compaction", strategy="server", tokens_after=reply.context_tokens)

    # -- compaction --------------------------------------------------------------------

    def _compaction_due(self) -> bool:
        """``tokens_used`` is at or past ``[context] compact_at`` of the window, and this
        boundary was not compacted yet (a compaction's own estimate may still be over);
        never when the API compacts (it would always come first, at the same threshold)."""
        if self._server_compacts:
            return False
        threshold = self.config.context.threshold_for(self.spec.model or self.config.model.name)
        return self.state.tokens_used >= threshold and not (
            self.state.compacted_at(self.state.turn)
        )

    def _compact(self, trigger: str) -> bool:
        """Summarise the transcript but its last ``keep_turns`` turns and record the
        ``compaction``; False when there is nothing to summarise."""
        context = self.config.context
        messages = self.state.transcript()
        at = compaction.cut(messages, context.keep_turns)
        if at is None:
            return False
        kept = sum(m["role"] == "assistant" for m in messages[at:])
        last = self.state.turn - kept
        first = last - sum(m["role"] == "assistant" for m in messages[:at]) + 1
        asked = compaction.summary_messages(
            messages[:at], compaction.instruction(context.instructions)
        )
        request = replace(
            self._request(),
            messages=asked,
            summary=SummaryOf(len(self.state.live_compactions()), first, last),
            compact_trigger=None,  # a summary call summarises: the API must not compact it
        )
        try:
            reply = self._ask(request, "compaction")
        except ContextTooLongError as exc:
            raise ModelError(
                f"{exc}: the part of the transcript to summarise does not fit either; "
                f"{self._too_long_advice()}"
            ) from None
        summary = compaction.summary_text(reply.content)
        before = self.state.tokens_used
        after = compaction.estimate_tokens(
            before, messages, compaction.compacted(self.state.prompt, summary, messages[at:])
        )
        self._record(
            {
                "k": "compaction",
                "summary": summary,
                "keep": len(messages) - at,
                "first": first,
                "last": last,
                "usage": reply.usage.to_json(),
                "model": reply.model,
                "tokens_before": before,
                "tokens_after": after,
                "trigger": trigger,
            }
            | ({"id": reply.id} if reply.id else {})
        )
        self._event(
            "compaction",
            strategy="client",
            first=first,
            last=last,
            tokens_before=before,
            tokens_after=after,
            trigger=trigger,
        )
        return True

    def _too_long_advice(self) -> str:
        context = self.config.context
        return (
            "the transcript does not fit the model's context window, and compaction cannot "
            "make it fit; "
            f"lower [context] keep_turns (now {context.keep_turns}) or [model] max_tokens, "
            "or rewind the task to an earlier turn, and run `agentd retry TASK`"
        )

    # -- tools --------------------------------------------------------------------------

    @functools.cached_property
    def workspace_root(self) -> Root:
        """The workspace, opened once (``O_DIRECTORY | O_NOFOLLOW``) at the first tool call:
        every path of the file tools is resolved beneath this fd."""
        return Root(self.workspace)

    def _context(self, call: Call, key: str) -> ToolContext:
        return ToolContext(
            workspace=self.workspace,
            task_id=self.task_id,
            call_id=call.call_id,
            idempotency_key=key,
            timeout=self.config.deadlines.tool_call,
            env=self.tool_env,
            sandbox=self.sandbox,
            root=self.workspace_root,
        )

    def _error_result(self, call: Call, message: str, outcome: str = "error") -> None:
        self._record(
            {
                "k": "result",
                "call_id": call.call_id,
                "content": message,
                "is_error": True,
                "outcome": outcome,
            }
        )

    def _run_call(self, call: Call, *, attempt: int, outcome: str = "ran") -> None:
        begun = time.time_ns()
        tool = self.tools.get(call.tool)
        if tool is None:
            message = f"unknown tool {call.tool!r}; available: {self.tools.names()}"
            self._error_result(call, message)
            self._tool_span(call, begun, None, "error", "unknown_tool", message, attempt)
            return
        try:
            data = tool.check_input(call.input)
        except ToolError as exc:
            self._error_result(call, str(exc))
            self._tool_span(call, begun, tool.effect.value, "error", "invalid_input", exc, attempt)
            return
        key = call.key or idempotency_key(self.task_id, self.state.epoch, call.call_id)
        if self.sandbox.verdict() == "bwrap":  # what it hides, read before anything is recorded
            self._others.refresh()
        self._record(
            {
                "k": "intent",
                "call_id": call.call_id,
                "tool": tool.name,
                "effect": tool.effect.value,
                "key": key,
                "attempt": attempt,
            }
        )
        if self.fence is not None:
            self.fence()  # (FencedError: the worker stops, the intent dangling for the next owner)
        self._phase(f"tool:{tool.name}")
        started = time.perf_counter()
        content: str | list[JSON]
        error_type: str | None = None
        try:
            output = tool.result(self._context(call, key), data)
            if isinstance(output, ToolResult):
                content, is_error = output.content, output.is_error
            else:
                content, is_error = output, False
        except OutcomeUnknown as exc:
            self.metrics.tool_called(tool.name, time.perf_counter() - started)
            self._phase("idle")
            self._outcome_unknown(call, str(exc))
            return
        except ToolError as exc:
            content, is_error, error_type = str(exc), True, "tool_error"
        except Exception as exc:
            content, is_error = f"{tool.name} failed: {type(exc).__name__}: {exc}", True
            error_type = type(exc).__name__
        self._unknown.pop(call.call_id, None)
        self.metrics.tool_called(tool.name, time.perf_counter() - started)
        self._phase("idle")
        self._keep_result(
            {
                "k": "result",
                "call_id": call.call_id,
                "content": content,
                "is_error": is_error,
                "outcome": outcome,
            }
        )
        self._tool_span(call, begun, tool.effect.value, outcome, error_type, content, attempt)

    def _tool_span(
        self,
        call: Call,
        begun: int,
        effect: str | None,
        outcome: str,
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
        self._event("mcp_server_failed", level="warning", call_id=call.call_id, error=why)
        if count >= UNKNOWN_OUTCOMES:
            self._unknown.pop(call.call_id, None)
            self._error_result(
                call,
                f"{why}; its outcome was unknown {count} times in a row, so it was not tried "
                "again: it may or may not have taken effect",
            )

    def _keep_result(self, result: JSON) -> None:
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
        try:
            self._record(result, sync=False)
            return
        except (StorageError, OSError) as exc:
            if self.result_wait is None or storage_fault(exc) is None:
                raise
            fault = storage_fault(exc)
        self._event("result_waiting", level="warning", call_id=result["call_id"], error=str(fault))
        with self.result_wait():
            while True:
                self.sleep(RESULT_RETRY)
                try:
                    if not self._written_meanwhile(result):
                        self._record(result, sync=False)
                    break
                except (StorageError, OSError) as exc:
                    if storage_fault(exc) is None:
                        raise
        self._event("result_written", call_id=result["call_id"])

    def _written_meanwhile(self, result: JSON) -> bool:
        """Reopen the journal after its last record known here (``FencedError`` when the
        task's owner changed) and fold in what it holds: whether ``result`` is there."""
        writer = self._journal
        journal, records = self.store.open_journal(writer.owner, after=writer.cursor)
        with contextlib.suppress(StorageError, OSError):
            writer.close()  # (refusing appends since its failed one)
        self.journal = journal
        if self.heartbeat:
            self.heartbeat.follow(journal=lambda: journal.durable.position)
        for record in records:
            self.state.apply(record)
        return any(
            r.get("k") == "result" and r.get("call_id") == result["call_id"] for r in records
        )

    def _settle_dangling(self, call: Call) -> Outcome | None:
        """Reconcile a call that started and never finished; an Outcome if the task holds."""
        tool = self.tools.get(call.tool)
        if call.decision is None:
            self._load_decision(call)
        step = plan(call, tool, self.config.tools.policy)
        fields: dict[str, Any] = {
            "call_id": call.call_id,
            "tool": call.tool,
            "attempt": call.attempt,
        }
        if step.try_reconcile and tool is not None and tool.reconcile is not None:
            begun = time.time_ns()
            key = call.key or idempotency_key(self.task_id, self.state.epoch, call.call_id)
            try:
                answer = tool.reconcile(self._context(call, key), dict(call.input or {}))
            except Exception as exc:
                answer = None
                self._event("reconcile_failed", level="warning", error=str(exc), **fields)
            if answer is not None:
                self._record(
                    {
                        "k": "result",
                        "call_id": call.call_id,
                        "content": answer,
                        "is_error": False,
                        "outcome": "reconciled",
                    }
                )
                effect = tool.effect.value
                self._tool_span(call, begun, effect, "reconciled", None, answer, call.attempt)
                self._event("dangling_reconciled", **fields)
                return None
        if step.action is Action.RERUN:
            self._event("dangling_rerun", why=step.why, **fields)
            self._run_call(call, attempt=call.attempt + 1, outcome="rerun")
        elif step.action is Action.SKIP:
            reason = (call.decision or {}).get("reason") or "no reason given"
            self._error_result(
                call,
                f"not executed: an operator skipped this call after a crash ({reason}); "
                "it may or may not have taken effect before the crash",
                outcome="skipped",
            )
        elif step.action is Action.SUPPLIED:
            self._record(
                {
                    "k": "result",
                    "call_id": call.call_id,
                    "content": str((call.decision or {}).get("result", "")),
                    "is_error": False,
                    "outcome": "operator",
                }
            )
        else:
            why = step.why
            taken = self.owner.previous if self.owner is not None else None
            if taken is not None:  # (a claim took the task from a node that stopped renewing)
                why = f"{why}; {taken.told()}"
            hold = {"call_id": call.call_id, "attempt": call.attempt, "tool": call.tool}
            self._record({"k": "hold", "calls": [{**hold, "why": why}]})
            self._event("dangling_held", level="warning", why=why, **fields)
            told = f"dangling {call.tool} call {call.call_id}: {why}"
            return Outcome("held", told, ExitCode.HELD)
        return None

    def _load_decision(self, call: Call) -> None:
        """Apply an operator's decision file for this attempt, if one was written (and
        the task was not cancelled: a cancel is final, so the call stays held)."""
        if call.key is None or self.store.cancel_requested(self.task_id):
            return
        try:
            data = self.store.read_decision(self.task_id, call.key, call.attempt)
        except InvalidIdError:
            return  # no decision can name this call: it stays held
        except Unreadable as exc:
            self._event("decision_invalid", level="error", file=exc.where, error=exc.reason)
            return
        if data is None:
            return
        try:
            decision = decision_fields(data)
        except ValueError as exc:
            where = f"decisions/{call.key}.{call.attempt}.json"
            self._event("decision_invalid", level="error", file=where, error=str(exc))
            return
        action = decision.pop("action")
        record: JSON = {
            "k": "decision",
            "call_id": call.call_id,
            "attempt": call.attempt,
            "action": action,
            **decision,
        }
        self._record(record)
        # who decided (docs/design.md section 15), as the decision names them
        who = {k: decision[k] for k in ("by", "via") if k in decision}
        self._event("dangling_decided", call_id=call.call_id, action=action, **who)

    # -- signals ------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            self.stop_requested = True
            if self._interruptible:
                self._interruptible = False
                raise StopRequested

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    def close(self) -> None:
        if self.servers is not None:
            self.servers.close()  # (before the worker's exit kills what is left)
        self._snapshots.close()
        if "workspace_root" in self.__dict__:
            self.workspace_root.close()
        if self.journal is not None:
            self.journal.close()
        if self._own_owner and self.owner is not None:
            self.store.release(self.owner)
            self.owner = None
        self.model.close()


def write_exit(store: TaskStore, task_id: str, outcome: Outcome) -> None:
    """The worker's last words for the supervisor (best effort: a crash writes none; a
    fenced worker writes none either, the exit record is its task's new owner's)."""
    if outcome.fenced:
        return
    data = exit_record(
        outcome.exit_code, outcome.state, outcome.reason, pid=os.getpid(), at=utc_now()
    )
    with contextlib.suppress(StorageError, OSError):  # a full disk: the exit code says it
        store.publish_exit(task_id, data)
