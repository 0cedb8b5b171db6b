"""The fork queue (supervisor/forkserver.py): a start asked while the fork server warms
up waits for it, and what it cannot serve in time is started fresh."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import psutil

from supervisor import forkserver
from supervisor.coordination import ring
from supervisor.forkserver import ForkQueue, ForkServer
from supervisor.submit import submit
from tests.daemon import Daemon, parse_time
from tests.support import poll_for, reply, text
from worker.store.base import START
from worker.testing.messages_api import MessagesAPIServer, Reply


def cmdline(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline()).strip()


def test_a_restart_in_the_first_seconds_waits_for_the_warming_fork_server(
    tmp_path: Path,
) -> None:
    """The first scan after `agentd start` finds the task while the fork server is still
    importing: its first worker starts fresh, as always. Killed at once, it is replaced
    by a worker the server forks once it is ready, not by another cold start."""
    daemon = Daemon(tmp_path, "max_workers = 2\n[restart]\nbackoff_initial = 0.05\n")
    try:
        task_id = daemon.submit([reply(text("Done."), delay=3.0)], "early")
        daemon.start()
        first = poll_for(lambda: daemon.events(task_id, "worker_spawned"), 30, what="a worker")
        pid = first[0]["pid"]
        assert "worker.forkserver" not in cmdline(pid)  # a first start does not wait
        os.kill(pid, signal.SIGKILL)
        spawned = poll_for(
            lambda: daemon.events(task_id, "worker_spawned")[1:], 30, what="the restart"
        )
        assert "worker.forkserver" in cmdline(spawned[0]["pid"])  # forked, not cold
        ready = [e for e in daemon.log_events() if e["event"] == "forkserver_ready"]
        assert ready and parse_time(ready[0]["timestamp"]) <= parse_time(spawned[0]["timestamp"])
        assert daemon.wait_state(task_id, "done", timeout=30)["restarts"] == 1
    finally:
        daemon.cleanup()


def test_ps_names_the_daemon_the_fork_server_and_each_worker(tmp_path: Path) -> None:
    """Process titles (setproctitle), as ``ps`` shows them: a fresh worker and a forked one
    each with its task and spool, the fork server, the daemon with its spool."""
    daemon = Daemon(tmp_path, "[restart]\nbackoff_initial = 0.05\n")
    spool = daemon.spool.root

    def titled(pid: int) -> str | None:
        title = cmdline(pid)
        return title if title.startswith("agentd: ") else None

    try:
        daemon.submit([reply(text("Done."), delay=60.0)], "cold")
        proc = daemon.start()
        assert poll_for(lambda: titled(proc.pid)) == f"agentd: daemon {spool}"
        first = poll_for(lambda: daemon.events("cold", "worker_spawned"), what="a worker")
        assert poll_for(lambda: titled(first[0]["pid"])) == f"agentd: worker cold in {spool}"
        poll_for(
            lambda: [e for e in daemon.log_events() if e["event"] == "forkserver_ready"],
            what="the fork server",
        )
        (server,) = [
            c for c in psutil.Process(proc.pid).children() if "fork server" in cmdline(c.pid)
        ]
        assert cmdline(server.pid) == "agentd: fork server (worker.forkserver)"
        daemon.submit([reply(text("Done."), delay=60.0)], "warm")
        pid = poll_for(lambda: daemon.events("warm", "worker_spawned"), what="a fork")[0]["pid"]
        forked = f"agentd: worker warm in {spool} (forked by worker.forkserver)"
        poll_for(lambda: cmdline(pid) == forked, what=f"the title {forked!r}, not {cmdline(pid)!r}")
    finally:
        daemon.cleanup()


def test_a_task_on_the_sdk_starts_warm_and_a_kill_of_its_first_worker_is_replaced_at_once(
    tmp_path: Path,
) -> None:
    """A fresh start of a task on the Messages API imports the very SDK the warming fork
    server is importing: its first start waits for the server instead, so the daemon's
    first workers are forked, and a worker that dies in the first seconds after `agentd
    start` is replaced by another fork, not by a wait for the server."""
    with MessagesAPIServer(responder=lambda request: Reply.text("Done.", delay=3.0)) as server:
        daemon = Daemon(tmp_path, "max_workers = 2\n[restart]\nbackoff_initial = 0.05\n")
        try:
            submit(daemon.spool, daemon.config, prompt="go", name="early")
            ring(daemon.spool, "early")
            daemon.start(
                {
                    "ANTHROPIC_API_KEY": server.api_key or "key",
                    "ANTHROPIC_BASE_URL": server.base_url,
                    "NO_PROXY": "127.0.0.1,localhost",
                }
            )
            first = poll_for(lambda: daemon.events("early", "worker_spawned"), 30, what="a worker")
            assert "worker.forkserver" in cmdline(first[0]["pid"])  # forked, the first too
            ready = [e for e in daemon.log_events() if e["event"] == "forkserver_ready"]
            assert ready and parse_time(ready[0]["timestamp"]) <= parse_time(first[0]["timestamp"])
            poll_for(lambda: server.requests, 30, what="the first model request")
            os.kill(first[0]["pid"], signal.SIGKILL)
            spawned = poll_for(
                lambda: daemon.events("early", "worker_spawned")[1:], 30, what="the restart"
            )
            assert "worker.forkserver" in cmdline(spawned[0]["pid"])
            assert daemon.wait_state("early", "done", timeout=30)["restarts"] == 1
        finally:
            daemon.cleanup()


def never_ready(tmp_path: Path) -> ForkServer:
    """A fork server whose process lives and never says it is ready."""
    server = ForkServer(tmp_path / "forkserver.log", {})
    server.proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    return server


class Queue:
    """A fork queue on a server that is never ready, with what it hands back recorded."""

    def __init__(self, tmp_path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.tmp_path = tmp_path
        self.server = never_ready(tmp_path)
        self.lost: list[str] = []  # the items handed back to be started fresh
        self.events: list[str] = []
        self.queue: ForkQueue[str] = ForkQueue(
            self.server,
            answered=lambda asked, pid: None,
            settle=lambda lost: self.lost.extend(a.item for a in lost),
            emit=lambda event, **k: self.events.append(event),
            clock=clock,
        )

    def ask(self, item: str, *, wait: bool) -> bool:
        return self.queue.ask(item, START, self.tmp_path, None, {}, self.tmp_path / "o", wait=wait)

    def run(self, scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            asyncio.run(scenario())
        finally:
            self.queue.close()
            self.server.stop()


def test_a_start_waits_for_a_warming_server_only_so_long(tmp_path: Path) -> None:
    now = [0.0]
    q = Queue(tmp_path, clock=lambda: now[0])

    async def scenario() -> None:
        assert not q.ask("t0", wait=False)  # a start not to wait: started fresh
        assert q.ask("t1", wait=True)  # waits while the server warms up
        assert not q.queue.answering  # nothing was sent: no sweep has to wait for it
        now[0] = forkserver.WARMUP_WAIT - 0.1
        q.queue.tend()
        assert q.lost == []
        now[0] = forkserver.WARMUP_WAIT
        q.queue.tend()
        assert q.lost == ["t1"]

    q.run(scenario)


def test_a_server_not_ready_after_the_warm_up_is_not_waited_for(tmp_path: Path) -> None:
    """A server still not ready ``WARMUP_WAIT`` after its start is stuck or slow: a start
    after that is not made to wait for it (3 s more for every task), it starts fresh."""
    now = [0.0]
    q = Queue(tmp_path, clock=lambda: now[0])

    async def scenario() -> None:
        now[0] = forkserver.WARMUP_WAIT - 0.1
        assert q.ask("t1", wait=True)  # young yet: worth the wait
        now[0] = forkserver.WARMUP_WAIT
        assert not q.ask("t2", wait=True)  # not any more
        now[0] = 2 * forkserver.WARMUP_WAIT
        q.queue.tend()
        assert q.lost == ["t1"]  # and what waited is handed back at its own deadline

    q.run(scenario)


def test_a_start_that_waited_for_the_warm_up_gets_its_whole_patience_once_sent(
    tmp_path: Path,
) -> None:
    now = [0.0]
    q = Queue(tmp_path, clock=lambda: now[0])

    async def scenario() -> None:
        assert q.ask("t1", wait=True)
        now[0] = forkserver.WARMUP_WAIT - 0.1  # the server is ready just in time
        q.server.ready = True
        q.queue._ready()
        assert q.queue.answering
        now[0] += forkserver.PATIENCE - 0.1  # past PATIENCE since asked, not since sent
        q.queue.tend()
        assert "forkserver_failed" not in q.events and q.lost == []
        q.queue.close()  # on the loop: it watches the server's answers there

    q.run(scenario)


def test_a_server_that_dies_warming_up_hands_its_starts_back(tmp_path: Path) -> None:
    q = Queue(tmp_path)

    async def scenario() -> None:
        assert q.ask("t1", wait=True)
        assert q.server.proc is not None
        q.server.proc.kill()  # its output closes: the watched descriptor says so at once
        deadline = time.monotonic() + 5.0
        while not q.lost and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert q.lost == ["t1"]
        assert "forkserver_failed" in q.events

    q.run(scenario)
