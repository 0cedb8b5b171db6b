"""Who may use the console, and the checks every request passes (docs/design.md section 12).

In the order a request meets them:

1. ``host_allowed``: the ``Host`` header is the listen address, ``localhost`` (on the
   listen port), or one of ``[console] hostnames`` (any port: a reverse proxy's). Else 403:
   a page of another name that resolves here (DNS rebinding) reaches nothing.
2. ``origin_allowed``: an ``Origin``, when the browser sends one, names this same host;
   and a POST that says ``Sec-Fetch-Site: cross-site`` is refused. Else 403.
3. Credentials: a session cookie (``Sessions``, opened by a one-time login URL of
   ``agentd console``), or ``Authorization: Bearer TOKEN`` (an API token,
   ``supervisor.console.tokens``). Neither, or one not known (expired, revoked): 401.
4. ``csrf_matches``: a POST made with the session cookie carries the session's CSRF token
   in ``X-CSRF-Token`` or the form field ``csrf`` (a cookie is sent with any top-level
   form a page posts here: SameSite=Lax allows that), compared in constant time. Else
   403. A bearer token is no cookie: a page elsewhere cannot send it.

A session lives in this process's memory only (a restart of the console logs everyone
out), for ``[console] session_timeout`` seconds; ``logout`` ends it. Its cookie,
``agentd-session-PORT`` (``__Host-agentd-session-PORT`` under TLS, with ``Secure``), is
``HttpOnly`` and ``SameSite=Lax``: a link from elsewhere (a chat message of the
``on_held`` hook) opens the page logged in, and no script reads the cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from supervisor.operator import Operator, Via

#: The most sessions kept at once: past it, the oldest is dropped (its owner logs in again).
MAX_SESSIONS = 1000


@dataclass(frozen=True)
class Session:
    """A logged-in browser: who opened the console, its CSRF token, when it ends."""

    by: str
    csrf: str
    expires: float  # on the sessions' clock (monotonic)

    @property
    def operator(self) -> Operator:
        return Operator(self.by, Via.CONSOLE)


class Sessions:
    """The sessions of this console, by the SHA-256 of their cookie's value."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._open: OrderedDict[str, Session] = OrderedDict()

    def open(self, by: str) -> tuple[str, Session]:
        """A new session for ``by``: the cookie's value, and the session."""
        key = secrets.token_urlsafe(32)
        session = Session(by, secrets.token_urlsafe(32), self.clock() + self.timeout)
        self._open[_digest(key)] = session
        while len(self._open) > MAX_SESSIONS:
            self._open.popitem(last=False)
        return key, session

    def get(self, key: str | None) -> Session | None:
        """The live session of the cookie value ``key``, or None (unknown, expired: gone)."""
        if not key or len(key) > 128:
            return None
        digest = _digest(key)
        session = self._open.get(digest)
        if session is not None and session.expires <= self.clock():
            del self._open[digest]
            return None
        return session

    def close(self, key: str | None) -> None:
        if key:
            self._open.pop(_digest(key), None)

    def remaining(self, session: Session) -> float:
        return max(0.0, session.expires - self.clock())


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def cookie_name(port: int, *, tls: bool) -> str:
    """``agentd-session-PORT``: one per console on a machine (a browser keeps cookies by
    host, not by port); under TLS with the ``__Host-`` prefix, which a browser accepts
    only from a secure origin, for the whole host, never from a sibling domain."""
    return f"{'__Host-' if tls else ''}agentd-session-{port}"


def session_cookie(name: str, value: str, max_age: float, *, tls: bool) -> str:
    """A ``Set-Cookie`` value for the session (``max_age`` 0: ends it)."""
    secure = "; Secure" if tls else ""
    return f"{name}={value}; Path=/; Max-Age={int(max_age)}; HttpOnly; SameSite=Lax{secure}"


# -- Host and Origin ------------------------------------------------------------------------


def split_host(value: str) -> tuple[str, int | None] | None:
    """``Host``'s name (lower case, an IPv6 address without brackets) and port (None when
    none is given); None when it is not a host."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, colon, port_text_or = value.partition(":")
        port_text = port_text_or if colon else None
    if not name or any(c.isspace() or c in "/@\\" for c in name):
        return None
    if port_text is None:
        return name, None
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


def host_allowed(host: str | None, listen: tuple[str, int], hostnames: Iterable[str]) -> bool:
    """Whether a request's ``Host`` names this console (the module's check 1)."""
    if not host:
        return False
    split = split_host(host)
    if split is None:
        return False
    name, port = split
    listen_host, listen_port = listen
    if name in (listen_host.lower(), "localhost"):
        return port == listen_port
    return name in {h.lower().strip("[]") for h in hostnames}


def origin_allowed(origin: str | None, host: str | None, *, tls: bool) -> bool:
    """Whether an ``Origin`` (absent: allowed) names the host the request was sent to
    (its ``Host``, checked already): the page that sends it is this console's own. The
    scheme is this console's, or https for a name a proxy serves over TLS."""
    if origin is None:
        return True
    if not host or origin == "null":
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or parts.path or parts.query:
        return False
    default = {"http": 80, "https": 443}[parts.scheme]
    want = split_host(host)
    got = split_host(parts.netloc)
    if want is None or got is None:
        return False
    if parts.scheme == "http" and tls:
        return False  # a page of plain http never posts to a TLS console
    return (got[0], got[1] or default) == (want[0], want[1] or default)


def csrf_matches(session: Session, sent: str | None) -> bool:
    """Whether ``sent`` is the session's CSRF token (compared in constant time)."""
    return bool(sent) and hmac.compare_digest(session.csrf.encode(), (sent or "").encode())
