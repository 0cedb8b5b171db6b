"""Liveness and progress, published for the supervisor.

A daemon thread rewrites ``heartbeat.json`` every ``interval`` seconds with the worker's
pid, the time, its turn, usage and phase (``idle``, ``model``, ``tool:NAME``) and when the
phase started. The supervisor judges liveness by the age of ``at`` and progress by the
age of ``phase_started`` against the deadline of the phase. The file is replaced
atomically without fsync: it describes the present, a crash makes it moot.

The loop only updates the fields (``update``, ``phase``: a dict update under a lock); the
thread alone writes, every ``interval``, so the loop never waits on the file and the
journal's fdatasync never has to commit a heartbeat's rename with it (on ext4 that
doubled the cost of a turn's sync). The turn and phase it shows are at most ``interval``
old; ``phase_started`` is the phase's own start time, so a deadline is judged from when
the phase began, not from when the beat was written. A crashed worker's turn is read
from its journal, not from here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from worker.durable import atomic_write_json
from worker.errors import StorageError


class Heartbeat:
    def __init__(self, path: Path, interval: float) -> None:
        self.path = path
        self.interval = interval
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = {"turn": 0, "phase": "idle", "phase_started": time.time()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._fields.update(fields)

    def phase(self, phase: str) -> None:
        self.update(phase=phase, phase_started=time.time())

    def beat(self) -> None:
        with self._lock:
            data = {"pid": os.getpid(), "at": time.time(), **self._fields}
        with contextlib.suppress(StorageError):  # a missed beat is the signal
            atomic_write_json(self.path, data, durable=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)
