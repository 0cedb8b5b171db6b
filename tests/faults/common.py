"""The harness the fault modules share: tasks, worker processes under strace, a careful
operator, and the checks of docs/design.md section 6 on a task after a fault.

Every task here runs on the scripted model with the built-in tools. Its side effects land
in its workspace, where the operator (and the checks) can see them: ``append_file`` lines
are unique, so a line found twice is an unsafe effect repeated; ``outbox_send`` delivers
one file per idempotency key, so a body found twice is a keyed effect repeated.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

from supervisor.decisions import decide
from supervisor.status import held_calls
from tests.support import (
    REPO,
    assert_paired,
    make_loop,
    reply,
    scripted_task,
    text,
    tool_use,
    worker_env,
)
from worker.errors import AgentdError
from worker.protocol import ExitCode
from worker.spool import Spool, TaskDir
from worker.state import TaskState
from worker.store.journal import Journal, read_file, scan

JSON = dict[str, Any]
T = TypeVar("T")
R = TypeVar("R")

TASK_ID = "t1"

#: Environment of every worker run here: no bytecode written on import and a fixed hash
#: seed, so the syscalls of two runs of the same task line up one for one.
STABLE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}

STRACE = shutil.which("strace")
STRACE_MISSING = (
    "strace is not installed: the crash-point and I/O-error campaigns inject their faults "
    "with it. Install it (apt-get install -y strace) and run again."
)


class StraceMissingError(RuntimeError):
    pass


def require_strace() -> str:
    if STRACE is None:
        raise StraceMissingError(STRACE_MISSING)
    return STRACE


# -- tasks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A scripted task and what its workspace must hold once it is done."""

    responses: list[JSON]
    files: dict[str, str]  # idempotent: path -> final content
    appends: dict[str, list[str]]  # unsafe: path -> unique lines, each exactly once
    outbox: list[str]  # keyed: bodies, each delivered exactly once

    @property
    def turns(self) -> int:
        return len(self.responses)


def mixed_plan(turns: int) -> Plan:
    """A task of ``turns`` turns (3 at least) mixing write_file, append_file and
    outbox_send; the last turn ends it."""
    responses: list[JSON] = []
    files: dict[str, str] = {}
    appends: dict[str, list[str]] = {"log.txt": []}
    outbox: list[str] = []
    for t in range(1, turns):
        kind = t % 3
        if kind == 1:
            files[f"f{t}.txt"] = f"content {t}"
            line = f"line {t}\n"
            appends["log.txt"].append(line)
            responses.append(
                reply(
                    text(f"Turn {t}: a file and a log line."),
                    tool_use("write_file", path=f"f{t}.txt", content=f"content {t}"),
                    tool_use("append_file", path="log.txt", content=line),
                )
            )
        elif kind == 2:
            body = f"message {t}"
            outbox.append(body)
            responses.append(reply(tool_use("outbox_send", to="ops", body=body)))
        else:
            line = f"line {t}\n"
            appends["log.txt"].append(line)
            body = f"message {t}"
            outbox.append(body)
            responses.append(
                reply(
                    tool_use("append_file", path="log.txt", content=line),
                    tool_use("outbox_send", to="ops", body=body),
                )
            )
    responses.append(reply(text("All done.")))
    # usage as written: the campaigns compare counters across clones of a task in other
    # folders, whose requests (paths in results) differ in size
    for t, response in enumerate(responses, start=1):
        response["usage"] = {"input_tokens": 10 + 5 * t, "output_tokens": 5}
    return Plan(responses, files, appends, outbox)


def make_task(root: Path, plan: Plan, *, task_id: str = TASK_ID) -> TaskDir:
    """A queued scripted task in a fresh spool under ``root``."""
    spool = Spool(root / "spool").ensure()
    return scripted_task(spool, plan.responses, name=task_id)


def clone_task(task: TaskDir, root: Path) -> TaskDir:
    """A copy of ``task``'s whole spool under ``root`` (symlinks copied as symlinks)."""
    shutil.copytree(task.root, root / "spool", symlinks=True)
    return TaskDir(root / "spool", task.id)


# -- worker processes -------------------------------------------------------------------


@dataclass(frozen=True)
class Exit:
    code: int
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_worker(
    task: TaskDir,
    *,
    prefix: Sequence[str] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    module: str = "worker",
) -> Exit:
    """``python -m worker TASK_DIR`` (behind ``prefix``, e.g. strace; or another
    ``module`` that runs it) in its own session; its exit code (negative: the signal) and
    stderr. The group is killed on a timeout."""
    return run_module(module, [str(task.path)], prefix=prefix, timeout=timeout, env=env)


def run_cli(
    spool_root: Path,
    *args: str,
    prefix: Sequence[str] = (),
    timeout: float = 60.0,
) -> Exit:
    """``agentd --spool SPOOL ARGS...`` (``python -m supervisor``), like ``run_worker``."""
    argv = ["--spool", str(spool_root), *args]
    return run_module("supervisor", argv, prefix=prefix, timeout=timeout)


def run_module(
    module: str,
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Exit:
    """``python -m MODULE ARGS...`` behind ``prefix``, in its own session: its exit code
    (negative: the signal; -999: it ran past ``timeout`` and its group was killed) and
    stderr."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *args],
        cwd=REPO,
        env=worker_env({**STABLE_ENV, **(env or {})}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Exit(-999, f"python -m {module} ran past {timeout:g} s")
    finally:
        with contextlib.suppress(ProcessLookupError):  # a tracee strace left behind
            os.killpg(proc.pid, signal.SIGKILL)
    return Exit(proc.returncode, err)


def strace_prefix(
    log: Path,
    trace: Iterable[str],
    *,
    inject: Iterable[str] = (),
    paths: Iterable[Path] = (),
) -> list[str]:
    """strace of the worker's main thread only (no -f: the heartbeat thread and child
    processes are neither traced nor counted), fds shown with their paths (-y)."""
    cmd = [require_strace(), "-qq", "-y", "-e", "signal=none", "-o", str(log)]
    cmd += ["-e", "trace=" + ",".join(trace)]
    for path in paths:
        cmd += ["-P", str(path)]
    for spec in inject:
        cmd += ["-e", f"inject={spec}"]
    return cmd


# -- strace logs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Syscall:
    name: str
    index: int  # 1-based among the calls of this name in the log: strace's when=N
    fd: int | None  # the first argument when it is a descriptor
    paths: tuple[str, ...]  # every path the call names (fds resolved by -y)
    ret: str  # "0", "-1", "?" (the process died in it)...
    errno: str | None
    injected: bool
    text: str

    @property
    def failed(self) -> bool:
        return self.ret == "-1"

    def touches(self, prefix: str) -> bool:
        return any(p == prefix or p.startswith(prefix + "/") for p in self.paths)


_CALL = re.compile(r"^(?P<name>[a-z_0-9]+)\((?P<rest>.*)$")
_FD = re.compile(r"^(\d+)<([^>]*)>")
_FDPATH = re.compile(r"\d+<(/[^>]*)>")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_RESULT = re.compile(
    r"\)\s+=\s+(?P<ret>-?\d+|\?|0x[0-9a-f]+)(?:<[^>]*>)?(?:\s+(?P<errno>E[A-Z0-9]+))?"
)


def parse_log(log: Path) -> list[Syscall]:
    calls: list[Syscall] = []
    counts: dict[str, int] = {}
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        m = _CALL.match(line)
        if not m:
            continue
        name, rest = m.group("name"), m.group("rest")
        counts[name] = counts.get(name, 0) + 1
        fd_match = _FD.match(rest)
        paths = [p for p in _FDPATH.findall(rest)]
        paths += [s for s in _STRING.findall(rest) if s.startswith("/")]
        result = _RESULT.search(rest)
        calls.append(
            Syscall(
                name=name,
                index=counts[name],
                fd=int(fd_match.group(1)) if fd_match else None,
                paths=tuple(paths),
                ret=result.group("ret") if result else "?",
                errno=result.group("errno") if result else None,
                injected="(INJECTED)" in line,
                text=line,
            )
        )
    return calls


def fsync_retries(calls: Sequence[Syscall]) -> list[str]:
    """fsync/fdatasync calls that follow a failed one on the same open file (same fd and
    path, no close between): a sync retried on data it failed to write."""
    failed: dict[tuple[int, str], str] = {}
    found: list[str] = []
    for call in calls:
        if call.fd is None or not call.paths:
            continue
        key = (call.fd, call.paths[0])
        if call.name == "close":
            failed.pop(key, None)
        elif call.name in ("fsync", "fdatasync"):
            if key in failed:
                found.append(f"{call.text.strip()[:160]} after {failed[key][:160]}")
            elif call.failed:
                failed[key] = call.text.strip()
    return found


def appends_after_failure(calls: Sequence[Syscall], journal: Path) -> list[str]:
    """Writes or syncs of the journal after one of them failed (the journal must refuse)."""
    broken: str | None = None
    found: list[str] = []
    for call in calls:
        if call.name not in ("write", "fdatasync", "fsync") or str(journal) not in call.paths:
            continue
        if broken is not None:
            found.append(f"{call.text.strip()[:160]} after {broken[:160]}")
        elif call.failed:
            broken = call.text.strip()
    return found


# -- background syncs (tests.faults.sync_shim) --------------------------------------------

SHIM = "tests.faults.sync_shim"


@dataclass(frozen=True)
class ShimCall:
    thread: str
    name: str  # fdatasync or write
    path: str
    failed: bool
    injected: bool


def run_shimmed(task: TaskDir, spec: str, log: Path) -> Exit:
    """The worker with a fault on its background journal syncs (see ``sync_shim``)."""
    return run_worker(task, module=SHIM, env={"FAULTS_BG_SYNC": spec, "FAULTS_BG_LOG": str(log)})


def parse_shim_log(log: Path) -> list[ShimCall]:
    calls = []
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                calls.append(
                    ShimCall(parts[0], parts[1], parts[2], parts[3] == "-1", "(INJECTED)" in line)
                )
    return calls


def background_syncs(task: TaskDir, root: Path) -> int:
    """How many background journal syncs a clean run of (a copy of) ``task`` makes."""
    clean = clone_task(task, root)
    log = root / "shim.log"
    if run_shimmed(clean, "", log).code != ExitCode.DONE:
        raise RuntimeError("the clean run under the sync shim failed")
    return sum(1 for c in parse_shim_log(log) if c.thread == "journal-sync")


def shim_retries(calls: Sequence[ShimCall]) -> list[str]:
    """Syncs of a file after a sync of it failed, and journal writes after that."""
    failed: set[str] = set()
    found = []
    for call in calls:
        if call.path in failed:
            found.append(f"{call.thread} {call.name} {call.path} after a failed sync")
        elif call.name == "fdatasync" and call.failed:
            failed.add(call.path)
    return found


# -- the careful operator ---------------------------------------------------------------


def careful_decisions(task: TaskDir) -> int:
    """Decide every held call of ``task`` the way a careful operator does: look at the
    outside record of the effect (the workspace) and supply the outcome it shows, or re-run
    a call that shows no effect. Returns the number of decisions."""
    spec = task.load_spec()
    workspace = task.workspace_for(spec)
    made = 0
    for row in held_calls(task):
        data = row["input"] if isinstance(row["input"], dict) else {}
        if row["tool"] == "append_file":
            content = str(data.get("content", ""))
            target = workspace / str(data.get("path", ""))
            try:
                present = content in target.read_text()
            except OSError:
                present = False
            if present:
                decide(
                    task,
                    row["call_id"],
                    action="result",
                    result=f"appended {len(content.encode())} bytes to {data.get('path')} "
                    "(checked by the operator)",
                )
            else:
                decide(task, row["call_id"], action="rerun")
        else:
            decide(task, row["call_id"], action="skip", reason="cannot tell; not re-run")
        made += 1
    return made


@dataclass
class Drive:
    exits: list[Exit] = field(default_factory=list)
    decisions: int = 0

    @property
    def code(self) -> int:
        return self.exits[-1].code if self.exits else -1


def drive(
    task: TaskDir, *, max_runs: int = 8, timeout: float = 60.0, first: Exit | None = None
) -> Drive:
    """Run the worker (no fault) until the task ends, deciding holds carefully.
    ``first``: the exit of a run already made (a done task is not run again)."""
    result = Drive()
    for _ in range(max_runs):
        done, first = first or run_worker(task, timeout=timeout), None
        result.exits.append(done)
        if done.code != ExitCode.HELD:
            break
        made = careful_decisions(task)
        result.decisions += made
        if not made:
            break
    return result


# -- states a kill leaves -------------------------------------------------------------------


class _Crash(BaseException):
    """Stops an in-process loop right before a journal append, as a kill would."""


def stop_before_record(task: TaskDir, index: int) -> None:
    """Run ``task`` in-process and stop it right before its ``index``-th journal record
    (counting the header) reaches the file: the task folder is left as a kill there
    leaves it. Records that share one write (a turn and its first intent) are split at
    the frame boundary, as a torn write can split them."""
    original = Journal._write
    written = 0

    def write(self: Journal, data: bytes) -> None:
        nonlocal written
        ends = [end for _, end in scan(data).records]
        if written + len(ends) <= index:
            written += len(ends)
            return original(self, data)
        keep = index - written
        if keep:
            original(self, data[: ends[keep - 1]])
        written = index
        raise _Crash

    created = Journal._create.__func__  # type: ignore[attr-defined]

    def create(cls: type[Journal], path: Path, header: JSON) -> tuple[Journal, list[JSON]]:
        nonlocal written
        if index == 0:  # the header is written whole, or not at all
            raise _Crash
        written += 1
        made: tuple[Journal, list[JSON]] = created(cls, path, header)
        return made

    loop = make_loop(task)
    try:
        with (
            mock.patch.object(Journal, "_write", write),
            mock.patch.object(Journal, "_create", classmethod(create)),
        ):
            loop.run()
    except _Crash:
        pass
    finally:
        loop.close()


# -- what a power loss leaves ------------------------------------------------------------

#: The unit the kernel writes back: each page of a file is persisted, or not, on its own.
PAGE = 4096


class Fate(enum.Enum):
    """What a power loss did to one page written since the file's last sync."""

    KEEP = "keep"  # written back before the power went
    ZERO = "zero"  # its blocks were allocated but never written: it reads as zeros
    DROP = (
        "drop"  # never reached the disk: the file ends before it (a hole if a later page made it)
    )


def unsynced_pages(size: int, synced: int) -> range:
    """The pages of a file of ``size`` bytes that hold bytes written after ``synced``."""
    return range(synced // PAGE, -(-size // PAGE)) if size > synced else range(0)


def after_power_loss(data: bytes, synced: int, fates: Sequence[Fate]) -> bytes:
    """The file a power loss may leave of ``data``, whose first ``synced`` bytes had been
    made durable: those are kept, and each later page meets its fate in ``fates`` (one per
    page of ``unsynced_pages``), independently of the others."""
    pages = unsynced_pages(len(data), synced)
    if len(fates) != len(pages):
        raise ValueError(f"{len(pages)} unsynced pages, {len(fates)} fates")
    out = bytearray(data)
    size = synced
    for page, fate in zip(pages, fates, strict=True):
        lo, hi = max(synced, page * PAGE), min(len(data), (page + 1) * PAGE)
        if fate is not Fate.KEEP:
            out[lo:hi] = bytes(hi - lo)
        if fate is not Fate.DROP:
            size = hi
    return bytes(out[:size])


# -- checks -------------------------------------------------------------------------------


def records(task: TaskDir) -> list[JSON]:
    """The whole records of the journal as it is (a torn tail is left out, not cut)."""
    try:
        return [record for record, _ in read_file(task.journal).records]
    except FileNotFoundError:
        return []


def final_state(task: TaskDir) -> TaskState:
    state = TaskState(task.load_spec().prompt)
    for record in records(task):
        state.apply(record)
    return state


def strip_times(items: Iterable[JSON]) -> list[JSON]:
    return [{k: v for k, v in r.items() if k != "at"} for r in items]


def outbox_bodies(workspace: Path) -> list[str]:
    bodies = []
    for entry in sorted((workspace / "outbox").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            bodies.append(str(json.loads(entry.read_text()).get("body")))
    return bodies


#: Problem kinds reported by ``check_task`` (each one a violation figure).
LOST = "records lost or changed"
UNREADABLE = "journal unreadable after the fault"
UNPAIRED = "tool_use not paired"
UNSAFE_TWICE = "unsafe effect repeated"
KEYED_TWICE = "keyed effect repeated"
NOT_DONE = "task not completed"
WRONG_STATE = "effects missing or wrong"
PROBLEMS = (LOST, UNREADABLE, UNPAIRED, UNSAFE_TWICE, KEYED_TWICE, NOT_DONE, WRONG_STATE)


def check_task(
    task: TaskDir, plan: Plan, before: Sequence[JSON], *, exact: bool = True
) -> list[tuple[str, str]]:
    """The invariants after a fault and the resume that followed it, as (kind, detail)
    problems. ``before``: the records the journal held right after the fault. ``exact``:
    every effect must have happened exactly once (False: at most once, for faults that
    make tools fail)."""
    problems: list[tuple[str, str]] = []
    try:
        after = records(task)
        scan_end = read_file(task.journal)
    except (OSError, AgentdError) as exc:
        return [(UNREADABLE, f"final journal: {exc}")]
    if scan_end.torn:
        problems.append((UNREADABLE, "the final journal has a torn tail"))
    if after[: len(before)] != list(before):
        at = next(
            (i for i, (a, b) in enumerate(zip(after, before, strict=False)) if a != b),
            len(after),
        )
        problems.append((LOST, f"record {at} of {len(before)} recorded before is gone or changed"))
    state = final_state(task)
    try:
        assert_paired(state.messages)
    except AssertionError as exc:
        problems.append((UNPAIRED, str(exc)[:200]))
    ended = state.ended or {}
    if (
        ended.get("state") != "done"
        or ended.get("reason") != "end_turn"
        or (state.turn != plan.turns)
    ):
        problems.append((NOT_DONE, f"ended {ended or None} at turn {state.turn}/{plan.turns}"))
    return problems + effect_problems(task.workspace_for(task.load_spec()), plan, exact=exact)


def effect_problems(workspace: Path, plan: Plan, *, exact: bool = True) -> list[tuple[str, str]]:
    """What ``workspace`` holds against ``plan``: every unsafe and keyed effect at most
    once, and with ``exact`` exactly once, the files as the plan leaves them."""
    problems: list[tuple[str, str]] = []
    for path, lines in plan.appends.items():
        try:
            body = (workspace / path).read_text()
        except OSError:
            body = ""
        for line in lines:
            n = body.count(line)
            if n > 1:
                problems.append((UNSAFE_TWICE, f"{line.strip()!r} appended {n} times"))
            elif n == 0 and exact:
                problems.append((WRONG_STATE, f"{line.strip()!r} never appended"))
    bodies = outbox_bodies(workspace)
    for body in plan.outbox:
        n = bodies.count(body)
        if n > 1:
            problems.append((KEYED_TWICE, f"{body!r} delivered {n} times"))
        elif n == 0 and exact:
            problems.append((WRONG_STATE, f"{body!r} never delivered"))
    if exact:
        for path, content in plan.files.items():
            try:
                found = (workspace / path).read_text()
            except OSError:
                found = None
            if found != content:
                problems.append((WRONG_STATE, f"{path} holds {found!r}, not {content!r}"))
    return problems


def reap_spool(spool_root: Path, grace: float = 10.0) -> int:
    """Wait up to ``grace`` seconds for every process running on ``spool_root`` to end
    (`agentd stop` returns once the daemon let go of its lock, a moment before its process
    exits), then SIGKILL what is left: a daemon whose stop failed, its workers. They are
    found by that path on their command line, a temporary folder of this campaign.
    Returns how many had to be killed."""
    import psutil

    needle = str(spool_root)

    def left() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if any(needle in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        return found

    deadline = time.monotonic() + grace
    while (procs := left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(procs)


# -- running many cases ------------------------------------------------------------------


def parallel(items: Sequence[T], fn: Callable[[T], R], workers: int | None = None) -> list[R]:
    """``fn`` over ``items`` on a few threads (each case is a subprocess or two)."""
    workers = workers or 2 * (os.cpu_count() or 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


@contextlib.contextmanager
def stopwatch() -> Iterator[Callable[[], float]]:
    start = time.monotonic()
    yield lambda: time.monotonic() - start


def one_line(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in text
