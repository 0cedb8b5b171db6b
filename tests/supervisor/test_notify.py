"""sd_notify against a real datagram socket, as systemd would listen on it."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.notify import NOTIFY_ENVIRONMENT, Notifier

RECV_TIMEOUT = 5.0


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(RECV_TIMEOUT)  # a missing datagram fails the test instead of hanging
    return sock


@pytest.fixture
def systemd_socket() -> Iterator[tuple[socket.socket, str]]:
    """A socket bound to a path (short enough for sun_path), and its NOTIFY_SOCKET value."""
    with tempfile.TemporaryDirectory(prefix="agentd-") as folder:
        path = str(Path(folder) / "notify")
        with _listener(path) as sock:
            yield sock, path


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the abstract socket namespace is Linux only")
    name = f"agentd-test-{uuid.uuid4().hex}"
    with _listener("\0" + name) as sock:
        yield sock, "@" + name


def test_sends_each_state_change_as_one_datagram(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, address = systemd_socket
    notifier = Notifier({"NOTIFY_SOCKET": address})

    assert notifier.enabled
    assert notifier.ready()
    assert notifier.status("2 running, 1 queued")
    assert notifier.watchdog()
    assert notifier.stopping()

    received = [sock.recv(4096) for _ in range(4)]
    assert received == [b"READY=1", b"STATUS=2 running, 1 queued", b"WATCHDOG=1", b"STOPPING=1"]


def test_abstract_namespace_address(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    notifier = Notifier({"NOTIFY_SOCKET": address})

    assert notifier.ready()
    assert notifier.watchdog()

    assert sock.recv(4096) == b"READY=1"
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_status_stays_one_line(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket

    assert Notifier({"NOTIFY_SOCKET": address}).status("line one\nline two\r\n")

    assert sock.recv(4096) == b"STATUS=line one line two"


def test_several_assignments_share_a_datagram(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket

    assert Notifier({"NOTIFY_SOCKET": address}).notify("READY=1", "STATUS=serving")

    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_default_environment_is_this_process(
    systemd_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, address = systemd_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)

    assert Notifier().ready()

    assert sock.recv(4096) == b"READY=1"


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "vsock:2:1"}])
def test_everything_is_a_no_op_outside_systemd(environ: dict[str, str]) -> None:
    notifier = Notifier(environ)

    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()
    assert notifier.watchdog_interval() is None


def test_a_vanished_socket_returns_false_instead_of_raising(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})

    assert notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()


def test_a_full_socket_never_blocks(systemd_socket: tuple[socket.socket, str]) -> None:
    """Nobody reads the socket: sends fail fast once its queue is full."""
    _, address = systemd_socket
    notifier = Notifier({"NOTIFY_SOCKET": address})

    results = [notifier.watchdog() for _ in range(10_000)]

    assert results[0]
    assert not results[-1]


def test_watchdog_interval_is_half_the_timeout_in_seconds() -> None:
    """WatchdogSec=30 means a ping every 15 s: one late tick must not kill the unit."""
    environ = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}

    assert Notifier(environ).watchdog_interval() == 15.0
    assert Notifier({**environ, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 15.0
    assert Notifier({**environ, "WATCHDOG_PID": "4242"}, pid=4242).watchdog_interval() == 15.0


@pytest.mark.parametrize(
    "environ",
    [
        {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"},  # armed for another process
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "soon"},
        {"WATCHDOG_USEC": "-5"},
        {},
    ],
)
def test_no_watchdog_for_us(environ: dict[str, str]) -> None:
    assert Notifier(environ, pid=4242).watchdog_interval() is None


def test_the_variables_workers_must_not_inherit() -> None:
    assert set(NOTIFY_ENVIRONMENT) == {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}
