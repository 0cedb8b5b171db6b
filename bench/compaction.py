"""Compaction benchmark: what a long task that compacts costs to resume and to keep on
disk, against one that does not, and what a compaction costs the loop itself.

The workload is ``bench.checkpoint``'s: one tool turn per step with about 2 KB of new
messages (~1 KB of text and a lookup call, a ~1 KB result), run by the real ``AgentLoop``
(its journal, snapshots and fold; no heartbeat, no VCS) on a model that answers at once
and reports ``input_tokens`` in proportion to the transcript (``TOKENS_PER_MESSAGE`` a
message, so ``tokens_used`` grows as against the real API). A summary call answers a
~300-character summary.

* **resume**: a task that compacts (``[context] window`` 200,000 at ``compact_at`` 0.8:
  a compaction every ~320 turns), stopped at turn 5,000, against one that never does
  (the window never reached), stopped at turn 1,000; each resumed (``AgentLoop.open``,
  ``bench.checkpoint.resume_in_children``) in fresh processes. Target: the compacting task
  at 5,000 turns resumes no slower than the other at 1,000, so resume time is bounded by
  the window and not the task's age.
* **bytes on disk per turn**: journal and snapshot over turns, for both tasks.
* **loop cost of a compaction**: the time ``ModelTurns.compact`` takes minus its summary
  call (the cut, the summary request, the token estimate, the durable record and the
  fold), median over the task's compactions; the floor is one ``write`` + ``fdatasync``
  of the record's bytes to a plain file.

Quick mode: 1,000 turns (window 40,000) against 200. Set ``AGENTD_BENCH_DIR`` to measure
on another file system.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.checkpoint import PROMPT, lookup, reply_text, resume_in_children, task_bytes
from bench.report import Row
from supervisor.submit import create_task
from worker.config import Config, ContextConfig
from worker.loop import AgentLoop
from worker.models.base import ModelReply, ModelRequest, Usage
from worker.spool import Spool, TaskDir, TaskSpec
from worker.store.durable import dump_json
from worker.store.files import FileStore
from worker.store.journal import read_file
from worker.tools.registry import ToolRegistry
from worker.turns import StopRequested

NAME = "compaction"
TOKENS_PER_MESSAGE = 250  # ~1 KB of JSON a message, over 4
NEVER = 10**12  # a window no task reaches


@dataclass(frozen=True)
class Plan:
    long: int  # turns of the task that compacts
    short: int  # turns of the task that does not
    window: int
    repeats: int
    rounds: int


FULL = Plan(long=5000, short=1000, window=200_000, repeats=5, rounds=3)
QUICK = Plan(long=1000, short=200, window=40_000, repeats=3, rounds=1)


class Answers:
    """The model: turn k is ``bench.checkpoint``'s reply k; a summary call is short. Stops
    the worker (as SIGTERM does, waiting on the model) at model call ``turns + 1``."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        usage = Usage(input_tokens=TOKENS_PER_MESSAGE * len(request.messages), output_tokens=80)
        if request.summary is not None:
            text = f"Items 1 to {request.summary.last} are looked up and acted on. " * 5
            return ModelReply([{"type": "text", "text": text}], "end_turn", usage, request.model)
        if turn_index >= self.turns:
            raise StopRequested
        content: list[dict[str, Any]] = [
            {"type": "text", "text": reply_text(turn_index)},
            {
                "type": "tool_use",
                "id": f"toolu_{turn_index:06d}",
                "name": "lookup",
                "input": {"n": turn_index},
            },
        ]
        return ModelReply(content, "tool_use", usage, request.model)

    def close(self) -> None:
        pass


class TimedLoop(AgentLoop):
    """The worker's loop, with a clock around each compaction and its summary call."""

    costs: list[float]
    summary_seconds: float = 0.0

    def __init__(self, task: TaskDir, spec: TaskSpec, *args: Any) -> None:
        workspace = task.workspace_for(spec)
        super().__init__(FileStore(task.root), spec, *args, workspace=workspace, spool=task.root)
        self.task = task
        turns = self.turns
        plain_compact, plain_ask = turns.compact, turns.ask

        def compact(trigger: str, tools: ToolRegistry) -> bool:
            self.summary_seconds = 0.0
            started = time.perf_counter()
            made = plain_compact(trigger, tools)
            if made:
                self.costs.append(time.perf_counter() - started - self.summary_seconds)
            return made

        def ask(request: ModelRequest, phase: str) -> ModelReply:
            started = time.perf_counter()
            try:
                return plain_ask(request, phase)
            finally:
                if phase == "compaction":
                    self.summary_seconds += time.perf_counter() - started

        turns.compact = compact  # type: ignore[method-assign]
        turns.ask = ask  # type: ignore[method-assign]


def run_task(spool: Spool, name: str, turns: int, window: int) -> TimedLoop:
    """A task run ``turns`` turns the way ``python -m worker`` runs it, then stopped."""
    spec = TaskSpec(id=name, prompt=PROMPT, max_turns=turns + 10, scripted=True)
    task = create_task(spool, spec, b'{"responses": []}')
    config = replace(Config(), context=ContextConfig(window=window))
    task.workspace_for(spec).mkdir(mode=0o700, parents=True, exist_ok=True)
    loop = TimedLoop(task, spec, config, Answers(turns), ToolRegistry([lookup]))
    loop.costs = []
    try:
        outcome = loop.run()
    finally:
        loop.close()
    if outcome.state != "stopped" or loop.state.turn != turns:
        raise RuntimeError(f"bench task {name} ended {outcome} at turn {loop.state.turn}")
    return loop


def floor_of_records(task: TaskDir, folder: Path) -> float:
    """Median ms of one write + fdatasync of each compaction record's bytes."""
    records = [r for r, _ in read_file(task.journal).records if r.get("k") == "compaction"]
    path, times = folder / "floor.bin", []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for record in records:
            data = dump_json(record) + b"\n"
            started = time.perf_counter()
            os.write(fd, data)
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
    return 1000 * statistics.median(times) if times else float("nan")


def say(message: str) -> None:
    print(f"{NAME}: {message}", flush=True)


def run(quick: bool) -> list[Row]:
    plan = QUICK if quick else FULL
    base = os.environ.get("AGENTD_BENCH_DIR") or None
    workdir = Path(tempfile.mkdtemp(prefix="agentd-bench-", dir=base)).resolve()
    try:
        return _run(plan, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(plan: Plan, workdir: Path) -> list[Row]:
    spool = Spool(workdir / "spool").ensure()
    t0 = time.monotonic()
    long = run_task(spool, "compacts", plan.long, plan.window)
    made = len(long.state.live_compactions())
    say(f"{plan.long:,} turns, {made} compactions ({time.monotonic() - t0:.1f} s)")
    t0 = time.monotonic()
    short = run_task(spool, "whole", plan.short, NEVER)
    say(f"{plan.short:,} turns, none ({time.monotonic() - t0:.1f} s)")
    resumed = {
        loop.task.id: statistics.median(
            resume_in_children("agentd", loop.task.path, turns, plan.repeats, plan.rounds)
        )
        for loop, turns in ((long, plan.long), (short, plan.short))
    }
    cost = 1000 * statistics.median(long.costs) if long.costs else None
    floor = floor_of_records(long.task, workdir)
    fresh = f"{plan.rounds} fresh processes x {plan.repeats}, median"
    return [
        Row(
            NAME,
            f"resume @ turn {plan.long:,} compacting vs @ {plan.short:,} not ({fresh})",
            "ms",
            resumed["compacts"],
            floor=resumed["whole"],
            target="<= 1.0x floor",
            met=resumed["compacts"] <= resumed["whole"],
            note=(
                f"{NAME}: floor = resume of a task of {plan.short:,} turns that never "
                f"compacts; agentd = one of {plan.long:,} turns that compacted {made} times "
                f"(window {plan.window:,}, compact_at 0.8)"
            ),
        ),
        Row(
            NAME,
            f"bytes on disk per turn, compacting @ {plan.long:,} vs not @ {plan.short:,}",
            "KB",
            task_bytes(long.task) / plan.long / 1024,
            floor=task_bytes(short.task) / plan.short / 1024,
            note=f"{NAME}: journal + snapshot over turns; floor = the task that never compacts",
        ),
        Row(
            NAME,
            f"loop cost of a compaction, summary call excluded (median of {made})",
            "ms",
            cost,
            floor=floor,
            note=f"{NAME}: floor = one write + fdatasync of the compaction record's bytes",
        ),
    ]
