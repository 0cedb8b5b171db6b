"""``python -m worker TASK_DIR``: run one task until it ends, holds or is stopped.

Exit codes are listed in docs/ARCHITECTURE.md (0 done, 3 failed, 4 held, 5 stopped,
6 locked, 7 storage fault, 78 configuration error; anything else is a crash).

Started as a process of its own, the worker first takes over its secrets
(``worker.credentials.take_over``: handed over by the daemon through a pipe, never in its
environment); forked from the fork server, it holds them already.

A storage fault (ENOSPC, EIO, EDQUOT, a read-only spool: ``worker.errors.storage_fault``)
ends the worker with exit 7 wherever it strikes: taking the lock, making the workspace,
recording a step (``AgentLoop.run``), writing the heartbeat (its thread calls
``storage_exit``), or anything else that escapes (``main``). The daemon treats exit 7 as
a wait, never as a crash, so a full disk can neither fail a task nor spend its restart
budget. The worker's own output goes through a pipe (``worker.output``), so printing on
a full disk cannot fail either.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from worker import credentials, proctitle
from worker.budget import spend_json
from worker.config import ClusterConfig, Config, load_config
from worker.descendants import contained
from worker.errors import (
    AgentdError,
    ConfigError,
    FencedError,
    InvalidIdError,
    JournalCorruptError,
    LockBusyError,
    StorageError,
    TaskSpecError,
    resource_fault,
    storage_fault,
)
from worker.events import Event, record_event
from worker.heartbeat import Heartbeat
from worker.identity import ProcessId, clock_id
from worker.killtimer import CLOCK_MONOTONIC, KillTimer
from worker.lease import LeaseKeeper
from worker.loop import (
    AgentLoop,
    Outcome,
    storage_outcome,
    write_exit,
)
from worker.mcp.catalog import check_patterns
from worker.metrics import StepMetrics
from worker.models.base import Model
from worker.output import BoundedOutput
from worker.protocol import (
    CGROUP_ENV,
    EPOCH_ENV,
    LEASE_ENV,
    NODE_ENV,
    RETRIES_ENV,
    TAKEN_OVER_ENV,
    ExitCode,
    HeartbeatData,
)
from worker.spans import PROVIDER, SCRIPTED_PROVIDER, RunSpans, identity, telemetry_on
from worker.spool import Spool, TaskDir, TaskSpec
from worker.standby import ConfigAhead
from worker.store.base import JSON, Owner, Previous, TaskStore
from worker.store.files import FileStore
from worker.tools.registry import ToolRegistry


def say(line: str) -> None:
    """One line on stderr (``worker.log``); a line that cannot be written is dropped."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def make_model(store: TaskStore, task: TaskDir, spec: TaskSpec) -> Model:
    if spec.scripted:
        from worker.models.scripted import ScriptedModel  # noqa: PLC0415  (scripted tasks only)

        if isinstance(store, FileStore):
            return ScriptedModel.from_file(task.script)
        try:
            script = store.load_script(task.id)
        except FileNotFoundError:
            raise TaskSpecError(f"task {task.id} has no script; submit it with --script.") from None
        return ScriptedModel.from_bytes(script, f"task {task.id}'s script")
    # The SDK's import (seconds, cold) is part of start-up, never of the first model
    # call, whose deadline would otherwise pay for it (free after the fork server's).
    import anthropic  # noqa: F401, PLC0415  (imported for its cost at start-up: see above)

    from worker.models.messages_api import MessagesAPIModel  # noqa: PLC0415  (API tasks only)

    held = credentials.held()
    return MessagesAPIModel(
        api_key=held.get(credentials.API_KEY), auth_token=held.get(credentials.AUTH_TOKEN)
    )


def open_store(spool: Path) -> TaskStore:
    """The store the task lives in: the spool's files, or the shared store whose URL the
    daemon handed over with the other secrets (``credentials.STORE``)."""
    url = credentials.held().get(credentials.STORE)
    if url is None:
        return FileStore(spool, ring_on_events=True)
    from worker.store.postgres import PostgresStore  # noqa: PLC0415  (psycopg: a shared store only)

    lease = float(os.environ.get(LEASE_ENV) or ClusterConfig().lease)
    node = os.environ.get(NODE_ENV) or None
    return PostgresStore(url, node=node, lease=lease, waits=True)  # (the node runs: a wait)


def handed_over(store: TaskStore, task_id: str) -> Owner | None:
    """The claim a daemon on a shared store runs this worker under (``EPOCH_ENV``)."""
    epoch = os.environ.get(EPOCH_ENV, "")
    if not epoch.isdigit() or credentials.held().get(credentials.STORE) is None:
        return None
    try:
        previous = Previous.from_json(json.loads(os.environ.get(TAKEN_OVER_ENV) or "null"))
    except ValueError:
        previous = None
    node = os.environ.get(NODE_ENV) or socket.gethostname()
    return Owner(task_id, node, int(epoch), previous=previous)


def run(
    store: TaskStore,
    task: TaskDir,
    config_path: Path | None,
    output: BoundedOutput | None = None,
    ahead: ConfigAhead | None = None,
) -> int:
    """Own the task (its lock, or the claim handed over), then run it: everything it
    records goes through the store; the task folder gives only what lives beside it
    (workspace, script, output). ``ahead``: the config a standby read before its task
    (``worker.standby``), used if the file is still the one read."""
    owner = handed_over(store, task.id)
    acquired = owner is None  # a lock of its own; a handed-over claim is the daemon's to end
    if owner is None:
        try:
            owner = store.acquire(task.id, wait=1.0)
        except LockBusyError as exc:
            say(f"agentd worker: {exc}")
            return ExitCode.LOCKED
        except OSError as exc:  # no such task folder, or its lock is not a file of ours
            if storage_fault(exc) is not None:
                raise
            outcome = Outcome(
                "failed", f"cannot take the lock {task.lock}: {exc.strerror}", ExitCode.FAILED
            )
            write_exit(store, task.id, outcome)
            say(f"agentd worker: {outcome.reason}")
            return ExitCode.FAILED
    try:
        killed = functools.partial(processes_killed, store, task.id)
        with contained(killed):  # no tool process outlives it
            return run_owned(
                store, task, owner, config_path, output, handed_over=not acquired, ahead=ahead
            )
    finally:
        if acquired:
            store.release(owner)


def run_owned(
    store: TaskStore,
    task: TaskDir,
    owner: Owner,
    config_path: Path | None,
    output: BoundedOutput | None,
    *,
    handed_over: bool = False,
    ahead: ConfigAhead | None = None,
) -> int:
    """``run`` once the task is owned; a claim ``handed_over`` is kept alive from the
    heartbeat (``worker.lease``)."""
    try:
        config = (ahead.current(config_path) if ahead else None) or load_config(config_path)
    except ConfigError as exc:
        write_exit(store, task.id, Outcome("failed", str(exc), ExitCode.CONFIG))
        say(f"agentd worker: {exc}")
        return ExitCode.CONFIG
    try:
        spec = store.load_spec(task.id)
        # every built-in and module tool: the loop offers the task its own (``_offer_tools``)
        tools = ToolRegistry.standard(config.tools.modules, source=config.source)
        patterns = spec.tools if spec.tools is not None else config.tools.default
        check_patterns(patterns, tools.names(), list(config.mcp.servers))  # (a name naming nothing)
        workspace = task.workspace_for(spec)
        workspace.mkdir(mode=0o700, parents=True, exist_ok=True)
        if spec.workspace is None and workspace.is_symlink():
            raise TaskSpecError(
                f"{workspace} is a symlink; a task's own workspace must be a folder "
                "inside the spool (give --workspace to use a folder elsewhere)."
            )
        model = make_model(store, task, spec)
    except AgentdError as exc:
        if storage_fault(exc) is not None:
            raise
        outcome = Outcome("failed", str(exc), ExitCode.FAILED)
        write_exit(store, task.id, outcome)
        say(f"agentd worker: {exc}")
        return outcome.exit_code
    metrics = StepMetrics()  # the loop measures, the heartbeat publishes
    lease = lease_keeper(store, owner, output) if handed_over else None
    heartbeat = Heartbeat(
        functools.partial(beat, store, task.id, lease),
        config.heartbeat.interval,
        patience=config.heartbeat.timeout / 2,
        on_fault=lambda fault: storage_exit(store, task.id, fault, output),
        metrics=metrics,
        deadman=dead_man(config.heartbeat.timeout) if lease is None else None,
    )
    loop = AgentLoop(
        store,
        spec,
        config,
        model,
        tools,
        heartbeat,
        workspace=workspace,
        spool=task.root,
        owner=owner,
        metrics=metrics,
        fence=lease.check if lease is not None else None,
        result_wait=functools.partial(result_wait, heartbeat, lease) if lease is not None else None,
        retries=int(os.environ.get(RETRIES_ENV) or 0),
        spans=run_spans(store, spec, config),
    )
    loop.install_signal_handlers()
    try:
        state = loop.open()
    except JournalCorruptError as exc:  # the task cannot go on: failed, with the reason
        outcome = Outcome("failed", str(exc), ExitCode.FAILED)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # whole frames whose records do not have the shape of ours: the same verdict
        # (restarting would only replay them again, into a crash loop)
        reason = (
            f"{task.journal}: a record cannot be replayed ({type(exc).__name__}: {exc}); "
            "restore the task folder from a backup or fork the task from an earlier turn."
        )
        outcome = Outcome("failed", reason, ExitCode.FAILED)
    except (AgentdError, OSError) as exc:  # a storage fault: resume later
        outcome = storage_outcome(exc)
    else:
        heartbeat.update(
            turn=state.turn,
            usage=state.usage_total.to_json(),
            spend=spend_json(state.spend_total),
        )
        if lease is not None:  # (read on other machines, and by a daemon started later)
            heartbeat.update(**claim_fields(owner))
        heartbeat.start()
        outcome = loop.run()
    finally:
        heartbeat.stop(final=True)  # the metrics of the last interval too
        if lease is not None:
            lease.close()  # (no tool runs past here: no kill at the lease's end)
        loop.close()
    write_exit(store, task.id, outcome)
    say(f"agentd worker: task {task.id} {outcome.state}: {outcome.reason}")
    return outcome.exit_code


def main(argv: list[str] | None = None, ahead: ConfigAhead | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("task_dir", type=Path, help="the task's folder: SPOOL/tasks/ID")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args(argv)
    os.umask(0o077)
    refused = join_cgroup()
    task_dir = args.task_dir.absolute()
    if ".." in task_dir.parts or task_dir.parent.name != "tasks":
        say(f"agentd worker: {task_dir} is not a task folder (SPOOL/tasks/ID)")
        return 2
    try:
        task = Spool(task_dir.parent.parent).task(task_dir.name)
    except InvalidIdError as exc:
        say(f"agentd worker: {exc}")
        return 2
    proctitle.worker(task.id, task.root)
    output = BoundedOutput.install(task.output)
    if refused is not None:  # the task runs on, bounded only as the daemon is
        say(f"agentd worker: {refused}")
    store: TaskStore | None = None
    try:
        store = open_store(task.root)
        return run(store, task, args.config, output, ahead)
    except (AgentdError, OSError, RuntimeError, MemoryError) as exc:
        # whatever raised it, a storage fault is a wait, and so is a machine out of
        # processes or memory (a neighbour's tools may hold them all)
        fault = storage_fault(exc)
        if fault is not None:
            return stopped_by_storage(store, task.id, fault)
        short = resource_fault(exc)
        if short is None:
            raise
        return stopped_for_resources(store, task.id, short)
    finally:
        if output is not None:
            output.close()


def join_cgroup() -> str | None:
    """Move this process into its task's cgroup (``CGROUP_ENV``, set by a daemon whose
    cgroups are delegated: ``supervisor.cgroups``) before it starts anything. None when
    it did or none is named, else why not."""
    path = os.environ.pop(CGROUP_ENV, None)
    if not path:
        return None
    try:
        Path(path, "cgroup.procs").write_text("0")
    except OSError as exc:
        return f"cannot join the task's cgroup {path}: {exc.strerror}"
    return None


def run_spans(store: TaskStore, spec: TaskSpec, config: Config) -> RunSpans | None:
    """This run's trace spans when traces are on (``[telemetry]``, ``$OTEL_...``): recorded
    with the task's events, exported by the daemon (``worker.spans``)."""
    telemetry = config.telemetry
    if not telemetry_on(telemetry.otlp_endpoint):
        return None
    parent = None
    if spec.forked_from:
        with contextlib.suppress(AgentdError, OSError):  # (a parent gone: no link)
            made = store.load_spec(str(spec.forked_from.get("task"))).created_at
            parent = identity(str(spec.forked_from.get("task")), made)
    return RunSpans(
        store,
        spec.id,
        identity(spec.id, spec.created_at),
        os.environ.get(NODE_ENV) or config.node or socket.gethostname(),
        capture=telemetry.capture_content,
        parent_identity=parent,
        provider=SCRIPTED_PROVIDER if spec.scripted else PROVIDER,
    )


def lease_keeper(store: TaskStore, owner: Owner, output: BoundedOutput | None) -> LeaseKeeper:
    """The keeper of the claim a daemon handed over, for the lease it said (``LEASE_ENV``)."""
    lease = float(os.environ.get(LEASE_ENV) or ClusterConfig().lease)
    made = KillTimer.create()
    timer = made if isinstance(made, KillTimer) else None
    if timer is None:  # the worker's own deadline still stops it (unless it is frozen)
        say(f"agentd worker: {made}; a tool of a frozen worker may outlive its lease")
    return LeaseKeeper(store, owner, lease, functools.partial(lease_lost, output), timer=timer)


def dead_man(timeout: float) -> tuple[KillTimer, float] | None:
    """The kill timer each beat arms ``timeout`` ahead (``worker.heartbeat``), or None
    where the kernel has none: the daemon then finds a hang by reading the beats."""
    made = KillTimer.create(CLOCK_MONOTONIC)
    if isinstance(made, str):
        say(f"agentd worker: {made}; the daemon reads its heartbeat to find a hang")
        return None
    return made, timeout


def claim_fields(owner: Owner) -> HeartbeatData:
    """What a handed-over worker's beats say of it on a shared store: its epoch and its
    process (a daemon started again on this node adopts the worker by them), and the
    monotonic clock its instants are on (``worker.identity``)."""
    process = ProcessId.mine()
    return {
        "epoch": owner.epoch,
        "process": process.to_json() if process is not None else None,
        "clock": clock_id(),
    }


def beat(store: TaskStore, task_id: str, lease: LeaseKeeper | None, data: JSON) -> None:
    """One heartbeat, and the lease kept alive with it."""
    store.publish_heartbeat(task_id, data)
    if lease is not None:
        lease.keep()


@contextlib.contextmanager
def result_wait(heartbeat: Heartbeat, lease: LeaseKeeper) -> Iterator[None]:
    """While a call's result waits for the database: neither failed beats nor a passed
    deadline end the worker; the lease's fence does (``ToolCalls.keep_result``)."""
    with heartbeat.patient(), lease.waiting():
        yield


def lease_lost(output: BoundedOutput | None, exc: FencedError) -> None:
    """End the worker at once: its lease moved or ran out, so another node may run the
    task now, and this one must act no more (no exit record: the task is not its own)."""
    say(f"agentd worker: {exc}")
    if output is not None:
        output.close()
    os._exit(ExitCode.STOPPED)


def processes_killed(store: TaskStore, task_id: str, pids: list[int]) -> None:
    """What ``contained`` killed as the worker left, in the task's events."""
    record_event(store, task_id, Event.PROCESSES_KILLED, pid=os.getpid(), pids=pids, task=task_id)


def stopped_by_storage(store: TaskStore | None, task_id: str, fault: StorageError) -> int:
    """The worker's last words on a storage fault (best effort: the disk may take none;
    none when the store could not even be opened)."""
    if store is not None:
        write_exit(store, task_id, Outcome("stopped", str(fault), ExitCode.STORAGE))
    say(f"agentd worker: task {task_id} stopped: {fault}")
    return ExitCode.STORAGE


def stopped_for_resources(store: TaskStore | None, task_id: str, why: str) -> int:
    """The worker's last words when the machine refused it a process, a thread or memory
    (best effort, as on a storage fault)."""
    if store is not None:
        with contextlib.suppress(Exception):  # (its own write may be refused as well)
            write_exit(store, task_id, Outcome("stopped", why, ExitCode.RESOURCES))
    say(f"agentd worker: task {task_id} stopped: {why}")
    return ExitCode.RESOURCES


def storage_exit(
    store: TaskStore, task_id: str, fault: StorageError, output: BoundedOutput | None
) -> None:
    """End the worker at once with the storage code, from the heartbeat's thread: beats
    that cannot be written would soon look like a hang. Like a kill, this loses nothing
    recorded (what was written is in the page cache); unlike a kill, it is not a crash."""
    code = stopped_by_storage(store, task_id, fault)
    if output is not None:
        output.close()
    os._exit(code)


def process_main() -> int:
    """``python -m worker``: ``main`` in a process of its own, once its secrets are held."""
    try:
        credentials.take_over()
    except ConfigError as exc:
        print(f"agentd worker: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    return main()


if __name__ == "__main__":
    sys.exit(process_main())
