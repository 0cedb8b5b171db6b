"""The agent loop: call the model, record the turn, run each tool call, record each
result, send the results back, until the task ends.

The loop never keeps state of its own: every step is chosen by ``_loop`` from the folded
``TaskState``, so a fresh start and a resume after ``kill -9`` are the same code path.
``AgentLoop`` is the wiring and the order of the steps; each step is a role of its own:

* ``worker.recorder.Recorder``: the journal, the state and the events; every record goes
  through it, and snapshots are taken there at turn boundaries;
* ``worker.turns.ModelTurns``: the model call and its ``turn`` record, recorded once the
  reply has fully arrived (a retried or interrupted call records nothing and counts no
  usage), and compaction;
* ``worker.tool_calls.ToolCalls``: a tool call, its ``intent`` durable (fdatasync) before
  the tool runs, its ``result`` after;
* ``worker.dangling.DanglingCalls``: a call with an intent and no result is *dangling* and
  is reconciled (``worker.reconcile``) instead of being run again blindly;
* ``worker.budget.TaskBudget``: the budget, checked before every model call.

Three timing points feed the worker's metrics (``worker.metrics``, published with the
heartbeat): each journal write, each model call and each tool call, a ``perf_counter``
pair apiece.

A task's tools are decided once, at its first start (``_offer_tools``): the built-in and
module tools and the MCP tools its ``--tools`` (or ``[tools] default``) names, each MCP
server it may reach started and listed, the list recorded (a ``tools`` record) before the
first model call. Every later start, rewind and fork offers that list.

Stopping on SIGTERM is only immediate while the worker waits on the model (nothing is
recorded then: ``worker.turns.StopSignal``); during a tool call it takes effect once the
result is recorded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from worker import credentials, vcs
from worker.approvals import AskPolicy
from worker.budget import BudgetReached, TaskBudget
from worker.config import Config
from worker.dangling import DanglingCalls
from worker.errors import (
    ConfigError,
    FencedError,
    JournalCorruptError,
    ModelError,
    StorageError,
    TaskSpecError,
)
from worker.events import Event
from worker.heartbeat import Heartbeat
from worker.mcp import catalog
from worker.mcp import tools as mcp_tools
from worker.mcp.servers import Backoff, Placement, ServerFailed, ToolServers
from worker.metrics import StepMetrics
from worker.models.base import Model
from worker.outcome import Outcome, storage_outcome, write_exit
from worker.protocol import ExitCode
from worker.recorder import SNAPSHOT_EVERY, Recorder
from worker.records import RecordKind, ToolsRecord, VcsRecord
from worker.spans import RunSpans
from worker.spool import Spool, TaskSpec
from worker.state import TaskState
from worker.store.base import JournalWriter, Owner, TaskStore
from worker.tool_calls import OtherWorkspaces, ToolCalls, tool_environment, tool_secret_files
from worker.tools.registry import ToolRegistry
from worker.tools.sandbox import mode_for, sandbox_for
from worker.turns import ModelTurns, StopRequested, StopSignal

# (``python -m worker`` takes how a run ends from here, with the loop)
__all__ = ["CONTINUE_PROMPT", "AgentLoop", "Outcome", "storage_outcome", "write_exit"]

CONTINUE_PROMPT = "Your reply was cut off by the max_tokens limit. Please continue."


class AgentLoop:
    """One task's loop on a ``TaskStore``: it never knows which backend it has.

    ``owner`` is the loop's ownership of the task (the worker takes it before it reads
    anything); without one, ``open`` takes it and ``close`` gives it back. ``fence``,
    when given, raises ``FencedError`` once this worker may no longer act (a lease it
    could not renew in time: ``worker.lease``); it is asked right before every tool runs,
    the one step the store cannot fence itself. ``result_wait``, on a shared store, is
    what a call's result waits in when the database refuses its write
    (``ToolCalls.keep_result``): a block within which the worker is not ended for beats
    or renewals that fail. ``workspace`` is where the tools work; ``spool`` the folder the
    sandbox hides from them, if any."""

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
        self.retries = retries  # the operator's, by the task's record (``RETRIES_ENV``)
        self.task_id = spec.id
        self.owner = owner
        self._own_owner = owner is None
        self.spec = spec
        self.config = config
        self.model = model
        self.local_tools = tools  # the built-in and module tools this worker has
        self.heartbeat = heartbeat
        self.metrics = metrics if metrics is not None else StepMetrics()
        self.workspace = workspace
        self.recorder = Recorder(
            store, self.task_id, spec.prompt, heartbeat, self.metrics, snapshot_every=snapshot_every
        )
        self.stop = StopSignal()
        tool_env = tool_environment(os.environ, self.task_id, str(workspace))
        others = OtherWorkspaces(store, self.task_id)
        self.sandbox = sandbox_for(
            mode_for(
                config.tools.sandbox, store=credentials.held().get(credentials.STORE) is not None
            ),
            config.tools.network,
            spool=spool,
            config=config.source,
            secret_files=tool_secret_files(os.environ),
            on_verdict=(lambda verdict: heartbeat.update(sandbox=verdict)) if heartbeat else None,
            others=others,
        )
        #: the MCP servers this worker may start ([mcp.servers]), none until a call needs one
        self.servers = (
            ToolServers(
                config.mcp.servers,
                Placement(workspace, tool_env, self.sandbox, config.restart.stop_grace),
                backoff=Backoff(config.restart.backoff_initial, config.restart.backoff_max),
                on_event=lambda event, level, fields: self.recorder.event(event, level, **fields),
            )
            if config.mcp.servers
            else None
        )
        #: the workspace's git, as decided at submit (None: its files are not recorded)
        self._git = (
            vcs.git_of(spec.git, Spool(spool).task(spec.id).git, self.sandbox) if spool else None
        )
        self.budget = TaskBudget(
            store,
            self.task_id,
            spec.budget,
            config.price_table,
            lambda where, error: self.recorder.event(
                Event.DECISION_INVALID, level="error", file=where, error=error
            ),
        )
        self.turns = ModelTurns(
            self.recorder,
            spec,
            config,
            model,
            self.budget,
            self.stop,
            metrics=self.metrics,
            spans=spans,
            sleep=sleep,
        )
        self.tool_calls = ToolCalls(
            self.recorder,
            config,
            tools,  # the task's own, once _offer_tools decided them
            workspace=workspace,
            env=tool_env,
            sandbox=self.sandbox,
            others=others,
            metrics=self.metrics,
            spans=spans,
            sleep=sleep,
            fence=fence,
            result_wait=result_wait,
            asks=AskPolicy.of(config.tools.ask + spec.ask, config.tools.ask_effects),
        )
        self.dangling = DanglingCalls(
            self.recorder,
            self.tool_calls,
            config.tools.policy,
            expire_after=config.approvals.expire_after,
        )

    # -- what the roles share --------------------------------------------------------------

    @property
    def state(self) -> TaskState:
        """The task as folded from its journal (``Recorder.state``)."""
        return self.recorder.state

    @property
    def journal(self) -> JournalWriter | None:
        return self.recorder.journal

    @property
    def stop_requested(self) -> bool:
        return self.stop.requested

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        self.stop.requested = value

    @property
    def tools(self) -> ToolRegistry:
        """The task's tools (``_offer_tools``)."""
        return self.tool_calls.tools

    @property
    def model_name(self) -> str:
        return self.turns.model_name

    def open(self) -> TaskState:
        """Take the task (unless the loop was handed its ownership), load the snapshot (if
        usable) and replay the journal after it (``Recorder.open``)."""
        if self.owner is None:
            self.owner = self.store.acquire(self.task_id)
        return self.recorder.open(self.owner, self.spec.prompt)

    def install_signal_handlers(self) -> None:
        self.stop.install()

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
        recorder = self.recorder
        try:
            if recorder.journal is None:
                self.open()
            if self.state.records > 1:
                recorder.event(Event.TASK_RESUMED)
            if not self.state.ended:
                self.budget.check_prices(self.model_name, self.config.source)
            self._reopen_if_retried()
            waiting = self._offer_tools()
            if waiting is not None:
                return waiting
            if self.config.context.strategy == "server" and not self.turns.server_compacts:
                recorder.event(
                    Event.CONTEXT_STRATEGY_FALLBACK,
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
            recorder.phase("idle")

    def _loop(self) -> Outcome:
        while True:
            state = self.state
            if state.ended:
                return self._outcome_of_end()
            if self.stop.requested:
                return Outcome("stopped", "stopped at a safe point", ExitCode.STOPPED)
            pending = state.pending_calls()
            if pending:
                call = pending[0]
                if call.dangling:
                    held = self.dangling.settle(call, self.owner)
                    if held is not None:
                        return held
                else:  # (one that waits for approval is recorded as asked, and held next)
                    self.tool_calls.run(call, attempt=1, ask=True)
                continue
            self._checkpoint_workspace()
            self.recorder.maybe_snapshot()
            ending = self._ending()
            if ending is not None:
                return self._end(*ending)
            if state.last_role == "assistant" and state.stop_reason == "max_tokens":
                self.recorder.record(
                    {"k": RecordKind.USER, "content": [{"type": "text", "text": CONTINUE_PROMPT}]}
                )
                continue
            if self.turns.compaction_due():
                self.turns.compact("threshold", self.tools)
            self.turns.call(self.tools)

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

    def _checkpoint_workspace(self) -> None:
        """Record the workspace's git state at this turn boundary, once per boundary."""
        if self._git is None or self.state.turn in self.state.vcs:
            return
        try:
            point = self._git.capture(self.task_id, self.state.turn)
        except vcs.VcsError as exc:
            self.recorder.event(Event.VCS_CAPTURE_FAILED, level="warning", error=str(exc))
            self._git = None
            return
        record: VcsRecord = {
            "k": RecordKind.VCS,
            "turn": self.state.turn,
            "commit": point.commit,
            "snapshot": point.snapshot,
        }
        # not synced on its own: the next record's fdatasync carries it, and a lost one
        # only means this boundary has no file snapshot
        self.recorder.record(record, sync=False)

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
            self.tool_calls.tools = mcp_tools.registry(chosen, self.local_tools, None)
            return None
        if recorded is None:
            try:
                chosen = mcp_tools.offer(patterns, self.local_tools, self.servers)
            except ServerFailed as exc:
                return Outcome("stopped", str(exc), ExitCode.TOOLS)
            listed: ToolsRecord = {
                "k": RecordKind.TOOLS,
                "local": chosen["local"],
                "mcp": chosen["mcp"],
                "listed": chosen["listed"],
            }
            self.recorder.record(listed, sync=False)
            recorded = self.state.tools or {}
        self.tool_calls.tools = mcp_tools.registry(
            catalog.tool_list(recorded), self.local_tools, self.servers
        )
        return None

    def _reopen_if_retried(self) -> None:
        """A task whose journal ended ``failed`` (a model or spec error) and that an
        operator retried since goes on: a ``retry`` record, once per retry, reopens it.
        (A worker started again after it wrote its end, with no retry since, ends the
        same way again.)"""
        ended = self.state.ended
        if ended and ended.get("state") == "failed" and self.state.retries < self.retries:
            self.recorder.record({"k": RecordKind.RETRY, "n": self.retries})

    def _end(self, state: str, reason: str) -> Outcome:
        if self.recorder.journal is not None and not self.state.ended:
            self.recorder.record({"k": RecordKind.END, "state": state, "reason": reason})
        return self._outcome_of_end()

    def _outcome_of_end(self) -> Outcome:
        ended = self.state.ended or {}
        state = str(ended.get("state"))
        return Outcome(
            state, str(ended.get("reason")), ExitCode.DONE if state == "done" else ExitCode.FAILED
        )

    def _hold_on_budget(self, reason: str) -> Outcome:
        """Hold the task on its budget (docs/design.md section 13): a ``hold`` record with
        no call and the reason (what ``agentd show`` and ``agentd run`` show), and
        ``budget_exhausted``."""
        if self.recorder.journal is not None:
            try:
                self.recorder.record({"k": RecordKind.HOLD, "calls": [], "budget": reason})
            except (StorageError, FencedError, OSError) as exc:
                return storage_outcome(exc)
        budget = self.budget.current()
        self.recorder.event(
            Event.BUDGET_EXHAUSTED, level="warning", reason=reason, budget=budget.to_json()
        )
        return Outcome("held", reason, ExitCode.HELD)

    def close(self) -> None:
        if self.servers is not None:
            self.servers.close()  # (before the worker's exit kills what is left)
        self.tool_calls.close()
        self.recorder.close()
        if self._own_owner and self.owner is not None:
            self.store.release(self.owner)
            self.owner = None
        self.model.close()
