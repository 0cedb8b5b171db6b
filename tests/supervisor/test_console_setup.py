"""Turning the console on, off and over TLS (docs/design.md section 12): the config's
rules, a start that cannot serve stopping in one line, a reload, the console's process
living and dying with the daemon, and the pure checks (sessions, Host, Origin) with
their clocks and inputs in hand."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor.console.auth import Sessions, host_allowed, origin_allowed
from supervisor.coordination import running_pid
from tests.console import Client, console_table, free_port, login_url, self_signed
from tests.daemon import Daemon, config_text
from tests.support import missing_system_tool, poll_for
from worker.config import load_config
from worker.errors import ConfigError

pytestmark = pytest.mark.usefixtures("subreaper")


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for daemon in made:
        daemon.cleanup()


def console_children(daemon: Daemon) -> list[psutil.Process]:
    """The daemon's console process (none: it serves none), zombies aside."""
    assert daemon.proc is not None
    found = []
    for child in psutil.Process(daemon.proc.pid).children():
        try:
            if "supervisor.console" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone, or a zombie its parent has not reaped yet
            continue
    return found


# -- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ('listen = "0.0.0.0:8770"', "not a loopback address"),
        ('listen = "192.0.2.1:8770"', "not a loopback address"),
        ('listen = "myhost:8770"', "not a loopback address"),
        ('listen = "127.0.0.1"', "HOST:PORT"),
        ('listen = "127.0.0.1:8770"\ntls_cert = "CERT"', "without console.tls_key"),
        ('listen = "127.0.0.1:8770"\nhostnames = ["https://x.example"]', "no scheme"),
        ('listen = "127.0.0.1:8770"\nsession_timeout = 0', "greater than 0"),
        ('listen = "127.0.0.1:8770"\nport = 1', "not a known key"),
    ],
)
def test_a_console_config_of_another_shape_is_refused_in_one_line(
    tmp_path: Path, table: str, words: str
) -> None:
    cert, _ = self_signed(tmp_path)
    path = tmp_path / "agentd.toml"
    path.write_text(f"[console]\n{table.replace('CERT', str(cert))}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.exit_code == 78


def test_a_listen_off_the_loopback_is_taken_with_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    path = tmp_path / "agentd.toml"
    path.write_text(
        f'[console]\nlisten = "0.0.0.0:8770"\ntls_cert = "{cert.name}"\ntls_key = "{key.name}"\n'
        'hostnames = ["Agentd.Example.com"]\n'
    )
    console = load_config(path).console
    assert console.tls and console.tls_cert == cert  # (relative to the config's folder)
    assert console.hostnames == ("agentd.example.com",)


def test_a_non_loopback_listen_without_tls_stops_the_start_with_78(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    daemon = Daemon(tmp_path, config_text())
    daemons.append(daemon)
    daemon.config_path.write_text(config_text(extra='[console]\nlisten = "0.0.0.0:8770"\n'))
    done = daemon.run_cli("start")
    assert done.returncode == 78, done
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("agentd: ") and "console.tls_cert" in line
    assert running_pid(daemon.spool) is None


# -- the start ----------------------------------------------------------------------------


def test_agentd_console_when_the_console_is_off(tmp_path: Path, daemons: list[Daemon]) -> None:
    daemon = Daemon(tmp_path, config_text())
    daemons.append(daemon)
    daemon.spool.ensure()
    down = daemon.run_cli("console")
    assert down.returncode == 1 and down.stdout == ""
    assert down.stderr.startswith(
        "agentd: the console is off: set [console] listen, then `agentd start`"
    )
    daemon.start()
    off = daemon.run_cli("console")
    assert (off.returncode, off.stdout) == (1, "")
    assert off.stderr == "agentd: the console is off: set [console] listen and `agentd reload`\n"
    assert console_children(daemon) == []  # no process, no socket


def test_agentd_console_says_each_reason_it_has_no_url(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    """A listen set but no daemon; a listen the daemon has not read; a listen it could not
    serve (its ``console_failed``): each said as it is, none as "the console is off"."""
    port = free_port()
    daemon = Daemon(tmp_path, config_text())
    daemons.append(daemon)
    daemon.config_path.write_text(config_text(extra=console_table(port)))
    daemon.spool.ensure()
    down = daemon.run_cli("console")
    assert down.returncode == 1
    assert down.stderr == (
        f"agentd: agentd is not running on {daemon.spool.root}: `agentd start` serves the "
        f"console on 127.0.0.1:{port}\n"
    )
    daemon.config_path.write_text(config_text())
    daemon.start()
    daemon.config_path.write_text(config_text(extra=console_table(port)))
    unread = daemon.run_cli("console")
    assert unread.returncode == 1 and "has not read [console] listen" in unread.stderr
    assert "`agentd reload`" in unread.stderr
    with socket.socket() as taken:  # the port taken: the reload cannot serve it
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGHUP)

        def refused() -> str | None:
            done = daemon.run_cli("console")
            return done.stderr if "could not serve" in done.stderr else None

        said = poll_for(refused, 30, interval=0.2, what="the console's failure said")
    (line,) = said.splitlines()
    assert line.startswith(f"agentd: the console could not serve on 127.0.0.1:{port}: ")
    assert "another process listens there" in line and "console_failed" in line
    assert "is off" not in line
    os.kill(daemon.proc.pid, signal.SIGHUP)  # the port free again: a reload serves it

    def url_printed() -> str | None:
        done = daemon.run_cli("console")
        return done.stdout.strip() if done.returncode == 0 else None

    assert poll_for(url_printed, 30, interval=0.2, what="the console after a reload")


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detached"])
def test_a_listen_address_that_cannot_be_bound_stops_the_start_in_one_line(
    tmp_path: Path, daemons: list[Daemon], detach: bool
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = Daemon(tmp_path, config_text(extra=console_table(port)))
        daemons.append(daemon)
        daemon.spool.ensure()
        done = daemon.run_cli("start", *(["--detach"] if detach else []))
        assert (done.returncode, done.stdout) == (1, ""), done
        said = [line for line in done.stderr.splitlines() if line.startswith("agentd")]
        assert said == done.stderr.splitlines()[-1:], done.stderr
        assert said[0].startswith(f"agentd: [console] listen = '127.0.0.1:{port}'")
        assert "another process listens there" in said[0]
        assert running_pid(daemon.spool) is None


def test_tls_files_that_cannot_be_served_stop_the_start_with_78(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    extra = console_table(free_port(), f'tls_cert = "{bad}"\ntls_key = "{bad}"\n')
    daemon = Daemon(tmp_path / "d", config_text(extra=extra))
    daemons.append(daemon)
    daemon.spool.ensure()
    done = daemon.run_cli("start")
    assert done.returncode == 78, done
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("agentd: console.tls_cert") and "cannot be served" in line
    assert running_pid(daemon.spool) is None


def test_the_console_over_tls(tmp_path: Path, daemons: list[Daemon]) -> None:
    try:
        cert, key = self_signed(tmp_path)
    except FileNotFoundError:
        missing_system_tool(
            "openssl makes the console's test certificate (apt-get install openssl)"
        )
    port = free_port()
    extra = console_table(port, f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
    daemon = Daemon(tmp_path / "d", config_text(extra=extra))
    daemons.append(daemon)
    daemon.start()
    url = login_url(daemon)
    assert url.startswith(f"https://127.0.0.1:{port}/?token=")
    trusted = ssl.create_default_context(cafile=str(cert))
    browser = Client(port, tls=trusted)
    answer = browser.login(url)
    assert answer.status == 303, answer
    cookie = answer.header("Set-Cookie") or ""
    assert cookie.startswith(f"__Host-agentd-session-{port}=")
    attributes = {a.strip() for a in cookie.split(";")[1:]}
    assert {"Secure", "HttpOnly", "SameSite=Lax", "Path=/"} <= attributes
    assert not any(a.startswith("Domain") for a in attributes)
    assert browser.get("/api/tasks").status == 200
    # a page of plain http is another origin
    assert (
        browser.post("/api/tasks/x/cancel", headers={"Origin": f"http://127.0.0.1:{port}"}).status
        == 403
    )
    # plain HTTP on the TLS port gets no answer
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert not conn.recv(1024).startswith(b"HTTP/1.1 200")


# -- reload, and the process's life -------------------------------------------------------


def test_a_reload_turns_the_console_on_and_takes_new_hostnames(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    daemon = Daemon(tmp_path, config_text())
    daemons.append(daemon)
    daemon.start()
    assert daemon.run_cli("console").returncode == 1
    port = free_port()
    daemon.config_path.write_text(config_text(extra=console_table(port)))
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGHUP)

    def url_printed() -> str | None:
        done = daemon.run_cli("console")
        return done.stdout.strip() if done.returncode == 0 else None

    url = poll_for(url_printed, 30, interval=0.2, what="the console after a reload")
    browser = Client(port)
    assert browser.login(url).status == 303
    browser.host = "ops.example.test"
    assert browser.get("/api/tasks").status == 403
    daemon.config_path.write_text(
        config_text(extra=console_table(port, 'hostnames = ["ops.example.test"]\n'))
    )
    os.kill(daemon.proc.pid, signal.SIGHUP)
    # the same process reads it again: the session lives on, and the name is served
    poll_for(lambda: browser.get("/api/tasks").status == 200, 30, interval=0.2, what="hostnames")
    daemon.config_path.write_text(config_text())
    os.kill(daemon.proc.pid, signal.SIGHUP)
    poll_for(lambda: not console_children(daemon), 30, what="the console to stop")
    info = daemon.spool.root / "supervisor.json"
    poll_for(lambda: json.loads(info.read_text())["console"] is None, 10, what="its URL gone")
    assert daemon.run_cli("console").returncode == 1


def test_the_console_dies_with_the_daemon(tmp_path: Path, daemons: list[Daemon]) -> None:
    daemon = Daemon(tmp_path, config_text(extra=console_table(free_port())))
    daemons.append(daemon)
    daemon.start()
    (child,) = console_children(daemon)
    assert child.environ().get("ANTHROPIC_API_KEY") is None  # no secret in its environment
    daemon.kill()  # kill -9: the kernel ends the console too
    poll_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 15,
             what="the console to die with the daemon")  # fmt: skip


# -- the pure checks ----------------------------------------------------------------------


def test_sessions_expire_and_end() -> None:
    now = [1000.0]
    sessions = Sessions(60.0, clock=lambda: now[0])
    key, session = sessions.open("alice")
    assert sessions.get(key) == session and session.operator.via == "console"
    now[0] += 59.0
    assert sessions.get(key) is not None
    now[0] += 1.0
    assert sessions.get(key) is None  # expired: gone
    key, _ = sessions.open("alice")
    sessions.close(key)
    assert sessions.get(key) is None
    assert sessions.get("") is None and sessions.get("x" * 500) is None


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8770", True),
        ("LOCALHOST:8770", True),
        ("127.0.0.1", False),  # the listen address names its port
        ("127.0.0.1:8771", False),
        ("agentd.example.com", True),
        ("agentd.example.com:443", True),
        ("example.com", False),
        ("agentd.example.com.evil.test", False),
        ("user@127.0.0.1:8770", False),
        ("[::1]:8770", False),
        (None, False),
    ],
)
def test_the_host_check(host: str | None, allowed: bool) -> None:
    assert host_allowed(host, ("127.0.0.1", 8770), ["agentd.example.com"]) is allowed


@pytest.mark.parametrize(
    ("origin", "host", "tls", "allowed"),
    [
        (None, "127.0.0.1:8770", False, True),
        ("http://127.0.0.1:8770", "127.0.0.1:8770", False, True),
        ("http://127.0.0.1:8771", "127.0.0.1:8770", False, False),
        ("http://evil.test", "127.0.0.1:8770", False, False),
        ("null", "127.0.0.1:8770", False, False),
        ("https://agentd.example.com", "agentd.example.com", False, True),  # behind a proxy
        ("http://agentd.example.com", "agentd.example.com", True, False),
        ("https://agentd.example.com:443", "agentd.example.com", True, True),
    ],
)
def test_the_origin_check(origin: str | None, host: str, tls: bool, allowed: bool) -> None:
    assert origin_allowed(origin, host, tls=tls) is allowed


def test_config_check_loads_the_consoles_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    good = tmp_path / "good.toml"
    good.write_text(
        f'[console]\nlisten = "127.0.0.1:8770"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
    )
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[console]\nlisten = "127.0.0.1:8770"\ntls_cert = "{key}"\ntls_key = "{key}"\n')
    daemon = Daemon(tmp_path / "d", config_text())
    done = daemon.run_cli("config", "check", str(good))
    assert done.returncode == 0 and "console on 127.0.0.1:8770 over TLS" in done.stdout, done
    done = daemon.run_cli("config", "check", str(bad))
    assert done.returncode == 78 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"agentd: {bad}: console.tls_cert") and "cannot be served" in line
