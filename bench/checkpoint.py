"""Checkpoint benchmark: what it costs agentd to make each turn durable, side by side with
the floor and with LangGraph's ``SqliteSaver``.

The workload is one tool turn per step with about 2 KB of new messages: an assistant
reply of ~1 KB of text plus one ``tool_use``, then a ~1 KB tool result.

* **agentd** runs the real worker path: a task made by ``supervisor.submit.create_task``,
  ``AgentLoop`` with the ``ScriptedModel`` reading the task's script, a trivial read-only
  tool and a ``Heartbeat``, exactly as ``python -m worker`` sets them up; the model
  answers after 2 ms. A subclass only adds clocks around ``Recorder.record`` (stamp,
  ``Journal.append`` with its write, fdatasync or wait for a background sync, fold,
  heartbeat), ``Journal.sync_in_background`` and ``Recorder.maybe_snapshot`` (journal sync and
  ``atomic_write_json`` of the folded state). A turn's cost is the time the loop spent
  on its records (``turn``, ``intent``, ``result``), and on the snapshot when one falls
  on that turn; a sync running in the background while the model thinks is not waited
  for, so it is counted (as a background fdatasync) but not timed. The workspace is not a
  git repository, so no turn takes a ``vcs`` capture of the files (that is version
  control's cost, not the journal's; it would count here as a ``vcs`` record if it ran).
* **floor**: the same bytes agentd appended for that turn, appended to a plain file as
  one write and one fdatasync per turn, interleaved with the agentd run in blocks of 25
  turns so that both see the same load when the machine is shared.
* **LangGraph**: a ``StateGraph`` with ``messages: Annotated[list, add_messages]``
  compiled with ``SqliteSaver``, run with ``durability="sync"``; one super-step per
  turn adds the same two messages (AI message with a tool call, tool message). A step's
  cost is the time from its node starting to the next node starting: the reducer, the
  checkpoint and its writes, all persisted before the next step may run.

Costs are medians (and p99) over a window of +-50 turns around each reported turn.
Resume is the time from a task folder with N turns to a state ready for the next model
call (``AgentLoop(...).open()``) against ``graph.get_state(config)``, each timed in fresh
processes (a restarted worker), alternating, warm page cache. One LangGraph super-step per
turn is the cheapest way to run this workload on it (a tool-calling agent graph takes
two); it is still measured with ``durability="sync"``, as asked.

Set ``AGENTD_BENCH_DIR`` to measure on another file system. Timings on a shared machine
are noisy: the load average and I/O pressure are printed before and after.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import Row, ensure_peers, percentile
from supervisor.submit import create_task
from worker.config import Config, ContextConfig
from worker.heartbeat import Heartbeat
from worker.loop import AgentLoop
from worker.models.base import JSON, Model, ModelReply, ModelRequest
from worker.models.scripted import ScriptedModel
from worker.records import CallOutcome
from worker.records import Record as Written
from worker.spool import Spool, TaskDir, TaskSpec
from worker.state import SNAPSHOT_MAGIC, SNAPSHOT_TRAILER, TaskState
from worker.store.durable import dump_json, load_json
from worker.store.files import FileStore
from worker.store.journal import Journal, Record
from worker.tools.registry import Effect, ToolContext, ToolRegistry, tool
from worker.turns import StopRequested

NAME = "checkpoint"
PEER = "LangGraph"
PEER_MODULES = ("langgraph.graph", "langgraph.checkpoint.sqlite", "langchain_core.messages")
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
REPO = Path(__file__).resolve().parent.parent
PLOT = REPO / "docs" / "bench-checkpoint.png"

TEXT_CHARS = 1000  # assistant text per turn
RESULT_CHARS = 1000  # tool result per turn
WINDOW = 50  # turns either side of a reported turn
FLOOR_BLOCK = 25  # turns of agentd, then the same turns of the floor, and so on
# A real model takes seconds; 2 ms is enough for the journal's background sync (it
# overlaps the model call) to finish first on a quiet disk, as it does in production.
MODEL_LATENCY = 0.002
PROMPT = "Work through the backlog one item at a time; look each item up before acting."

TARGET_COST = 1.5  # x floor, per-turn cost at the target turn
TARGET_FLAT = 1.25  # growth of the per-turn cost from turn 100 to the last reported turn
#: The worker's configuration: the defaults, but a context window no transcript of this
#: workload reaches. The script's usage grows by 600 tokens a turn and never falls, so
#: with the default window the loop would compact at every turn past the 260th; this
#: benchmark measures what checkpointing a growing transcript costs, and compaction has
#: its own (``bench/compaction.py``).
BENCH_CONFIG = Config(context=ContextConfig(window=10**9))

TARGET_BYTES = 2.0  # x message bytes
TARGET_RESUME_MS = 20.0  # at the target turn


@dataclass(frozen=True)
class Plan:
    turns: int  # agentd and floor cost curve: also the biggest resume folder
    peer_steps: int  # LangGraph cost curve
    mid: int  # the turn the targets are stated at (1,000; smaller in quick mode)
    resume: tuple[int, ...]  # resume folders
    rows: tuple[int, ...]  # reported turn numbers
    repeats: int  # resume measurements per folder
    install: bool  # pip-install missing peers
    plot: bool


FULL = Plan(5000, 2000, 1000, (10, 1000, 5000), (1, 100, 1000, 2000, 5000), 9, True, True)
QUICK = Plan(200, 200, 200, (10, 200), (1, 100, 200), 5, False, False)


# -- the workload ---------------------------------------------------------------------

_VOCABULARY = (
    "the agent reads file and then writes a short plan for next step before it calls tool "
    "with path config value result error line test build check update list item order "
    "because this change keeps state in journal so resume is fast after crash or restart"
)
_WORDS = tuple(_VOCABULARY.split())


def prose(seed: int, size: int) -> str:
    """Deterministic English-like text of exactly ``size`` characters."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


def reply_text(k: int) -> str:
    return prose(2 * k, TEXT_CHARS)


def result_text(k: int) -> str:
    return prose(2 * k + 1, RESULT_CHARS)


@tool(effect=Effect.READ_ONLY)
def lookup(ctx: ToolContext, n: int) -> str:
    """Look up backlog item ``n`` (the bench's canned ~1 KB answer)."""
    return result_text(n)


def script(turns: int) -> list[JSON]:
    """Model call k answers with ~1 KB of text and one lookup call."""
    return [
        {
            "content": [
                {"type": "text", "text": reply_text(k)},
                {"type": "tool_use", "name": "lookup", "input": {"n": k}},
            ],
            "usage": {"input_tokens": 1200 + 600 * k, "output_tokens": 350},
        }
        for k in range(turns)
    ]


class StopAt:
    """The task's scripted model, taking ``MODEL_LATENCY`` a call, stopped (as SIGTERM
    stops a worker waiting on the model) at model call ``turns + 1``."""

    def __init__(self, inner: Model, turns: int) -> None:
        self.inner = inner
        self.turns = turns

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        if turn_index >= self.turns:
            raise StopRequested
        time.sleep(MODEL_LATENCY)
        return self.inner.complete(request, turn_index=turn_index)

    def close(self) -> None:
        self.inner.close()


# -- agentd ---------------------------------------------------------------------------


@dataclass
class Clocks:
    """Per turn: nanoseconds spent, fdatasyncs, and the journal size once it is recorded."""

    record: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    append: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    heartbeat: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    snapshot: dict[int, int] = field(default_factory=dict)  # only turns that wrote one
    snapshot_size: dict[int, int] = field(default_factory=dict)
    snapshot_written: dict[int, int] = field(default_factory=dict)  # on its own thread
    syncs: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # the loop waits
    background: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # it doesn't
    background_start: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # ns
    journal_end: dict[int, int] = field(default_factory=dict)
    journal_start: int = 0  # after the header

    def cost_ms(self) -> dict[int, float]:
        return {t: ns / 1e6 for t, ns in sorted(self.record.items()) if t > 0}


class TimedLoop(AgentLoop):
    """``AgentLoop`` with clocks around its durable-record path; nothing else changes.

    Timed: ``Recorder.record`` (stamp, ``Journal.append`` with any wait for a background
    sync, fold, heartbeat), ``Recorder.maybe_snapshot`` (its journal sync and the snapshot
    write) and
    ``Journal.sync_in_background`` (starting the sync that overlaps the model call). A
    journal without deferred syncs simply never calls the last one."""

    def __init__(
        self,
        task: TaskDir,
        spec: TaskSpec,
        *args: Any,
        stop_after_tool: int | None = None,
        floor: Path | None = None,
        **kw: Any,
    ) -> None:
        workspace = task.workspace_for(spec)
        super().__init__(
            FileStore(task.root), spec, *args, workspace=workspace, spool=task.root, **kw
        )
        self.task = task
        self.clocks = Clocks()
        self.stop_after_tool = stop_after_tool
        self.floor = Floor(self.task.journal, floor, self.clocks) if floor else None
        self._in_append = 0
        self._in_heartbeat = 0
        self._syncs = 0
        recorder = self.recorder
        plain_record, plain_snapshot = recorder.record, recorder.maybe_snapshot
        plain_call, plain_run = self.turns.call, self.tool_calls.run

        def record(*records: Written, **kw: Any) -> None:
            self._timed_record(plain_record, *records, **kw)

        def maybe_snapshot() -> None:
            self._timed_snapshot(plain_snapshot)

        def call(tools: ToolRegistry) -> None:
            turn = self.state.turn
            if self.floor is not None and turn and turn % FLOOR_BLOCK == 0:
                self.floor.catch_up(turn)  # while "waiting on the model": off agentd's clocks
            plain_call(tools)

        def run(
            call: Any, *, attempt: int, outcome: CallOutcome = CallOutcome.RAN, ask: bool = False
        ) -> None:
            plain_run(call, attempt=attempt, outcome=outcome, ask=ask)
            if self.stop_after_tool is not None and self.state.turn >= self.stop_after_tool:
                self.stop_requested = True  # SIGTERM during the tool call: stop at a safe point

        recorder.record = record  # type: ignore[method-assign]
        recorder.maybe_snapshot = maybe_snapshot  # type: ignore[method-assign]
        self.turns.call = call  # type: ignore[method-assign]
        self.tool_calls.run = run  # type: ignore[method-assign]

    def open(self) -> TaskState:
        state = super().open()
        journal = self.recorder.writer
        self.clocks.journal_start = journal.cursor.position  # the file store's: an offset
        plain_append = journal.append
        raw = getattr(journal, "journal", journal)  # the file store's Journal under it

        def dirty() -> bool:  # written and not yet synced (True if the journal cannot say)
            return bool(getattr(raw, "_dirty", True))

        def append(records: Iterable[Record], *, sync: bool = True) -> None:
            t0 = time.perf_counter_ns()
            try:
                return plain_append(records, sync=sync)
            finally:
                self._in_append += time.perf_counter_ns() - t0
                self._syncs += sync

        journal.append = append  # type: ignore[method-assign]
        if hasattr(journal, "sync"):
            plain_sync = journal.sync

            def sync() -> None:
                self._syncs += dirty()
                plain_sync()

            journal.sync = sync  # type: ignore[method-assign]
        if hasattr(journal, "sync_in_background"):
            plain_background = journal.sync_in_background

            def background() -> None:
                turn, pending = self.state.turn, dirty()
                t0 = time.perf_counter_ns()
                plain_background()
                if turn > 0:  # the sync of this turn's last records: the turn's cost
                    spent = time.perf_counter_ns() - t0
                    self.clocks.record[turn] += spent
                    self.clocks.background_start[turn] += spent
                    self.clocks.background[turn] += pending

            journal.sync_in_background = background  # type: ignore[method-assign]
        if self.heartbeat is not None:
            plain_update = self.heartbeat.update

            def update(**fields: Any) -> None:
                t0 = time.perf_counter_ns()
                try:
                    plain_update(**fields)
                finally:
                    self._in_heartbeat += time.perf_counter_ns() - t0

            self.heartbeat.update = update  # type: ignore[method-assign]
        return state

    def _timed_record(self, plain: Callable[..., None], *records: Written, **kw: Any) -> None:
        self._in_append = self._in_heartbeat = self._syncs = 0
        t0 = time.perf_counter_ns()
        plain(*records, **kw)
        spent = time.perf_counter_ns() - t0
        if records[0]["k"] not in ("turn", "intent", "result", "vcs"):
            return  # the end record: not part of a turn
        turn = self.state.turn
        clocks = self.clocks
        clocks.record[turn] += spent
        clocks.append[turn] += self._in_append
        clocks.heartbeat[turn] += self._in_heartbeat
        clocks.syncs[turn] += self._syncs
        clocks.journal_end[turn] = self.recorder.writer.cursor.position

    def _timed_snapshot(self, plain: Callable[[], None]) -> None:
        before = self.recorder.snapshot_turn
        self._syncs = 0
        t0 = time.perf_counter_ns()
        plain()
        spent = time.perf_counter_ns() - t0
        turn = self.state.turn
        if turn == 0:
            return
        self.clocks.record[turn] += spent
        self.clocks.syncs[turn] += self._syncs
        if self.recorder.snapshot_turn != before:
            # Written on the snapshot thread, as while the model thinks: its own cost,
            # off the loop's clock, is the wait here (the model of this bench answers
            # at once, so nothing else would overlap it).
            t0 = time.perf_counter_ns()
            size = self.recorder.snapshots.wait()
            self.clocks.snapshot[turn] = spent
            self.clocks.snapshot_written[turn] = time.perf_counter_ns() - t0
            self.clocks.snapshot_size[turn] = size or self.task.snapshot.stat().st_size


def new_task(spool: Spool, name: str, turns: int) -> TaskDir:
    spec = TaskSpec(id=name, prompt=PROMPT, max_turns=turns + 10, scripted=True)
    return create_task(spool, spec, json.dumps({"responses": script(turns)}).encode())


def run_agentd(
    spool: Spool, name: str, turns: int, *, stop_in_tool: bool = False, floor: Path | None = None
) -> TimedLoop:
    """Run a task for ``turns`` turns the way ``python -m worker`` does, then stop it:
    during model call ``turns + 1`` (the usual case: the snapshot is current), or with
    ``stop_in_tool`` during the tool call of turn ``turns`` (before its snapshot)."""
    task = new_task(spool, name, turns + (1 if stop_in_tool else 0))
    config = BENCH_CONFIG
    spec = task.load_spec()
    tools = ToolRegistry([lookup])
    task.workspace_for(spec).mkdir(mode=0o700, parents=True, exist_ok=True)
    model = StopAt(ScriptedModel.from_file(task.script), turns + (1 if stop_in_tool else 0))
    publish = functools.partial(FileStore(spool.root).publish_heartbeat, task.id)
    heartbeat = Heartbeat(publish, config.heartbeat.interval)
    loop = TimedLoop(
        task,
        spec,
        config,
        model,
        tools,
        heartbeat,
        stop_after_tool=turns if stop_in_tool else None,
        floor=floor,
    )
    try:
        state = loop.open()
        heartbeat.update(turn=state.turn, usage=state.usage_total.to_json())
        heartbeat.start()
        outcome = loop.run()
    finally:
        heartbeat.stop()
        loop.close()
    if loop.floor is not None:
        loop.floor.catch_up(turns)
    if outcome.state != "stopped" or loop.state.turn != turns:
        raise RuntimeError(f"bench task {name} ended {outcome} at turn {loop.state.turn}")
    return loop


def resume_once(task: TaskDir, turns: int) -> float:
    """Milliseconds from a task folder to a state ready for the next model call."""
    config = BENCH_CONFIG
    spec = task.load_spec()
    tools = ToolRegistry([lookup])
    t0 = time.perf_counter_ns()
    loop = AgentLoop(
        FileStore(task.root),
        spec,
        config,
        ScriptedModel([]),
        tools,
        workspace=task.workspace_for(spec),
        spool=task.root,
    )
    state = loop.open()
    spent = time.perf_counter_ns() - t0
    loop.close()
    if state.turn != turns or state.pending_calls() or state.last_role != "user":
        raise RuntimeError(f"resume of {task.id} is not at a model call after turn {turns}")
    return spent / 1e6


def time_resume(task: TaskDir, turns: int, repeats: int) -> list[float]:
    """``repeats`` resume times; a first run warms the page cache and is dropped."""
    return [resume_once(task, turns) for _ in range(repeats + 1)][1:]


def resume_parts(task: TaskDir, repeats: int) -> dict[str, float]:
    """Where agentd's resume time goes: median ms of each step ``AgentLoop.open`` takes
    (mirrors ``worker.state.parse_snapshot``, step by step, for the breakdown only)."""
    parts: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        clock = [time.perf_counter_ns()]
        data = task.snapshot.read_bytes()
        clock.append(time.perf_counter_ns())
        body = data[: -SNAPSHOT_TRAILER.size]
        if SNAPSHOT_TRAILER.unpack(data[-SNAPSHOT_TRAILER.size :])[0] != zlib.crc32(body):
            raise RuntimeError(f"{task.snapshot}: checksum mismatch")
        clock.append(time.perf_counter_ns())
        text = zlib.decompress(body[len(SNAPSHOT_MAGIC) :])
        clock.append(time.perf_counter_ns())
        scene = load_json(text)
        clock.append(time.perf_counter_ns())
        state, offset = TaskState.from_snapshot(scene)
        clock.append(time.perf_counter_ns())
        journal, records = Journal.open(task.journal, offset)
        for record in records:
            state.apply(record)
        clock.append(time.perf_counter_ns())
        journal.close()
        names = (
            "read snapshot",
            "crc check",
            "zlib.decompress",
            "load_json",
            "TaskState.from_snapshot",
            f"Journal.open + fold {len(records)} records",
        )
        for name, t0, t1 in zip(names, clock[:-1], clock[1:], strict=True):
            parts[name].append((t1 - t0) / 1e6)
    return {k: statistics.median(v) for k, v in parts.items()}


def task_bytes(task: TaskDir) -> int:
    return sum(p.stat().st_size for p in (task.journal, task.snapshot) if p.exists())


def message_bytes(messages: list[JSON], turns: int) -> int:
    """The transcript after ``turns`` turns as JSON: prompt, then per turn the assistant
    message and the user message answering its tool call."""
    return len(dump_json(messages[: 2 * turns + 1]))


# -- the floor ------------------------------------------------------------------------


class Floor:
    """Appends each turn's journal bytes to a plain file, one write + fdatasync a turn.

    It runs interleaved with the agentd task in blocks of ``FLOOR_BLOCK`` turns (while the
    loop waits on the model, outside agentd's clocks), so both see the same load on a
    shared machine; blocks keep one side's dirty metadata out of the other's syncs except
    at block edges."""

    def __init__(self, journal: Path, path: Path, clocks: Clocks) -> None:
        self.journal = journal
        self.path = path
        self.clocks = clocks
        self.cost: dict[int, float] = {}
        self.done = 0  # turns appended so far

    def catch_up(self, turn: int) -> None:
        """Append every recorded turn up to ``turn``."""
        ends = self.clocks.journal_end
        todo = [t for t in range(self.done + 1, turn + 1) if t in ends]
        if not todo:
            return
        start = ends.get(self.done, self.clocks.journal_start)
        with open(self.journal, "rb") as f:
            f.seek(start)
            data = f.read(ends[todo[-1]] - start)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            pos = 0
            for t in todo:
                chunk = memoryview(data)[pos : ends[t] - start]
                pos = ends[t] - start
                t0 = time.perf_counter_ns()
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
                os.fdatasync(fd)
                self.cost[t] = (time.perf_counter_ns() - t0) / 1e6
        finally:
            os.close(fd)
        self.done = todo[-1]


# -- LangGraph ------------------------------------------------------------------------


@dataclass
class PeerResult:
    version: str
    cost: dict[int, float] = field(default_factory=dict)
    bytes_at: dict[int, int] = field(default_factory=dict)
    built_at_exit: set[int] = field(default_factory=set)
    commits_per_step: float | None = None


def langgraph_graph(conn: Any, agent: Callable[..., Any], route: Callable[..., str]) -> Any:
    """The bench's graph: ``messages: Annotated[list, add_messages]``, one node looping
    on itself, compiled with a ``SqliteSaver`` on ``conn``."""
    from typing import Annotated, TypedDict

    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    # Functional syntax: with postponed annotations a class body here could not resolve
    # the locally imported add_messages when LangGraph reads the type hints.
    State = TypedDict("State", {"messages": Annotated[list[Any], add_messages]})  # noqa: UP013  (not a class: see above)
    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["agent", END])
    return builder.compile(checkpointer=SqliteSaver(conn))


LANGGRAPH_CONFIG: Any = {"configurable": {"thread_id": "bench"}}


def child_resume(kind: str, path: str, turns: int, repeats: int) -> list[float]:
    """In a fresh interpreter (what a restarted worker is): ``repeats`` resume times in
    ms after one warm-up, for an agentd task folder or a LangGraph database."""
    if kind == "agentd":
        folder = Path(path)
        return time_resume(TaskDir(folder.parent.parent, folder.name), turns, repeats)
    import sqlite3

    conn = sqlite3.connect(path, check_same_thread=False)
    graph = langgraph_graph(conn, lambda state: {}, lambda state: "__end__")
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter_ns()
        snapshot = graph.get_state(LANGGRAPH_CONFIG)
        times.append((time.perf_counter_ns() - t0) / 1e6)
        if len(snapshot.values["messages"]) != 2 * turns + 1:
            raise RuntimeError("LangGraph state does not hold every message")
    conn.close()
    return times[1:]


def resume_in_children(kind: str, path: Path, turns: int, repeats: int, rounds: int) -> list[float]:
    """``child_resume`` in ``rounds`` fresh processes; every time measured."""
    code = (
        "import json; from bench.checkpoint import child_resume; "
        f"print(json.dumps(child_resume({kind!r}, {str(path)!r}, {turns}, {repeats})))"
    )
    times: list[float] = []
    for _ in range(rounds):
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"resume measurement failed: {done.stderr.strip()[-500:]}")
        times.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    return times


def run_langgraph(plan: Plan, workdir: Path, resume_of: Callable[[int, Path], None]) -> PeerResult:
    import sqlite3
    from importlib.metadata import version

    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    result = PeerResult(
        f"langgraph {version('langgraph')}, "
        f"langgraph-checkpoint-sqlite {version('langgraph-checkpoint-sqlite')}"
    )

    def messages_for(step: int) -> list[Any]:
        k = step - 1
        call_id = f"toolu_{k:05d}"
        return [
            AIMessage(
                content=reply_text(k),
                id=f"msg_{k:05d}",
                tool_calls=[{"name": "lookup", "args": {"n": k}, "id": call_id}],
            ),
            ToolMessage(content=result_text(k), tool_call_id=call_id, id=f"tr_{k:05d}"),
        ]

    class Counting(sqlite3.Connection):
        """Counts commits: each is one durable write (WAL, synchronous=FULL: an fsync)."""

        commits = 0

        def commit(self) -> None:
            Counting.commits += 1
            super().commit()

    class Thread:
        """One LangGraph thread in its own database; ``run_to`` runs it to a step."""

        def __init__(self, db: Path, prebuilt: int = 0) -> None:
            self.db = db
            self.conn = sqlite3.connect(str(db), check_same_thread=False, factory=Counting)
            self.done = 0
            self.target = 0
            self.stamps: list[int] = []
            self.pre = [messages_for(s) for s in range(1, prebuilt + 1)]
            self.graph = langgraph_graph(self.conn, self.agent, self.route)
            self.config: Any = LANGGRAPH_CONFIG

        def agent(self, state: Any) -> dict[str, Any]:
            self.stamps.append(time.perf_counter_ns())
            self.done += 1
            step = self.done
            return {"messages": self.pre[step - 1] if step <= len(self.pre) else messages_for(step)}

        def route(self, state: Any) -> str:
            return "__end__" if self.done >= self.target else "agent"

        def run_to(self, target: int, durability: str) -> dict[int, float]:
            first = self.done + 1
            self.target, self.stamps = target, []
            start = [HumanMessage(content=PROMPT, id="prompt")] if self.done == 0 else []
            config = {**self.config, "recursion_limit": target - self.done + 10}
            self.graph.invoke({"messages": start}, config, durability=durability)
            self.stamps.append(time.perf_counter_ns())  # the last step ends with invoke
            s = self.stamps
            return {first + i: (s[i + 1] - s[i]) / 1e6 for i in range(len(s) - 1)}

        def bytes(self) -> int:
            return sum(p.stat().st_size for p in (self.db, Path(f"{self.db}-wal")) if p.exists())

        def close(self) -> None:
            self.conn.close()
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.db}{suffix}").unlink(missing_ok=True)

    t0 = time.monotonic()
    curve = Thread(workdir / "langgraph-curve.db", prebuilt=plan.peer_steps)
    try:
        Counting.commits = 0
        result.cost.update(curve.run_to(plan.mid, "sync"))
        result.commits_per_step = Counting.commits / plan.mid
        result.bytes_at[plan.mid] = curve.bytes()
        resume_of(plan.mid, curve.db)  # while the thread is at plan.mid steps
        if plan.peer_steps > plan.mid:
            result.cost.update(curve.run_to(plan.peer_steps, "sync"))
            result.bytes_at[plan.peer_steps] = curve.bytes()
    finally:
        curve.close()
    say(f"LangGraph: {plan.peer_steps:,} steps, durability=sync ({time.monotonic() - t0:.1f} s)")
    for n in plan.resume:
        if n == plan.mid:
            continue  # measured on the cost curve's thread
        t0 = time.monotonic()
        thread = Thread(workdir / f"langgraph-{n}.db")
        try:
            # Past the cost curve, a thread of n steps is built with durability="exit"
            # (one checkpoint at the end): get_state reads only the latest checkpoint,
            # which is the same either way, and it spares writing O(n^2) bytes.
            durability = "sync" if n <= plan.peer_steps else "exit"
            thread.run_to(n, durability)
            if durability == "exit":
                result.built_at_exit.add(n)
            resume_of(n, thread.db)
        finally:
            thread.close()
        say(f"LangGraph: resume folder of {n:,} steps ({time.monotonic() - t0:.1f} s)")
    return result


# -- statistics -----------------------------------------------------------------------


def window(series: dict[int, float], turn: int, half: int = WINDOW) -> list[float]:
    return [series[t] for t in range(turn - half, turn + half + 1) if t in series]


def median_at(series: dict[int, float] | None, turn: int) -> float | None:
    values = window(series, turn) if series else []
    return statistics.median(values) if values else None


def p99_at(series: dict[int, float] | None, turn: int) -> float | None:
    values = window(series, turn) if series else []
    return percentile(values, 0.99) if values else None


def growth(series: dict[int, float] | None, at: Callable[..., float | None], last: int) -> Any:
    if not series or max(series) < last:
        return None
    first, end = at(series, 100), at(series, last)
    return end / first if first and end is not None else None


def rolling_median(series: dict[int, float], half: int = 12) -> tuple[list[int], list[float]]:
    turns = sorted(series)
    values = [series[t] for t in turns]
    out = [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]
    return turns, out


# -- the run --------------------------------------------------------------------------


def filesystem_of(path: Path) -> str:
    """ "ext4 on /dev/vda" for the mount holding ``path`` (Linux; "?" elsewhere)."""
    best, found = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, kind = line.split()[:3]
                inside = str(path).startswith(mount.rstrip("/") + "/") or str(path) == mount
                if inside and len(mount) > len(best):
                    best, found = mount, f"{kind} on {device}"
    except OSError:
        pass
    return found


def machine_load() -> tuple[str, bool]:
    """The load average and I/O pressure now, and whether they make timings noisy."""
    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "load unknown", False
    text, busy = f"load average {load:.2f} on {os.cpu_count()} CPUs", load > 1.0
    try:
        some = Path("/proc/pressure/io").read_text().splitlines()[0]
        io = float(some.split("avg10=")[1].split()[0])
        text += f", I/O pressure {io:.1f}%"
        busy = busy or io > 1.0
    except (OSError, ValueError, IndexError):
        pass
    return text, busy


def say(message: str) -> None:
    print(f"{NAME}: {message}", flush=True)


def fmt_turn(n: int) -> str:
    return f"{n:,}"


def run(quick: bool) -> list[Row]:
    plan = QUICK if quick else FULL
    base = os.environ.get("AGENTD_BENCH_DIR") or None
    workdir = Path(tempfile.mkdtemp(prefix="agentd-bench-", dir=base)).resolve()
    try:
        return _run(plan, workdir, quick)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(plan: Plan, workdir: Path, quick: bool) -> list[Row]:
    say(
        f"{'quick' if quick else 'full'} mode on {filesystem_of(workdir)}; "
        f"~{TEXT_CHARS + RESULT_CHARS:,} chars of new messages a turn; "
        f"python {sys.version.split()[0]}"
    )
    load, busy = machine_load()
    say(f"before: {load}" + ("; other work competes for CPU or disk: noisy" if busy else ""))
    spool = Spool(workdir / "spool").ensure()

    # agentd: the resume folders, the biggest of which is the cost curve.
    loops: dict[int, TimedLoop] = {}
    for n in sorted(plan.resume):
        t0 = time.monotonic()
        floor = workdir / "floor" if n == plan.turns else None
        loops[n] = run_agentd(spool, f"bench-{n}", n, floor=floor)
        say(f"agentd: {n:,} turns ({time.monotonic() - t0:.1f} s)")
    t0 = time.monotonic()
    worst = run_agentd(spool, f"bench-{plan.mid}-torn", plan.mid, stop_in_tool=True)
    say(f"agentd: {plan.mid:,} turns, stopped in the tool call ({time.monotonic() - t0:.1f} s)")
    main = loops[plan.turns]
    clocks = main.clocks
    agentd_cost = clocks.cost_ms()

    assert main.floor is not None
    floor_cost = main.floor.cost

    # Resume: each measured in fresh processes (a restarted worker), agentd and LangGraph
    # alternating round by round so that both see the same load.
    resume: dict[int, list[float]] = {}
    peer_resume: dict[int, list[float]] = {}
    rounds = 1 if quick else 3

    def measure(n: int, db: Path | None) -> None:
        for _ in range(rounds):
            resume.setdefault(n, []).extend(
                resume_in_children("agentd", loops[n].task.path, n, plan.repeats, 1)
            )
            if db is not None:
                peer_resume.setdefault(n, []).extend(
                    resume_in_children("langgraph", db, n, plan.repeats, 1)
                )

    resume_worst = resume_in_children("agentd", worst.task.path, plan.mid, plan.repeats, rounds)
    parts = resume_parts(loops[plan.mid].task, plan.repeats)
    parts_worst = resume_parts(worst.task, plan.repeats)

    peer: PeerResult | None = None
    if ensure_peers(PEER_MODULES, REQUIREMENTS, install=plan.install):
        peer = run_langgraph(plan, workdir, measure)
    else:
        hint = "" if plan.install else "; quick mode installs nothing: --full does"
        say(f"peer not installed: {PEER} is left out{hint}")
    for n in plan.resume:
        if n not in resume:
            measure(n, None)
    peer_cost = peer.cost if peer else None

    rows: list[Row] = []
    peer_name = PEER if peer else ""

    def row(figure: str, unit: str, agentd: float | None, **kw: Any) -> None:
        rows.append(Row(NAME, figure, unit, agentd, peer_name=peer_name, **kw))

    for turn in plan.rows:
        a, f = median_at(agentd_cost, turn), median_at(floor_cost, turn)
        target, met = "", None
        if turn == plan.mid and a is not None and f:
            target, met = f"<= {TARGET_COST}x floor", a / f <= TARGET_COST
        row(
            f"per-turn cost @ turn {fmt_turn(turn)}, median",
            "ms",
            a,
            floor=f,
            peer=median_at(peer_cost, turn),
            target=target,
            met=met,
        )
    for turn in plan.rows:
        row(
            f"per-turn cost @ turn {fmt_turn(turn)}, p99",
            "ms",
            p99_at(agentd_cost, turn),
            floor=p99_at(floor_cost, turn),
            peer=p99_at(peer_cost, turn),
        )
    last = max(t for t in plan.rows if t <= plan.peer_steps)
    flat_note = (
        "Growth of the window median (p99) from turn 100 to the turn named. The target is "
        "judged on agentd's growth over the floor's (the 'vs floor' column): the floor "
        "runs interleaved with agentd, so load from other processes cancels out."
    )
    for label, at in (("median", median_at), ("p99", p99_at)):
        g, fg = growth(agentd_cost, at, plan.turns), growth(floor_cost, at, plan.turns)
        relative = g / fg if g is not None and fg else None
        row(
            f"{label} growth, turn 100 -> {fmt_turn(plan.turns)}",
            "x",
            g,
            floor=fg,
            peer=growth(peer_cost, at, plan.turns),
            target=f"<= {TARGET_FLAT}x floor's (flat)",
            met=None if relative is None else relative <= TARGET_FLAT,
            note=flat_note if label == "median" else "",
        )
        if last != plan.turns and peer_cost:
            row(
                f"{label} growth, turn 100 -> {fmt_turn(last)}",
                "x",
                growth(agentd_cost, at, last),
                floor=growth(floor_cost, at, last),
                peer=growth(peer_cost, at, last),
            )
    turns = list(agentd_cost)
    commits = peer.commits_per_step if peer else None
    row(
        "fdatasyncs per turn the loop waits for",
        "",
        statistics.median(clocks.syncs.get(t, 0) for t in turns),
        floor=1.0,
        peer=commits,
        compare=False,
        note="agentd: Journal.append with sync, Journal.sync (median over turns: a snapshot "
        "turn adds one, and the snapshot's own fsyncs); 'all' adds the syncs started in "
        "the background while the model thinks. LangGraph: sqlite commits (WAL, "
        "synchronous=FULL: one fsync each) per step, the checkpoint and its writes.",
    )
    row(
        "fdatasyncs per turn, all",
        "",
        statistics.median(clocks.syncs.get(t, 0) + clocks.background.get(t, 0) for t in turns),
        floor=1.0,
        peer=commits,
        compare=False,
    )
    for turn in sorted(clocks.snapshot):
        if turn in plan.rows:
            row(
                f"snapshot, loop thread @ turn {fmt_turn(turn)}",
                "ms",
                clocks.snapshot[turn] / 1e6,
                compare=False,
            )
            row(
                f"snapshot, written off the loop @ turn {fmt_turn(turn)}",
                "ms",
                clocks.snapshot_written.get(turn, 0) / 1e6,
                compare=False,
            )
    messages = main.state.messages
    mb = 1e6
    for turn in sorted({plan.mid, last, plan.turns}):
        snap = max((t for t in clocks.snapshot_size if t <= turn), default=None)
        agentd_bytes = clocks.journal_end[turn] + (clocks.snapshot_size[snap] if snap else 0)
        target, met = "", None
        msg = message_bytes(messages, turn)
        if turn in loops:  # a real folder of that many turns: measure its files
            agentd_bytes = task_bytes(loops[turn].task)
        if turn == plan.mid:
            target, met = f"<= {TARGET_BYTES}x messages", agentd_bytes / msg <= TARGET_BYTES
        peer_bytes = peer.bytes_at.get(turn) if peer else None
        row(
            f"bytes on disk @ {fmt_turn(turn)} turns",
            "MB",
            agentd_bytes / mb,
            floor=msg / mb,
            peer=None if peer_bytes is None else peer_bytes / mb,
            target=target,
            met=met,
        )
    for i, n in enumerate(sorted(plan.resume)):
        a = statistics.median(resume[n])
        target, met = "", None
        if n == plan.mid:
            target, met = f"< {TARGET_RESUME_MS:g} ms", a < TARGET_RESUME_MS
        p = statistics.median(peer_resume[n]) if n in peer_resume else None
        notes = []
        if i == 0:
            notes.append(
                "agentd: AgentLoop(...) + open() on a task stopped while waiting on the "
                "model (its snapshot is current); LangGraph: graph.get_state(config). Each "
                f"in a fresh process (as a restarted worker), warm page cache; median of "
                f"{rounds} x {plan.repeats}, the two alternated process by process."
            )
        if peer and n in peer.built_at_exit:
            notes.append(
                f'LangGraph\'s {n:,}-step thread was built with durability="exit" (one '
                "checkpoint): get_state reads only the latest checkpoint, the same either "
                "way, and this spares writing O(n^2) bytes."
            )
        row(
            f"resume @ {fmt_turn(n)} turns",
            "ms",
            a,
            peer=p,
            target=target,
            met=met,
            note=" ".join(notes),
        )
        if n == plan.mid:
            a = statistics.median(resume_worst)
            row(
                f"resume @ {fmt_turn(n)} turns, 100 after the snapshot",
                "ms",
                a,
                target=target,
                met=a < TARGET_RESUME_MS,
                note="The worst case: stopped in the tool call of the turn that would "
                "have written the next snapshot, so 100 turns (300 records) are replayed.",
            )

    # Where agentd's time goes: printed for the analysis, not part of the table.
    mid = plan.mid
    ms = {
        k: {t: v.get(t, 0) / 1e6 for t in agentd_cost}
        for k, v in (
            ("append", clocks.append),
            ("heartbeat", clocks.heartbeat),
            ("background", clocks.background_start),
        )
    }
    rest = {t: agentd_cost[t] - sum(m[t] for m in ms.values()) for t in agentd_cost}
    say(
        f"per-turn breakdown @ turn {fmt_turn(mid)} (medians): "
        f"appends {median_at(ms['append'], mid):.3f} ms "
        f"({statistics.median(clocks.syncs.values()):.0f} blocking fdatasync), "
        "heartbeat updates "
        f"{median_at(ms['heartbeat'], mid):.3f} ms, starting the background sync "
        f"{median_at(ms['background'], mid):.3f} ms, stamp + fold + snapshot check "
        f"{median_at(rest, mid):.3f} ms; floor 1 write + fdatasync "
        f"{median_at(floor_cost, mid):.3f} ms"
    )
    spent = sum(agentd_cost.values())
    snaps = sum(clocks.snapshot.values()) / 1e6
    say(
        f"snapshots: {len(clocks.snapshot)} in {plan.turns:,} turns, {snaps / 1e3:.2f} s of "
        f"{spent / 1e3:.2f} s recording ({100 * snaps / spent:.0f}%); mean per turn "
        f"{spent / len(agentd_cost):.3f} ms vs median "
        f"{statistics.median(agentd_cost.values()):.3f} ms"
    )
    for label, split in (
        ("snapshot current", parts),
        ("100 turns after the snapshot", parts_worst),
    ):
        say(
            f"resume @ {fmt_turn(mid)} ({label}): "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items())
        )
    snap_size = loops[mid].task.snapshot.stat().st_size
    journal_size = loops[mid].task.journal.stat().st_size
    say(
        f"bytes @ {fmt_turn(mid)}: journal {journal_size / mb:.2f} MB + snapshot "
        f"{snap_size / mb:.2f} MB for {message_bytes(loops[mid].state.messages, mid) / mb:.2f} MB "
        "of messages"
    )
    if peer:
        say(f"peer: {peer.version}")
    load, busy = machine_load()
    say(f"after: {load}" + ("; other work competes for CPU or disk: noisy" if busy else ""))
    if plan.plot:
        plot(agentd_cost, floor_cost, peer_cost, plan)
    else:
        say("plot: full mode only")
    return rows


def plot(
    agentd: dict[int, float],
    floor: dict[int, float],
    peer: dict[int, float] | None,
    plan: Plan,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("plot skipped: matplotlib is not installed (pip install -r bench/requirements.txt)")
        return
    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=120)
    turns = sorted(agentd)
    ax.scatter(turns, [agentd[t] for t in turns], s=2, color="tab:blue", alpha=0.25, lw=0)
    series = [("agentd", agentd, "tab:blue"), ("floor: 1 write + fdatasync", floor, "tab:gray")]
    if peer:
        series.append((f"{PEER} SqliteSaver, durability=sync", peer, "tab:red"))
        pts = sorted(peer)
        ax.scatter(pts, [peer[t] for t in pts], s=2, color="tab:red", alpha=0.25, lw=0)
    for label, data, color in series:
        xs, ys = rolling_median(data)
        ax.plot(xs, ys, label=f"{label} (rolling median)", color=color, lw=1.6)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to make the turn durable (ms, log)")
    ax.set_title(
        "Per-turn checkpoint cost, ~2 KB of new messages a turn "
        "(dots: every turn; agentd snapshots every 100 turns)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_xlim(0, plan.turns)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT)
    plt.close(fig)
    say(f"plot: {PLOT.relative_to(PLOT.parent.parent)}")
