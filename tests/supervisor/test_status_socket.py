"""`agentd status --json` answered by the running daemon (``supervisor.ask``,
``supervisor.status_socket``): the very document the command line prints from the files,
right after any command, and no answer at all whenever the two could differ."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from supervisor import ask
from supervisor.status_socket import RowCache
from tests.daemon import Daemon, config_text
from tests.support import REPO, make_spool, reply, scripted_task, text
from worker.budget import BUILTIN_PRICES
from worker.spool import TaskDir
from worker.store.durable import atomic_write_json, read_json

HOUR = [reply(text("Working."), delay=3600)]  # a worker in an hour-long model call
DONE = [reply(text("Done."))]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path, config_text(max_workers=1))
    try:
        yield daemon
    finally:
        daemon.cleanup()


def status_args(daemon: Daemon, *extra: str) -> list[str]:
    spool, config = str(daemon.spool.root), str(daemon.config_path)
    return ["--spool", spool, "--config", config, *extra, "status", "--json"]


def asked(daemon: Daemon, env: Mapping[str, str] | None = None) -> bytes | None:
    """The daemon's answer, or None: the command line is to read the files."""
    return ask.answered(status_args(daemon), {**os.environ, **(env or {})})


def printed(daemon: Daemon) -> bytes:
    """What the command line prints, read from the files (``supervisor.cli``)."""
    code, out, err = daemon.cli("status", "--json")
    assert code == 0, err
    return out.encode()


def steady(document: bytes | dict[str, Any]) -> dict[str, Any]:
    """The document without what moves on by itself: a running worker's heartbeat age."""
    doc: dict[str, Any] = json.loads(
        document if isinstance(document, bytes) else json.dumps(document)
    )
    for row in doc["tasks"]:
        row.pop("heartbeat_age")
    return doc


def same_as_the_files(daemon: Daemon) -> dict[str, Any]:
    """The daemon's answer, checked against the files read just before and just after it
    (the daemon may move a task on between two reads); the answer, parsed."""
    before = printed(daemon)
    answer = asked(daemon)
    after = printed(daemon)
    assert answer is not None, "the daemon did not answer"
    assert steady(answer) in (steady(before), steady(after))
    doc: dict[str, Any] = json.loads(answer)
    return doc


def row(doc: dict[str, Any], task_id: str) -> dict[str, Any]:
    return next(r for r in doc["tasks"] if r["id"] == task_id)


def test_the_daemon_answers_what_the_files_say_right_after_each_command(
    daemon: Daemon,
) -> None:
    daemon.start()
    done = daemon.submit(DONE, "done")
    daemon.wait_state(done, "done")
    busy = daemon.submit(HOUR, "busy")
    daemon.wait_running(busy)
    waiting = daemon.submit(DONE, "waiting")  # max_workers 1: it waits
    time.sleep(1.2)  # every file older than the daemon's SETTLE: rows it keeps
    doc = same_as_the_files(daemon)
    assert [r["state"] for r in doc["tasks"]] == ["running", "done", "queued"]
    assert steady(same_as_the_files(daemon)) == steady(doc)
    # a budget change is a new file in decisions/: seen in the very next answer
    code, _, err = daemon.cli("budget", waiting, "--usd", "5")
    assert code == 0, err
    assert row(same_as_the_files(daemon), waiting)["budget"]["usd"] == 5.0
    # a cancel: a new file in the task folder, then the daemon's record
    code, _, err = daemon.cli("cancel", waiting)
    assert code == 0, err
    same_as_the_files(daemon)
    daemon.wait_state(waiting, "cancelled")
    assert row(same_as_the_files(daemon), waiting)["state"] == "cancelled"
    # the running task's worker ends: its row is never a kept one
    code, _, err = daemon.cli("cancel", busy)
    assert code == 0, err
    daemon.wait_state(busy, "cancelled")
    assert row(same_as_the_files(daemon), busy)["state"] == "cancelled"
    # a task submitted now is in the next answer
    new = daemon.submit(DONE, "new")
    assert new in [r["id"] for r in same_as_the_files(daemon)["tasks"]]


def test_a_command_line_the_answer_could_differ_from_is_not_answered(
    daemon: Daemon, tmp_path: Path
) -> None:
    daemon.start()
    daemon.submit(DONE, "one")
    assert asked(daemon) is not None
    environ = dict(os.environ)
    spool, config = str(daemon.spool.root), str(daemon.config_path)
    # the same config named another way is the same bytes: answered
    assert ask.answered(
        ["--spool", spool, "status", "--json"], {**environ, "AGENTD_CONFIG": config}
    )
    for args in (
        ["--spool", spool, "--config", config, "status", "--json", "one"],  # one task
        ["--spool", spool, "--config", config, "status"],  # the table
        ["--spool", spool, "--config", config, "status", "--json", "--watch"],
        ["--spool", spool, "--config", config, "--store", "postgresql://x/y", "status", "--json"],
        ["--spool", spool, "--config", config, "--spool", spool, "status", "--json"],
        ["--spool", spool, "status", "--json"],  # no config named: the defaults, not its
    ):
        assert ask.answered(args, environ) is None, args
    # another config: another price table, say
    other = tmp_path / "other.toml"
    other.write_text(daemon.config_path.read_text() + "\n# edited\n")
    assert (
        ask.answered(["--spool", spool, "--config", str(other), "status", "--json"], environ)
        is None
    )
    # a shared store named in the environment
    assert asked(daemon, {"AGENTD_STORE": "postgresql://x/y"}) is None
    # the spool by another path (a link to it): the document says the path it was given
    link = tmp_path / "link"
    link.symlink_to(daemon.spool.root)
    assert (
        ask.answered(["--spool", str(link), "--config", config, "status", "--json"], environ)
        is None
    )
    # and the command line, asked each of these as a process, reads the files itself
    done = subprocess.run(
        daemon.launch("--spool", str(link), "status", "--json"),
        cwd=REPO,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["supervisor"]["spool"] == str(link)


def test_with_the_daemon_stopped_killed_or_gone_the_files_answer(daemon: Daemon) -> None:
    daemon.start()
    task = daemon.submit(DONE, "one")
    daemon.wait_state(task, "done")
    socket_path = daemon.spool.root / ask.SOCKET
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # frozen: its socket takes the question
    try:
        began = time.monotonic()
        assert asked(daemon) is None
        assert time.monotonic() - began >= ask.ASK_TIMEOUT * 0.9
        done = daemon.run_cli("status", "--json", timeout=60)
        assert done.returncode == 0, done.stderr
        assert row(json.loads(done.stdout), task)["state"] == "done"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert asked(daemon) is not None
    daemon.kill()  # kill -9: the socket stays, and nobody listens
    assert socket_path.exists()
    assert asked(daemon) is None
    done = daemon.run_cli("status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["supervisor"]["running"] is False
    daemon.start()  # the next daemon binds it again
    assert asked(daemon) is not None
    daemon.stop()
    assert not socket_path.exists()
    assert asked(daemon) is None


def test_a_status_the_daemon_answers_imports_nothing_of_the_command_line(
    daemon: Daemon,
) -> None:
    """What makes it cheap: the standard library, this module and ``worker.paths``."""
    daemon.start()
    probe = (
        "import sys\n"
        "from supervisor import entry\n"
        f"assert entry.answered({status_args(daemon)!r}, __import__('os').environ)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('supervisor', 'worker')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.split("\n")[0] == str(
        ["supervisor", "supervisor.ask", "supervisor.entry", "worker", "worker.paths"]
    )


# -- the rows kept ---------------------------------------------------------------------


def ctime_of_newest(task: TaskDir) -> int:
    return max(os.stat(p).st_ctime_ns for p in (task.path, task.events) if p.exists())


def test_a_row_is_kept_only_once_its_files_are_older_than_a_tick_of_their_clock(
    tmp_path: Path,
) -> None:
    """A change in the same tick of the file clock as the one before it would leave every
    time as it was: a row read while its files are that fresh is read again next time;
    one read from files at rest is kept until any of them changes."""
    spool = make_spool(tmp_path)
    task = scripted_task(spool, DONE, name="t")
    record = read_json(task.state)
    now = [ctime_of_newest(task) + 500_000_000]  # half a second after: not at rest
    cache = RowCache(clock=lambda: now[0])
    assert cache.row(task, BUILTIN_PRICES)["reason"] is None
    atomic_write_json(task.state, {**record, "reason": "first"})
    assert cache.row(task, BUILTIN_PRICES)["reason"] == "first"  # read again
    assert (cache.read, cache.kept) == (2, 0)
    now[0] = ctime_of_newest(task) + 3_000_000_000  # at rest: kept from here on
    for _ in range(3):
        assert cache.row(task, BUILTIN_PRICES)["reason"] == "first"
    assert (cache.read, cache.kept) == (3, 2)
    # a change of any file status reads is seen at once: the record, a new file in
    # decisions/ (a budget change, a decision), the journal
    atomic_write_json(task.state, {**record, "reason": "second"})
    assert cache.row(task, BUILTIN_PRICES)["reason"] == "second"

    def read_again(change: Callable[[], object]) -> bool:
        now[0] = max([ctime_of_newest(task), *marks(task)]) + 3_000_000_000
        cache.row(task, BUILTIN_PRICES)
        before = cache.read
        change()
        now[0] = max([ctime_of_newest(task), *marks(task)]) + 3_000_000_000
        cache.row(task, BUILTIN_PRICES)
        return cache.read == before + 1

    assert read_again(task.decisions.mkdir)
    assert read_again(lambda: (task.decisions / "budget.1.json").write_text("{}"))
    assert read_again(lambda: task.journal.open("ab").close())  # made
    assert read_again(lambda: task.journal.write_bytes(b"x"))
    assert not read_again(lambda: None)


def marks(task: TaskDir) -> list[int]:
    """The change times of what ``rest_mark`` reads besides the folder and its events."""
    return [os.stat(p).st_ctime_ns for p in (task.decisions, task.journal) if p.exists()]


def test_a_row_of_a_running_or_foreground_task_is_never_kept(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    running, foreground = scripted_task(spool, DONE, name="r"), scripted_task(spool, DONE, name="f")
    atomic_write_json(running.state, {**read_json(running.state), "state": "running"})
    atomic_write_json(foreground.state, {**read_json(foreground.state), "foreground": True})
    later = max(ctime_of_newest(running), ctime_of_newest(foreground)) + 10**10
    cache = RowCache(clock=lambda: later)
    for task in (running, foreground, running, foreground):
        cache.row(task, BUILTIN_PRICES)
    assert (cache.read, cache.kept) == (4, 0)
    # and a price table changed by a reload is a new reckoning of every row
    settled = scripted_task(spool, DONE, name="s")
    cache.clock = lambda: ctime_of_newest(settled) + 10**10
    cache.row(settled, BUILTIN_PRICES)
    cache.row(settled, BUILTIN_PRICES)
    cache.row(settled, {**BUILTIN_PRICES})
    cache.row(settled, {})
    assert (cache.read, cache.kept) == (6, 2)


def test_one_answer_reads_the_file_clock_once_and_a_change_after_it_is_read_again(
    tmp_path: Path,
) -> None:
    spool = make_spool(tmp_path)
    tasks = [scripted_task(spool, DONE, name=f"t{n}") for n in range(3)]
    reads: list[int] = []

    def clock() -> int:
        reads.append(1)
        return max(map(ctime_of_newest, tasks)) + 3_000_000_000

    cache = RowCache(clock)
    for _ in range(2):
        read = cache.reader()
        for task in tasks:
            read(task, BUILTIN_PRICES)
    assert (len(reads), cache.read, cache.kept) == (2, 3, 3)
    # a file changed after the answer read its clock is newer than that "now": it is read,
    # and not kept, however often the answer asks for it
    atomic_write_json(tasks[0].state, {**read_json(tasks[0].state), "reason": "later"})
    cache.clock = lambda: ctime_of_newest(tasks[0]) - 1
    read = cache.reader()
    assert read(tasks[0], BUILTIN_PRICES)["reason"] == "later"
    assert read(tasks[0], BUILTIN_PRICES)["reason"] == "later"
    assert (cache.read, cache.kept) == (5, 3)
