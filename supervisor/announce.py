"""What the daemon says (docs/design.md sections 7, 9 and 15): the daemon's role that
writes each lifecycle event it makes to its log and, for a task's, to the task's events
file, runs the hook of a state a task reaches, and tells what it is doing when asked
(SIGUSR1's summary, systemd's status line, a scrape's sample).

A task's event goes to its events file marked as the daemon's (``relay.DAEMON_MARK``),
after what other processes wrote there before it, and is logged where the file has it
(``supervisor.relay``); a write a storage fault refused waits in the daemon's backlog and
is logged at once. The operator an event names (``by``, ``via``) is kept for the task's
next hook, whose payload says what led to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from supervisor.hooks import HOOK_STATES, HoldKind
from supervisor.metrics import Sample
from supervisor.operator import Operator
from supervisor.relay import DAEMON_MARK
from supervisor.status import held_calls
from worker import credentials
from worker.budget import budget_hold
from worker.errors import AgentdError
from worker.events import Event, event_line, utc_now
from worker.protocol import TaskStatus
from worker.store.durable import atomic_write_json

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor
    from supervisor.slot import TaskSlot
    from worker.spool import TaskDir


class Announcer:
    """The daemon's events and hooks (module docstring)."""

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon
        # the last operator's action on each task since its last hook: what the next
        # hook's payload says led to it (``by``, ``via``; docs/design.md section 15)
        self._acted: dict[str, dict[str, Any]] = {}
        self._status = ""  # the status line systemd was last told
        self.info: dict[str, Any] = {}  # supervisor.json (``publish_info``), once ready

    def emit(
        self, event: Event, slot: TaskSlot | None = None, level: str = "info", **kw: Any
    ) -> None:
        """Log ``event``; a task's also goes to its events file (module docstring)."""
        daemon = self.daemon
        if slot is None:
            getattr(daemon.log, level)(event, **kw)
            return
        task_id = slot.task.id
        daemon.relay.pull(task_id)
        kw = {"task": task_id, **kw}
        mark, value = DAEMON_MARK
        line = event_line(event, level, **kw, **{mark: value})
        written = False
        with contextlib.suppress(OSError):  # not a file of ours (a folder): dropped
            written = daemon.backlog.append(lambda: daemon.store.append_event(task_id, line))
        self._acted_on(task_id, event, kw)

        def log() -> None:
            getattr(daemon.log, level)(event, **kw)

        if written:  # logged where the file has it, after what another process wrote first
            daemon.relay.pull(task_id, own=(line, log))
        else:
            log()

    def _acted_on(self, task_id: str, event: str, fields: Mapping[str, Any]) -> None:
        """Keep the operator an event names (``by``, ``via``) for the task's next hook."""
        if (who := Operator.of(fields)) is not None:
            self._acted[task_id] = {**who.fields(), "acted": event}

    def hook(self, slot: TaskSlot) -> None:
        """Run the hook of the state ``slot`` has just reached, if one is set
        (``supervisor.hooks``): started now, never waited for."""
        daemon = self.daemon
        key, event = HOOK_STATES[slot.record.state]
        command = getattr(daemon.config.hooks, key)
        if not command:
            return
        payload: dict[str, Any] = {
            "event": event,
            "task": slot.task.id,
            "reason": slot.record.reason,
            "node": daemon.placement.node,
            "timestamp": utc_now(),
            **self._acted.pop(slot.task.id, {}),  # the operator's action that led here
        }
        if slot.record.state == TaskStatus.HELD:
            try:
                payload["dangling"] = held_calls(slot.task)
            except (AgentdError, OSError, ValueError) as exc:  # a journal it cannot read
                payload["dangling"] = []
                self.emit(Event.HOOK_FAILED, slot, level="warning", hook=key, why=f"{exc}")
            # what the hold waits for: a call's decision, or a budget (its own event name)
            on_budget = not payload["dangling"] and budget_hold(slot.record.reason)
            payload["kind"] = HoldKind.BUDGET if on_budget else HoldKind.CALL
            if on_budget:
                payload["event"] = Event.BUDGET_EXHAUSTED
        daemon.hooks.run(key, command, payload)

    def relayed(self, task_id: str, event: Mapping[str, Any]) -> None:
        """Another process's event reached the daemon's log: count what a metric counts,
        and keep the operator it names for the task's next hook."""
        name = str(event.get("event"))
        if name == Event.COMPACTION:
            self.daemon.metrics.compactions += 1
        self._acted_on(task_id, name, event)

    def hook_failed(self, task_id: str, hook: str, why: str) -> None:
        slot = self.daemon.slots.get(task_id)
        self.emit(Event.HOOK_FAILED, slot, level="warning", hook=hook, why=why, task=task_id)

    # -- what the daemon is doing, told on demand --------------------------------------

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for slot in self.daemon.slots.values():
            counts[slot.record.state] = counts.get(slot.record.state, 0) + 1
        return {state: counts[state] for state in TaskStatus if counts.get(state)}

    def summary(self) -> None:
        """SIGUSR1: one line that says what the daemon is doing, in its own log."""
        daemon = self.daemon
        server = daemon.forkserver
        self.emit(
            Event.SUPERVISOR_STATUS,
            pid=os.getpid(),
            tasks=self._counts(),
            workers=daemon.running_count(),
            max_workers=daemon.config.max_workers,
            forkserver="off" if server is None else "ready" if server.ready else "starting",
            config=str(daemon.settings.file) if daemon.settings.file else None,
            stopping=daemon.stopping,
        )

    def ignored(self, sig: int) -> None:
        self.emit(Event.SIGNAL_IGNORED, signal=signal.Signals(sig).name, pid=os.getpid())

    def publish_info(self) -> None:
        """``supervisor.json``: who the daemon is, and whether it holds an API key (what
        ``submit`` warns about: never the key itself)."""
        if not self.info:  # not ready yet: ``run`` publishes it
            return
        daemon = self.daemon
        held = daemon.settings.credentials
        has_key = held.get(credentials.API_KEY) or held.get(credentials.AUTH_TOKEN)
        info = {**self.info, "api_key": bool(has_key)}
        if not has_key:
            info["api_key_hint"] = credentials.how_to_change(credentials.API_KEY, os.environ)
        path = daemon.spool.root / "supervisor.json"
        daemon.backlog.replace("supervisor.json", lambda: atomic_write_json(path, info))

    def task_removed(self) -> None:
        """A task was removed (``agentd_tasks_removed_total``)."""
        self.daemon.metrics.removed()

    def spool_measured(self, size: int) -> None:
        """The spool's size, measured (``supervisor.housekeeping``): in the metrics and in
        ``supervisor.json``, where ``status`` shows it."""
        self.daemon.metrics.spool_bytes = size
        if self.info:
            self.info["spool_bytes"] = size
            self.publish_info()

    def publish_status(self) -> None:
        """systemd's status line (``STATUS=``): the tasks in each state, when it changed."""
        if not self.daemon.notifier.enabled:  # no systemd to tell: spare counting every task
            return
        counts = self._counts()
        text = ", ".join(f"{n} {state}" for state, n in counts.items()) or "no tasks"
        if text != self._status:
            self._status = text
            self.daemon.notifier.status(text)

    def sample(self) -> Sample:
        """A scrape's values (on the loop): the running workers' beats folded first, so the
        histograms are as fresh as their last beat."""
        daemon = self.daemon
        states: dict[str, int] = {}
        held: list[tuple[TaskDir, str]] = []
        for slot in daemon.slots.values():
            state = slot.record.state
            states[state] = states.get(state, 0) + 1
            if state == TaskStatus.HELD:
                held.append((slot.task, slot.record.updated_at))
            if slot.worker is not None:
                beat = daemon.settler.heartbeat(slot)
                if beat is not None and beat.get("pid") == slot.worker.pid:
                    daemon.metrics.fold(slot.task.id, beat)
        return daemon.metrics.sample(states, held, nodes=daemon.placement.nodes_alive())
