"""Helpers shared by the test suite: tasks, workers, journals and deadline polling.

Nothing here sleeps without a deadline: ``poll_for`` is the one way to wait for
something to happen, and it fails the test (with a message) when it does not.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import signal
import subprocess
import sys
import time
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import psutil
import pytest

from supervisor.submit import create_task, submit
from worker.config import Config
from worker.loop import AgentLoop
from worker.models.base import JSON, Model, ModelReply, ModelRequest
from worker.models.scripted import ScriptedModel
from worker.records import SHAPES, RecordKind
from worker.spool import Spool, TaskDir, TaskSpec
from worker.state import TaskState
from worker.store.files import FileStore
from worker.store.journal import read_file
from worker.tools.registry import Effect, ToolContext, ToolRegistry, tool

#: The repository root: the working folder of worker subprocesses, so that
#: ``python -m worker`` and ``tests.tools_fixture`` import from this checkout.
REPO = Path(__file__).resolve().parent.parent

T = TypeVar("T")


def missing_system_tool(why: str) -> NoReturn:
    """A system tool a test drives is not installed (``.ci/system-tools`` lists them): the
    test skips when the run was told to go without (``AGENTD_TEST_SYSTEM=skip``, never
    under ``CI=true``), and fails otherwise, saying ``why``."""
    if os.environ.get("AGENTD_TEST_SYSTEM") == "skip" and os.environ.get("CI") != "true":
        pytest.skip(why)
    pytest.fail(why)


# -- waiting --------------------------------------------------------------------------


def poll_for(
    predicate: Callable[[], T | None],
    timeout: float = 30.0,
    *,
    interval: float = 0.01,
    what: str | None = None,
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that (never None);
    fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"timed out after {timeout:g} s waiting for {name}")
        time.sleep(interval)


# -- tasks ----------------------------------------------------------------------------


def make_spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "spool").ensure()


def _script_file(spool: Spool, responses: list[JSON]) -> Path:
    path = spool.root.parent / f"script-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps({"responses": responses}))
    return path


def scripted_task(
    spool: Spool,
    responses: list[JSON],
    *,
    prompt: str = "Do the task.",
    config: Config | None = None,
    **kwargs: Any,
) -> TaskDir:
    """Submit a task on the scripted model, the way ``agentd submit --script`` does."""
    script = _script_file(spool, responses)
    try:
        return submit(spool, config or Config(), prompt=prompt, script=script, **kwargs)
    finally:
        script.unlink()


def git(cwd: Path, *args: str) -> str:
    """``git ARGS`` in ``cwd`` as a user runs it (with a name to commit under); its output."""
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def make_repo(path: Path) -> Path:
    """A real repository at ``path`` with one commit of ``a.txt`` ("committed")."""
    path.mkdir(parents=True)
    git(path, "init", "-q")
    (path / "a.txt").write_text("committed")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "init")
    return path


def spec_task(spool: Spool, responses: list[JSON], **fields: Any) -> TaskDir:
    """A scripted task with spec fields ``submit`` does not take (``max_tokens``...)."""
    fields.setdefault("id", f"t-{uuid.uuid4().hex[:8]}")
    fields.setdefault("prompt", "Do the task.")
    spec = TaskSpec(scripted=True, **fields)
    return create_task(spool, spec, json.dumps({"responses": responses}).encode())


def text(value: str) -> JSON:
    return {"type": "text", "text": value}


def tool_use(name: str, call_id: str | None = None, **inputs: Any) -> JSON:
    block: JSON = {"type": "tool_use", "name": name, "input": inputs}
    if call_id is not None:
        block["id"] = call_id
    return block


def reply(*blocks: JSON, **fields: Any) -> JSON:
    """One scripted response."""
    return {"content": list(blocks), **fields}


# -- journals and transcripts -----------------------------------------------------------


def journal_records(task: TaskDir, *, shaped: bool = True) -> list[JSON]:
    """Every whole record of the task's journal (read-only; a torn tail is left alone);
    none while the journal does not exist yet. Each is checked against its kind's shape
    (``worker.records``: ``misshapen``) unless ``shaped`` is False (a test's own records)."""
    try:
        records = [record for record, _ in read_file(task.journal).records]
    except FileNotFoundError:
        return []
    if shaped:
        assert misshapen(records) == [], f"records of task {task.id} not of their kind's shape"
    return records


def misshapen(records: Iterable[JSON]) -> list[str]:
    """What is wrong with each record that is not of its kind's shape (``worker.records``):
    a kind that is not one, a field missing, one no shape names (``at`` aside: what
    appends a record stamps it), a value of another type."""
    wrong: list[str] = []
    for record in records:
        kind = record.get("k")
        if kind not in set(RecordKind):
            wrong.append(f"{kind!r} is no record kind: {record}")
            continue
        wrong += [f"{kind}: {e}" for e in shape_errors(record, SHAPES[RecordKind(kind)], {"at"})]
    return wrong


@functools.cache
def _fields(shape: Any) -> dict[str, Any]:
    """The fields of a TypedDict, read once (a test polls a growing journal)."""
    return typing.get_type_hints(shape, include_extras=True)


def shape_errors(
    value: Any, hint: Any, stamps: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """Why ``value`` (parsed JSON) is not of type ``hint`` (a TypedDict of ``worker.records``,
    or what its fields are typed with), or nothing. ``stamps``: keys any record may carry."""
    origin = typing.get_origin(hint)
    if typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{value!r} is not an object"]
        # (read with include_extras: on Python 3.11 under ``from __future__ import
        # annotations``, ``__required_keys__`` counts a NotRequired field as required)
        fields = _fields(hint)
        errors = [
            f"{key!r} is no field of it" for key in value if key not in fields and key not in stamps
        ]
        for key, declared in fields.items():
            optional = typing.get_origin(declared) is typing.NotRequired
            if key not in value:
                errors += [] if optional else [f"{key!r} is missing"]
            else:
                field = typing.get_args(declared)[0] if optional else declared
                errors += [f"{key}: {e}" for e in shape_errors(value[key], field)]
        return errors
    if origin is typing.Literal:
        return (
            [] if value in typing.get_args(hint) else [f"{value!r} is not {typing.get_args(hint)}"]
        )
    if origin in (typing.Union, types.UnionType):
        ways = [shape_errors(value, arm) for arm in typing.get_args(hint)]
        return [] if [] in ways else [f"{value!r} is none of {hint}"]
    if hint is Any:
        return []
    if hint is type(None):
        return [] if value is None else [f"{value!r} is not null"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{value!r} is not a list"]
        return [e for item in value for e in shape_errors(item, typing.get_args(hint)[0])]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{value!r} is not an object"]
        return [e for item in value.values() for e in shape_errors(item, typing.get_args(hint)[1])]
    if isinstance(hint, type) and issubclass(hint, str):  # str, and StrEnums by their values
        ok = isinstance(value, str) and (hint is str or value in {str(m) for m in hint})  # type: ignore[attr-defined]
        return [] if ok else [f"{value!r} is not a {hint.__name__}"]
    if hint is int:
        return (
            []
            if isinstance(value, int) and not isinstance(value, bool)
            else [f"{value!r} is not an int"]
        )
    if hint is bool:
        return [] if isinstance(value, bool) else [f"{value!r} is not a bool"]
    raise TypeError(f"no check for {hint!r}")


def of_kind(records: Iterable[JSON], kind: str) -> list[JSON]:
    return [r for r in records if r.get("k") == kind]


def assert_paired(
    messages: list[JSON], *, alternating: bool = True, allow_pending: bool = False
) -> None:
    """Invariant 3: each tool_use is answered by exactly one tool_result, in order, at the
    start of the next user message, and no tool_result answers anything else.

    ``alternating`` also requires user and assistant messages to alternate;
    ``allow_pending`` accepts a last assistant message whose calls are not answered yet
    (the scene of a worker that stopped between a turn and its results)."""
    assert messages, "an empty transcript"
    assert messages[0]["role"] == "user", "a transcript starts with a user message"
    for i, message in enumerate(messages):
        if alternating and i:
            assert message["role"] != messages[i - 1]["role"], f"two {message['role']}s at {i}"
        blocks = message["content"]
        results = [b for b in blocks if b.get("type") == "tool_result"]
        if message["role"] == "assistant":
            assert not results, f"a tool_result in assistant message {i}"
            continue
        uses: list[str] = []
        if i and messages[i - 1]["role"] == "assistant":
            uses = [b["id"] for b in messages[i - 1]["content"] if b.get("type") == "tool_use"]
        assert [b["tool_use_id"] for b in results] == uses, f"user message {i}: {blocks}"
        assert blocks[: len(results)] == results, f"tool_results first in user message {i}"
    last = messages[-1]
    if (
        not allow_pending
        and last["role"] == "assistant"
        and any(b.get("type") == "tool_use" for b in last["content"])
    ):
        raise AssertionError("the transcript ends with unanswered tool_use blocks")


def scene(state: TaskState) -> JSON:
    """What a snapshot of ``state`` holds, for comparing two states exactly."""
    data: JSON = json.loads(json.dumps(state.to_snapshot(0)))
    return data


def tool_results(messages: list[JSON]) -> dict[str, JSON]:
    """Every tool_result block of a transcript, by tool_use id."""
    return {
        b["tool_use_id"]: b
        for m in messages
        if m["role"] == "user"
        for b in m["content"]
        if b.get("type") == "tool_result"
    }


# -- in-process loops -----------------------------------------------------------------


class RecordingModel:
    """A model wrapper that keeps a copy of every transcript it was sent."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner
        self.requests: list[list[JSON]] = []

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        self.requests.append(copy.deepcopy(list(request.messages)))
        return self.inner.complete(request, turn_index=turn_index)

    def close(self) -> None:
        self.inner.close()


def make_loop(
    task: TaskDir,
    *,
    config: Config | None = None,
    tools: ToolRegistry | None = None,
    model: Model | None = None,
    **kwargs: Any,
) -> AgentLoop:
    """An ``AgentLoop`` set up the way ``python -m worker`` sets it up (no heartbeat)."""
    config = config or Config()
    spec = task.load_spec()
    if tools is None:
        tools = ToolRegistry.standard(config.tools.modules).narrowed(spec.tools)
    workspace = task.workspace_for(spec)
    workspace.mkdir(mode=0o700, parents=True, exist_ok=True)
    model = model or RecordingModel(ScriptedModel.from_file(task.script))
    return AgentLoop(
        FileStore(task.root),
        spec,
        config,
        model,
        tools,
        workspace=workspace,
        spool=task.root,
        **kwargs,
    )


# -- worker processes -----------------------------------------------------------------


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line holds ``marker`` (a sleep of an unusual length).

    Found by name, not by a pid the command writes down: in a sandbox, that pid is one of
    its own PID namespace, and means another process out here."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and marker in " ".join(proc.cmdline()):
                found.append(proc)
    return found


def unique_sleep() -> str:
    """A sleep duration no other process on the machine is likely to have."""
    return f"30.{os.getpid()}{time.monotonic_ns() % 1_000_000}"


def kill_processes_with(marker: str) -> None:
    for proc in processes_with(marker):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def start_worker(
    task: TaskDir, *, env: Mapping[str, str] | None = None, args: Iterable[str] = ()
) -> subprocess.Popen[str]:
    """``python -m worker TASK_DIR`` in its own session (the way the supervisor starts it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "worker", str(task.path), *args],
        cwd=REPO,
        env=worker_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, str]:
    """Wait for a worker (killing its group if it overruns); its exit code and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        raise AssertionError(f"worker {proc.pid} ran past {timeout:g} s") from None
    return proc.returncode, err


def kill_group(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def reap(proc: subprocess.Popen[str]) -> None:
    """Make sure a worker and its group are gone and its pipes closed (for ``finally``)."""
    kill_group(proc)
    proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()


def run_worker(
    task: TaskDir, timeout: float = 30.0, *, env: Mapping[str, str] | None = None
) -> int:
    """Run a worker on ``task`` to its end; its exit code."""
    return finish(start_worker(task, env=env), timeout)[0]


def charge_crashing_once() -> ToolRegistry:
    """The standard tools and an unsafe ``charge`` whose first run kills its worker
    between the effect and its result (a ``KeyboardInterrupt`` out of the loop), so the
    call is left dangling: the next run holds the task; later runs charge."""
    crashes = {"left": 1}

    @tool(effect=Effect.UNSAFE)
    def charge(ctx: ToolContext, amount: int) -> str:
        """Charge a card."""
        if crashes["left"]:
            crashes["left"] -= 1
            raise KeyboardInterrupt
        return f"charged {amount}"

    return ToolRegistry([*ToolRegistry.standard(), charge])


def run_to_end(task: TaskDir, **kwargs: Any) -> str:
    """Run ``task``'s loop in this process (``make_loop``'s options) until it stops; its
    state then."""
    loop = make_loop(task, **kwargs)
    try:
        return loop.run().state
    finally:
        loop.close()


# -- a real terminal ------------------------------------------------------------------


class Terminal:
    """A real terminal: ``command`` run by a tmux server of its own (its own socket), in a
    window ``width`` x ``height``. ``screen`` reads what it shows, ``keys`` types, and
    ``close`` ends the server and everything in it."""

    def __init__(
        self, command: str, env: Mapping[str, str], *, width: int = 120, height: int = 30
    ) -> None:
        self.socket = f"agentd-test-{uuid.uuid4().hex[:8]}"
        self.env = {k: v for k, v in env.items() if k != "TMUX"}
        self.tmux("new-session", "-d", "-x", str(width), "-y", str(height), "-s", "t", command)

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], env=self.env, check=False)


#: The fields of a row of `agentd dangling --json` (docs/design.md section 3; docs/guides/tools.md).
DANGLING_FIELDS = {
    "task",
    "call_id",
    "tool",
    "input",
    "effect",
    "idempotency_key",
    "started_at",
    "stage",
    "attempt",
    "input_sha256",
}
