"""sd_notify: tell systemd how the supervisor is doing, over ``$NOTIFY_SOCKET``.

The protocol is one datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket that
systemd names in ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).
It is small enough to speak directly, so there is no dependency on libsystemd.

Outside systemd (no ``$NOTIFY_SOCKET``) every method is a no-op that returns False.
Sending never raises and never blocks: a full or vanished socket is not worth
disturbing the daemon for, so each method returns whether the datagram went out.

The unit uses ``Type=notify`` and ``WatchdogSec=``: send ``ready()`` once the
supervisor serves, ``watchdog()`` from its main loop every ``watchdog_interval()``
seconds (half of ``WatchdogSec=``), ``status()`` with a one-line summary when it
changes, and ``stopping()`` when a stop begins.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

#: The variables systemd passes to the notifying process. Workers must not inherit them:
#: strip these from a child's environment so only the supervisor speaks for the unit.
NOTIFY_ENVIRONMENT = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """A client of systemd's notification socket, read from the environment once.

    ``environ`` and ``pid`` default to this process's; tests pass their own.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, *, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog = _watchdog_seconds(env, os.getpid() if pid is None else pid)

    @property
    def enabled(self) -> bool:
        """Whether there is a socket to talk to (the process runs under systemd)."""
        return self._address is not None

    def ready(self) -> bool:
        """The supervisor serves: systemd may consider the start complete."""
        return self.notify("READY=1")

    def stopping(self) -> bool:
        """A graceful stop has begun."""
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        """A one-line summary for ``systemctl status`` (line breaks become spaces)."""
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self) -> bool:
        """Keep-alive for ``WatchdogSec=``: the main loop is still turning."""
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between two ``watchdog()`` pings, or None when no watchdog is armed.

        This is half of ``WatchdogSec=`` (``$WATCHDOG_USEC``, when ``$WATCHDOG_PID`` is
        unset or names this process), as sd_watchdog_enabled(3) advises, so one late
        tick does not get the unit killed. Callers use it as their ping period as is.
        """
        return None if self._watchdog is None else self._watchdog / 2

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram; True if it was sent."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(payload, self._address)
        except OSError:
            return False
        return True


def _address(raw: str) -> str | None:
    """The socket address of ``$NOTIFY_SOCKET``: a path, or '@' for the abstract namespace."""
    if raw.startswith("@") and len(raw) > 1:
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # unset, or a transport this client does not speak (vsock:...)


def _watchdog_seconds(env: Mapping[str, str], pid: int) -> float | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if watchdog_pid and watchdog_pid != str(pid):
        return None  # the watchdog belongs to another process (our parent, say)
    return usec / 1_000_000
