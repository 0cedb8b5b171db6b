"""What ``agentd run`` shows on the person's terminal (docs/design.md section 16).

``RunTerminal`` streams a task's transcript as its journal grows, as ``agentd show``
renders it (``supervisor.transcript``: the same lines, the same ``Renderer``; or, with
``--json``, one object a line, whole), and the run's own lines (restarts, waits, the
end) on the other stream. A terminal that goes away (a closed terminal, a closed pipe, a
SIGHUP) makes it silent: the run goes on, and prints nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TextIO

from supervisor import transcript
from worker.budget import Price
from worker.errors import StorageError
from worker.store.base import TaskStore


class RunTerminal:
    """``task_id``'s transcript on ``out`` (``json_lines``: one object a line, whole; else
    ``transcript.Renderer``'s text) and the run's own lines on ``err``. With
    ``show_from_start`` False, only what is recorded from now on is shown."""

    def __init__(
        self,
        store: TaskStore,
        task_id: str,
        prices: Mapping[str, Price],
        *,
        out: TextIO,
        err: TextIO,
        json_lines: bool = False,
        show_from_start: bool = True,
    ) -> None:
        self.store = store
        self.task_id = task_id
        self.prices = prices
        self.out = out
        self.err = err
        self.json_lines = json_lines
        self.renderer = transcript.Renderer(out, colour=transcript.use_colour(out))
        self.prompt = store.load_spec(task_id).prompt
        self.shown = 0 if show_from_start else len(self._lines())
        self.seen_end: object = None
        self.speechless = False  # the terminal went away (SIGHUP): nothing more is printed

    def _lines(self) -> list[dict[str, Any]]:
        return transcript.lines(
            self.store.replay(self.task_id), prompt=self.prompt, prices=self.prices
        )

    def recap(self) -> None:
        """Where a resumed run picks up: the turn it resumes after, on ``err``, and that
        turn as the killed run recorded it, as ``agentd show`` renders it, on ``out``."""
        try:
            shown = self._lines()
        except (StorageError, OSError):
            return  # (the worker says what it cannot read)
        last = int(shown[-1]["turn"]) if shown else 0
        if last == 0:
            self.say(f"resuming task {self.task_id} from its start: no turn was recorded")
            return
        self.say(
            f"resuming task {self.task_id} after turn {last}; the last turn the run before "
            "recorded:"
        )
        for line in shown:
            if line["turn"] == last:
                self.write(self.out, line)

    def pump(self) -> None:
        """Print the transcript lines recorded since the last call."""
        try:
            end = self.store.journal_end(self.task_id)
            if end == self.seen_end:
                return
            shown = self._lines()
        except (StorageError, OSError):
            return  # a disk or journal that cannot be read now: the next look may
        self.seen_end = end
        self.shown = min(self.shown, len(shown))  # (a rewind cut the live branch)
        for line in shown[self.shown :]:
            self.write(self.out, line)
        self.shown = len(shown)

    def write(self, stream: TextIO, line: dict[str, Any] | str) -> None:
        """One line on ``stream``: text as it is, a transcript line rendered."""
        if self.speechless:
            return
        try:
            if isinstance(line, str):
                print(line, file=stream)
            elif self.json_lines:
                print(json.dumps(line, ensure_ascii=False), file=stream)
            else:
                self.renderer.line(line)
            stream.flush()
        except (OSError, ValueError):  # a closed terminal (EIO) or pipe: run on, silent
            self.speechless = True

    def say(self, text: str) -> None:
        """One line of the run's own on ``err``."""
        self.write(self.err, f"agentd: {text}")
