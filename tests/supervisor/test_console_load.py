"""A console under attack never slows supervision (docs/design.md section 12): while 150
half-open connections sit on it and a scraper hammers its API, a worker that stops
beating (SIGSTOP) is still found hung within the heartbeat timeout and one second, as
with no console at all (``test_daemon.py``'s measure)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.console import api_token, console_table, free_port
from tests.daemon import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    Daemon,
    config_text,
    parse_time,
    subreaper,
)
from tests.supervisor.test_daemon import steps
from tests.support import poll_for

CROWD = 150


class Scraper(threading.Thread):
    """Reads the whole API over one kept-open connection, as fast as it is answered."""

    def __init__(self, port: int, token: str, task: str) -> None:
        super().__init__(daemon=True)
        self.port, self.token, self.task = port, token, task
        self.answers = 0
        self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        paths = ["/api/tasks", f"/api/tasks/{self.task}", f"/api/tasks/{self.task}/messages",
                 "/api/held"]  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Authorization": f"Bearer {self.token}", "Host": f"127.0.0.1:{self.port}"}
        while not self.stop.is_set():
            for path in paths:
                try:
                    conn.request("GET", path, headers=headers)
                    response = conn.getresponse()
                    response.read()
                    if response.status == 200:
                        self.answers += 1
                    else:
                        self.refused += 1
                except (OSError, http.client.HTTPException):
                    self.refused += 1
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    with subreaper():
        made = Daemon(tmp_path, config_text(extra=console_table(port)))
        try:
            made.start()
            yield made, port
        finally:
            made.cleanup()


def test_a_crowd_and_a_scraper_do_not_delay_hang_detection(daemon: tuple[Daemon, int]) -> None:
    shared, port = daemon
    task_id = shared.submit(steps(60, delay=0.25), name="watched")  # 15 s of turns at least
    row = shared.wait_row(task_id, lambda r: r["state"] == "running" and r["turn"] >= 2)
    scraper = Scraper(port, api_token(shared), task_id)
    scraper.start()
    poll_for(lambda: scraper.answers >= 20, 30, what="the scraper's first answers")
    crowd: list[socket.socket] = []
    try:
        for _ in range(CROWD):  # each sends half a request, and waits
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(f"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
            crowd.append(conn)
        answered = scraper.answers
        row = shared.wait_row(task_id, lambda r: r["state"] == "running", what="still running")
        pid = row["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        hung = poll_for(lambda: shared.events(task_id, "worker_hung"), 15, what="worker_hung")[0]
        detection = parse_time(hung["timestamp"]) - stopped_at
        during = scraper.answers - answered
    finally:
        scraper.stop.set()
        for conn in crowd:
            conn.close()
        scraper.join(timeout=30)
    print(
        f"\nhang detection under the console's load: {detection:.2f} s after SIGSTOP "
        f"(heartbeat timeout {HEARTBEAT_TIMEOUT} s, interval {HEARTBEAT_INTERVAL} s); "
        f"{CROWD} half-open connections, {during} API answers meanwhile "
        f"({scraper.answers} in all, {scraper.refused} refused)"
    )
    assert hung["pid"] == pid
    assert HEARTBEAT_TIMEOUT - HEARTBEAT_INTERVAL - 0.1 <= detection <= HEARTBEAT_TIMEOUT + 1.0
    assert during >= 5, "the scraper was not answered while the worker hung"
    # the hung worker was killed and the task goes on, resumed
    shared.wait_row(task_id, lambda r: r["restarts"] == 1 and r["state"] in ("running", "done"))
