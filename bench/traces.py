"""Traces benchmark: what an OTLP collector that answers, one that is away and one that
hangs each change in the checkpoint bench's per-turn cost (docs/design.md section 14).

The workload is the checkpoint bench's (``bench/checkpoint.py``): the real worker path
(``AgentLoop`` on the scripted model, a read-only tool, a heartbeat), one tool turn a step
with about 2 KB of new messages, its per-turn cost timed by the same ``TimedLoop`` clocks
(the records of a turn, and the snapshot when one falls on it). Four runs of it:

* **off**: traces off, as the checkpoint bench runs;
* **answering**: traces on (the worker records its spans with its events,
  ``worker.spans``) and exported (``supervisor.traces``: the relay's assembler and the
  SDK's batch processor) to a collector on 127.0.0.1 that answers at once;
* **away**: the same, the collector's port closed (every export fails: the exporter
  retries with backoff, then drops);
* **hanging**: the same, the collector takes each request and never answers (every export
  waits out its timeout; the queue fills, and what does not fit is dropped).

The exporter runs in the benchmark's own process, in the threads it has in the daemon
(the relay's pull every 0.1 s here, the processor's), so it competes with the worker's loop
for the GIL: a harsher place than the daemon, a process of its own. The runs are done in
blocks, the four conditions in turn, so that they see the same load. Each run's task must
reach the same end (its turns, its journal's record count) whatever the collector did.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.checkpoint import BENCH_CONFIG, StopAt, TimedLoop, lookup, new_task
from bench.report import Row
from supervisor.traces import ExportSettings, TraceExporter, TraceTail
from worker.heartbeat import Heartbeat
from worker.models.scripted import ScriptedModel
from worker.spans import RunSpans, identity
from worker.spool import Spool
from worker.store.files import FileStore
from worker.tools.registry import ToolRegistry

NAME = "traces"
CONDITIONS = ("off", "answering", "away", "hanging")
LABELS = {
    "off": "traces off",
    "answering": "collector answering",
    "away": "collector away",
    "hanging": "collector hanging",
}
PULL = 0.1  # seconds between two reads of the task's events by the exporter's side


@dataclass
class Measured:
    cost_ms: list[float] = field(default_factory=list)  # per turn
    exported: int = 0
    records: int = 0
    turns: int = 0


@contextlib.contextmanager
def collector(kind: str) -> Iterator[str]:
    """The base URL of a collector that answers, is away, or hangs."""
    if kind == "away":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        return
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if kind == "hanging":
                release.wait(120)
                return
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def one_run(spool: Spool, name: str, turns: int, condition: str) -> Measured:
    """``turns`` turns of the checkpoint workload under ``condition``."""
    task = new_task(spool, name, turns)
    spec = task.load_spec()
    store = FileStore(spool.root)
    task.workspace_for(spec).mkdir(mode=0o700, parents=True, exist_ok=True)
    model = StopAt(ScriptedModel.from_file(task.script), turns)
    heartbeat = Heartbeat(lambda data: store.publish_heartbeat(task.id, data), 1.0)
    measured = Measured()
    with contextlib.ExitStack() as stack:
        spans = None
        tail = None
        if condition != "off":
            endpoint = stack.enter_context(collector(condition))
            settings = ExportSettings(f"{endpoint}/v1/traces", "http/protobuf")
            tail = TraceTail(store, task.id, TraceExporter(settings))
            spans = RunSpans(store, task.id, identity(task.id, spec.created_at), "bench")
        loop = TimedLoop(
            task, spec, BENCH_CONFIG, model, ToolRegistry([lookup]), heartbeat, spans=spans
        )
        done = threading.Event()

        def pull() -> None:
            while tail is not None and not done.wait(PULL):
                tail.pull()

        puller = threading.Thread(target=pull, daemon=True)
        puller.start()
        try:
            loop.open()
            heartbeat.start()
            outcome = loop.run()
        finally:
            heartbeat.stop()
            loop.close()
            done.set()
            puller.join()
        if tail is not None:
            tail.pull()
            measured.exported = tail.exporter.exported
            closing = threading.Thread(target=tail.exporter.close, args=(1.0,), daemon=True)
            closing.start()  # (a hanging collector: the bench does not wait for it)
    if outcome.state != "stopped":
        raise RuntimeError(f"bench task {name} ended {outcome}")
    measured.cost_ms = list(loop.clocks.cost_ms().values())
    measured.turns = loop.state.turn
    measured.records = loop.state.records
    return measured


def run(quick: bool) -> list[Row]:
    turns, blocks = (150, 2) if quick else (400, 12)
    with tempfile.TemporaryDirectory(prefix="agentd-bench-traces-") as tmp:
        spool = Spool(Path(tmp) / "spool").ensure()
        results: dict[str, list[Measured]] = {c: [] for c in CONDITIONS}
        for block in range(blocks):
            order = CONDITIONS if block % 2 == 0 else tuple(reversed(CONDITIONS))
            for condition in order:
                results[condition].append(
                    one_run(spool, f"traces-{condition}-{block}", turns, condition)
                )
    ends = {(m.turns, m.records) for runs in results.values() for m in runs}
    rows = []
    for condition in CONDITIONS:
        costs = [c for m in results[condition] for c in m.cost_ms]
        exported = sum(m.exported for m in results[condition])
        # the spread of the blocks' own medians: how much the machine moved the figure
        blocks_at = sorted(statistics.median(m.cost_ms) for m in results[condition])
        spread = f"block medians {blocks_at[0]:.2f} to {blocks_at[-1]:.2f} ms"
        handed = f"; {exported} spans handed to the exporter" if condition != "off" else ""
        rows.append(
            Row(
                NAME,
                f"per-turn record cost, {LABELS[condition]} (median of {len(costs)} turns)",
                "ms",
                round(statistics.median(costs), 3),
                compare=False,
                note=f"{LABELS[condition]}: {spread}{handed}",
            )
        )
    rows.append(
        Row(
            NAME,
            "task ends that differ between the four (turns, journal records)",
            "count",
            len(ends) - 1,
            target="0",
            met=len(ends) == 1,
            compare=False,
        )
    )
    return rows
