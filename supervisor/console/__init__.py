"""The console: a web page and a JSON API over every task (docs/design.md section 12).

It is a process of its own, which the daemon starts when ``[console] listen`` is set and
watches like its other children::

    daemon (supervisor.daemon)                   python -m supervisor.console
    ┌───────────────────────────────┐  socket fd ┌──────────────────────────────────────┐
    │ ConsoleProcess (process.py):  │ ─────────► │ ConsoleServer (server.py): asyncio,   │
    │  binds the listen address,    │  store URL │  bounded connections, http.py limits  │
    │  starts, restarts, stops it;  │ ─(pipe)──► │ Console (app.py): Host, Origin,       │
    │  logs what it says            │ ◄──lines── │  credentials (auth.py, tokens.py),    │
    └───────────────────────────────┘   events   │  CSRF; the page (static/); the API    │
                                                 │  (api.py) on threads, the CLI's code; │
                                                 │  the change feed (feed.py) for SSE    │
                                                 └──────────────────────────────────────┘

So a slow or hostile client, a crowd of half-open connections or a heavy read costs the
console's process, never a moment of the daemon's loop, and the console reads and acts
exactly as the CLI does (the same functions, the same store: on a shared store the whole
cluster). ``agentd console`` (``supervisor.commands.console``) prints its URL with a one-time login,
or mints, lists and revokes API tokens (``tokens.py``).
"""

from __future__ import annotations

import ipaddress
import socket

from worker.config import ConsoleConfig
from worker.events import Event

#: What the console's process says to the daemon once it serves (no event of the log:
#: the daemon logs ``console_serving`` for it, with the URL).
READY = Event.CONSOLE_READY


def console_url(console: ConsoleConfig, port: int) -> str:
    """The URL a browser opens the console at: the listen address, or, for an address of
    every interface, the first of ``[console] hostnames`` (else this machine's name)."""
    address = console.address
    host = address[0] if address is not None else "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):  # noqa: S104  (a name to give, not an address to bind)
        host = console.hostnames[0] if console.hostnames else socket.getfqdn()
    elif console.hostnames and console.tls:
        host = console.hostnames[0]  # (the name its certificate has)
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{'https' if console.tls else 'http'}://{host}:{port}/"
