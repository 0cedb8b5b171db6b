"""The census the supervision campaigns prove "one worker per task" with (``WorkerCensus``):
it counts two writers of one journal alive at once, and not a successor that one sweep of
/proc read after its predecessor had ended."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.daemon import WorkerCensus, journal_writers
from tests.support import make_spool, poll_for


@contextmanager
def writer(journal: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process holding ``journal`` open for writing until its stdin closes."""
    code = f"f = open({str(journal)!r}, 'ab'); print('ready', flush=True); input()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield proc
    finally:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        proc.wait(timeout=10)


def test_two_writers_alive_at_once_are_counted_and_an_ended_one_is_not(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    journal = spool.tasks_dir / "t1" / "journal"
    journal.parent.mkdir(parents=True)
    journal.touch()
    census = WorkerCensus(spool)
    with writer(journal) as first, writer(journal) as second:
        assert journal_writers(spool.tasks_dir) == {first.pid: "t1", second.pid: "t1"}
        assert census._at_once("t1", [first.pid, second.pid]) == [first.pid, second.pid]
        with census:  # the sampling thread itself sees them at once
            poll_for(lambda: census.samples >= 3, 10, what="three samples")
        assert census.overlapping_tasks() == {"t1"}
        assert first.stdin is not None
        first.stdin.close()
        first.wait(timeout=10)
        # read before the second in a sweep, gone after it: not proven to overlap
        assert census._at_once("t1", [first.pid, second.pid]) == [second.pid]
    quiet = WorkerCensus(spool)
    with writer(journal) as only, quiet:
        poll_for(lambda: quiet.samples >= 3, 10, what="three samples")
        assert quiet.seen[only.pid][0] == "t1"
    assert quiet.overlapping_tasks() == set()
