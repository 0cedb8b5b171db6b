"""Liveness and progress, published for the supervisor.

A daemon thread publishes a beat (``TaskStore.publish_heartbeat``: ``heartbeat.json`` in
the spool) every ``interval`` seconds with the worker's
pid, the time, its turn, usage and phase (``idle``, ``model``, ``tool:NAME``) and when the
phase started, and its ``interval``. The supervisor judges liveness by the age of the beat
and progress by the age of the phase against the deadline of the phase. The store replaces
it without making it durable: it describes the present, a crash makes it moot.

Each instant is stamped twice: ``at`` and ``phase_started`` in wall time, for people to
read, and ``at_mono`` and ``phase_started_mono`` on ``CLOCK_MONOTONIC``, which is
system-wide on Linux and never stepped, for verdicts (``supervisor/liveness.py``): a wall
clock stepped by an hour must neither kill every worker as hung nor hide a stopped one.

The loop only updates the fields (``update``, ``phase``: a dict update under a lock); the
thread alone writes, every ``interval``, so the loop never waits on the file and the
journal's fdatasync never has to commit a heartbeat's rename with it (on ext4 that
doubled the cost of a turn's sync). The turn and phase it shows are at most ``interval``
old; ``phase_started`` is the phase's own start time, so a deadline is judged from when
the phase began, not from when the beat was written. A crashed worker's turn is read
from its journal, not from here.

A beat that cannot be written because of a storage fault (a full or read-only disk) would
soon look like a hang to the supervisor, which would kill the worker and count a crash.
So once beats have failed for ``patience`` seconds (the worker gives half the heartbeat
timeout), the thread calls ``on_fault`` with the error, once, and the worker exits with
the storage code, which the supervisor treats as a wait; except within ``patient``, where
the worker waits for something bounded otherwise.

A worker on a spool also holds a dead-man (``worker.killtimer``, on ``CLOCK_MONOTONIC``):
each beat arms it ``heartbeat.timeout`` ahead, right after its instant is stamped, and says
so (``deadman``: the seconds armed). A worker that cannot beat any more, stopped or its
interpreter stuck, is then killed by the kernel at the instant the daemon would have found
its beat too old, so the daemon need not read a heartbeat to find a hang: it reads one when
a deadline could pass (``supervisor.liveness.judge``). A worker handed a claim on a shared
store has none: its lease bounds it, and a beat that waits on the database is no hang.

Each beat also carries the worker's step metrics (``worker.metrics``: the histograms of
its checkpoints, model and tool calls and tokens), and ``stop(final=True)`` writes one last
beat when the worker ends, so the daemon also gets what it measured in its last interval.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from worker.errors import StorageError
from worker.killtimer import DeadMan
from worker.metrics import StepMetrics
from worker.protocol import HeartbeatData

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Where the beats go: ``functools.partial(store.publish_heartbeat, task_id)``.
Publish = Callable[[dict[str, Any]], None]


class Heartbeat:
    def __init__(
        self,
        publish: Publish,
        interval: float,
        *,
        patience: float | None = None,
        on_fault: Callable[[StorageError], None] | None = None,
        metrics: StepMetrics | None = None,
        deadman: tuple[DeadMan, float] | None = None,
    ) -> None:
        self.publish = publish
        self.deadman = deadman  # a kill timer and the seconds each beat arms it ahead
        self.metrics = metrics
        self.interval = interval
        self.patience = patience
        self.on_fault = on_fault
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = {"turn": 0, "interval": interval, **_phase("idle")}
        self._sources: dict[str, Callable[[], Any]] = {}
        self._written = time.monotonic()  # when a beat was last written
        self._patient = 0  # blocks of ``patient`` open
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def update(self, **fields: Unpack[HeartbeatData]) -> None:
        with self._lock:
            self._fields.update(fields)

    def follow(self, **sources: Callable[[], Any]) -> None:
        """Fields read when each beat is written (from the heartbeat's thread): what
        changes without the loop saying so, like a journal sync that returned while the
        model thinks."""
        with self._lock:
            self._sources.update(sources)

    @contextlib.contextmanager
    def patient(self) -> Iterator[None]:
        """Within the block, beats that fail do not end the worker (``on_fault``): what it
        waits for is bounded otherwise (a call's result waiting for the database, bounded
        by the lease's fence). The patience counts again from the block's end."""
        with self._lock:
            self._patient += 1
        try:
            yield
        finally:
            with self._lock:
                self._patient -= 1
                self._written = max(self._written, time.monotonic())

    def phase(self, phase: str) -> None:
        self.update(**_phase(phase))

    def beat(self) -> StorageError | None:
        """Write a beat now; the error when it could not be (a missed beat is the signal)."""
        with self._lock:
            now = {"at": time.time(), "at_mono": time.monotonic()}
            data = {"pid": os.getpid(), **now, **self._fields}
            sources = list(self._sources.items())
            if self.deadman is not None:  # (armed after the stamp: never before at + timeout)
                timer, timeout = self.deadman
                timer.arm_in(timeout)
                data["deadman"] = timeout
        data.update((name, source()) for name, source in sources)
        if self.metrics is not None:
            data["metrics"] = self.metrics.to_json()
        try:
            self.publish(data)
        except StorageError as exc:
            return exc
        self._written = time.monotonic()
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            failure = self.beat()
            if failure is None or not failure.fault or self.on_fault is None or self._patient:
                continue
            if self.patience is not None and time.monotonic() - self._written >= self.patience:
                self.on_fault(failure)
                return

    def stop(self, *, final: bool = False) -> None:
        """Stop the thread; with ``final``, write one last beat after it (once the beats
        had started), so what was measured since the last one is not lost."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
        if final and self._thread.ident is not None:
            self.beat()


def _phase(phase: str) -> HeartbeatData:
    """The fields that say ``phase`` begins now, on both clocks."""
    return {"phase": phase, "phase_started": time.time(), "phase_started_mono": time.monotonic()}
