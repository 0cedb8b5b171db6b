"""The console as an application: what each request gets (docs/design.md section 12).

``Console.respond`` takes a parsed request (``supervisor.console.http``) and returns a
``Response``, or a ``Stream`` for ``GET /api/stream``. It is where the checks of
``supervisor.console.auth`` are made, in their order, before anything is read:

    Host -> Origin (and Sec-Fetch-Site of a POST) -> credentials -> CSRF of a cookie's POST

then one of:

* ``GET /?token=T`` (or any page path): the one-time login of ``agentd console``; a
  session cookie is set and the browser sent to the same path without the token. A
  ``HEAD`` of it (a chat's link previewer looks before the person clicks) is answered
  without taking the ticket or setting a cookie;
* ``GET /``: the page (``static/console.html``, with the session's CSRF token in it), for
  a session; ``GET /static/...``: its script and style sheet (no secret in them: served
  to anyone who passes the Host check);
* ``POST /logout``: the session ends;
* ``GET /api/session``: who the page acts for, and its CSRF token;
* ``GET /api/stream``: server-sent events, one ``task`` event per change of a task's row
  (``supervisor.console.feed``);
* the JSON API of ``supervisor.console.api``, run on a thread of ``pool``.

Every answer carries headers that keep a browser from doing more with it than the page
does (no framing, no sniffing, no referrer, no caching, a content security policy that
allows this origin's script and nothing else) and no CORS header, so a page of another
origin cannot read one. Every JSON answer passes the redactor. What a person does is
logged by the actions themselves (their events carry ``by`` and ``via``); logins are
``console_login`` and ``console_login_failed`` (``Announcer``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from importlib import resources
from typing import Any, TextIO

from supervisor.console import READY, api
from supervisor.console.auth import (
    Session,
    Sessions,
    cookie_name,
    csrf_matches,
    host_allowed,
    origin_allowed,
    session_cookie,
)
from supervisor.console.feed import RowFeed
from supervisor.console.http import HttpError, Request, Response
from supervisor.console.tokens import LoginTickets, TokenStore, bearer
from supervisor.operator import Operator, Via
from worker.config import Config
from worker.errors import AgentdError
from worker.events import Event
from worker.redactor import redact
from worker.spool import Spool
from worker.store.durable import dump_json

#: What every answer says about itself.
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    ),
)
#: The page's files, by the path they are served at, with their type.
STATIC = {
    "/static/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/static/console.css": ("console.css", "text/css; charset=utf-8"),
}
#: Paths of the page itself (the views are chosen by the fragment: ``/#/tasks/ID``).
PAGES = ("/", "/index.html")
#: At most this many ``console_login_failed`` lines a minute; the rest are counted.
FAILED_LOGINS_PER_MINUTE = 10
#: Streams open at once; more are refused (503) until one ends.
MAX_STREAMS = 32
#: What a HEAD of a login URL is told (a link previewer's: only a GET takes the ticket).
LOGIN_LINK = "a one-time login link of agentd's console: open it in a browser to log in"
NOT_LOGGED_IN = (
    "not logged in: open the URL `agentd console` prints on the daemon's machine, or "
    "send Authorization: Bearer TOKEN (`agentd console --token`)"
)


@dataclass(frozen=True)
class Stream:
    """``GET /api/stream``'s answer: the server writes the feed's rows to it while
    ``alive`` says the credentials it was opened with still hold (``reads``: it reads the
    store, so it runs off the loop; a session's check is the loop's own)."""

    alive: Callable[[], bool]
    reads: bool = False


class Announcer:
    """The console's own events (``console_login``, ``console_login_failed``), one JSON
    object a line on ``out``: the pipe the daemon reads and logs them from, in its own
    stream. Failed logins are at most ``FAILED_LOGINS_PER_MINUTE`` lines a minute (a
    flood of bad tokens never floods the log); the next line says how many were not."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.clock = clock
        self._window = (0.0, 0)  # (start of the minute, lines in it)
        self._unsaid = 0

    def _event(self, event: Event, level: str = "info", **fields: Any) -> None:
        self._send({"event": event, "level": level, **fields})

    def _send(self, said: dict[str, Any]) -> None:
        line = dump_json(said).decode()
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (OSError, ValueError):  # the daemon is gone: the console is on its way out
            pass

    def login(self, by: str, via: Via, client: str) -> None:
        self._event(Event.CONSOLE_LOGIN, by=by, via=str(via), client=client)

    def failed(self, why: str, client: str) -> None:
        start, said = self._window
        now = self.clock()
        if now - start >= 60.0:
            start, said = now, 0
        if said >= FAILED_LOGINS_PER_MINUTE:
            self._unsaid += 1
            self._window = (start, said)
            return
        fields: dict[str, Any] = {"why": why, "client": client}
        if self._unsaid:
            fields["not_logged"] = self._unsaid
            self._unsaid = 0
        self._event(Event.CONSOLE_LOGIN_FAILED, "warning", **fields)
        self._window = (start, said + 1)

    def ready(self, url: str) -> None:
        """Tell the daemon the console serves (it logs ``console_serving``)."""
        self._send({"event": READY, "url": url})

    def failed_to_start(self, error: str) -> None:
        """The console cannot serve (its TLS files, say): the one line the daemon says."""
        self._event(Event.CONSOLE_FAILED, "error", error=error)

    def error(self, path: str, exc: BaseException) -> None:
        """A request the console could not answer (a bug): 500, and this line."""
        self._event(Event.CONSOLE_ERROR, "error", path=path, error=repr(exc)[:500])


class Console:
    """One console: its address, its credentials, its feed, and the threads its API runs on."""

    def __init__(
        self,
        spool: Spool,
        config: Config,
        *,
        host: str,
        port: int,
        tokens: TokenStore,
        announce: Announcer,
        pool: concurrent.futures.Executor,
    ) -> None:
        self.spool = spool
        self.config = config
        self.host, self.port = host, port  # where it listens (the port: a 0 bound)
        self.tokens = tokens
        self.tickets = LoginTickets(spool)
        self.announce = announce
        self.pool = pool
        self.sessions = Sessions(config.console.session_timeout)
        self.feed = RowFeed(spool, self.off_loop, lambda: self.config.price_table)
        self.streams = 0

    @property
    def tls(self) -> bool:
        return self.config.console.tls

    @property
    def cookie(self) -> str:
        return cookie_name(self.port, tls=self.tls)

    def reconfigure(self, config: Config) -> None:
        """A reload's config (its listen and TLS are the same: else a new console)."""
        self.config = config
        self.sessions.timeout = config.console.session_timeout

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on one of the console's threads: what reads or waits on the store."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    # -- a request ------------------------------------------------------------------------

    async def respond(self, request: Request) -> Response | Stream:
        try:
            return await self._respond(request)
        except (AgentdError, OSError) as exc:  # a token's lookup in a store away, a bad form
            answer = api.refusal(exc, self.spool)
            if answer is None:
                raise
            status, body, said = answer
            return refused(status, body, said)
        except PageRefusal as exc:  # a person opened it: the line, as a page
            page = _page("agentd", exc.message)
            return Response(exc.status, page, "text/html; charset=utf-8", [*exc.headers.items()])
        except HttpError as exc:
            return refused(exc.status, {"error": exc.message}, exc.headers)

    async def _respond(self, request: Request) -> Response | Stream:
        host = request.header("host")
        if not host_allowed(host, (self.host, self.port), self.config.console.hostnames):
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                f"this console is not served as {(host or '')[:80]!r}; use the URL `agentd "
                "console` prints, or add the name to [console] hostnames and reload",
            )
        if not origin_allowed(request.header("origin"), host, tls=self.tls) or (
            request.method == "POST" and request.header("sec-fetch-site") == "cross-site"
        ):
            raise HttpError(
                HTTPStatus.FORBIDDEN, "a page of another site may not send requests here"
            )
        path = request.path
        if path in STATIC and request.method in ("GET", "HEAD"):
            name, kind = STATIC[path]
            return Response(HTTPStatus.OK, _static(name), kind)
        if request.method in ("GET", "HEAD") and "token" in request.query and path in PAGES:
            if request.method == "HEAD":  # a link previewer's look: the ticket stays
                page = _page("agentd", LOGIN_LINK)
                return Response(HTTPStatus.OK, page, "text/html; charset=utf-8")
            return await self._login(request)
        if path == "/logout" and request.method == "POST":
            return self._logout(request)
        operator, session = await self._credentials(request)
        if request.method == "POST" and session is not None:
            body_csrf = None
            if "form" in (request.header("content-type") or ""):
                body_csrf = api.parse_body(request.body, request.header("content-type")).get("csrf")
            if not csrf_matches(session, request.header("x-csrf-token") or body_csrf):
                raise HttpError(
                    HTTPStatus.FORBIDDEN,
                    "the CSRF token is missing or wrong; reload the page (a form of another "
                    "page may not act here)",
                )
        if path in PAGES and request.method in ("GET", "HEAD"):
            # the session's CSRF token is in the page (a meta tag, the logout form's field):
            # no page of another origin can read it
            csrf = session.csrf.encode() if session is not None else b""
            page = _static("console.html").replace(b"{{csrf}}", csrf)
            return Response(HTTPStatus.OK, page, "text/html; charset=utf-8")
        if path == "/api/session" and request.method in ("GET", "HEAD"):
            return self._json(HTTPStatus.OK, _whoami(operator, session, self.sessions))
        if path == "/api/stream" and request.method == "GET":
            return self._stream(request, session)
        return await self._api(request, operator)

    async def _credentials(self, request: Request) -> tuple[Operator, Session | None]:
        """Who the request acts for: its session, or its API token; else 401."""
        auth = request.header("authorization")
        if auth is not None:
            scheme, _, value = auth.partition(" ")
            token = None
            if scheme.lower() == "bearer":
                token = await self.off_loop(lambda: bearer(self.tokens, value.strip()))
            if token is None:
                self.announce.failed("an unknown or revoked API token", request.client)
                raise HttpError(
                    HTTPStatus.UNAUTHORIZED,
                    "the API token is unknown or revoked; `agentd console --list-tokens` "
                    "lists the tokens kept, `agentd console --token` mints one",
                    {"WWW-Authenticate": 'Bearer realm="agentd"'},
                )
            return Operator(token.by, Via.API), None
        session = self.sessions.get(request.cookies().get(self.cookie))
        if session is None:
            if request.path in PAGES:
                raise PageRefusal(HTTPStatus.UNAUTHORIZED, NOT_LOGGED_IN)
            raise HttpError(
                HTTPStatus.UNAUTHORIZED,
                NOT_LOGGED_IN,
                {"WWW-Authenticate": 'Bearer realm="agentd"'},
            )
        return session.operator, session

    async def _login(self, request: Request) -> Response:
        ticket = request.query["token"]
        by = await self.off_loop(lambda: self.tickets.redeem(ticket))
        if by is None:
            self.announce.failed(
                "a login link that was used, expired or never made", request.client
            )
            raise PageRefusal(
                HTTPStatus.UNAUTHORIZED,
                "this login link was used already or has expired; `agentd console` prints "
                "a new one",
            )
        key, session = self.sessions.open(by)
        self.announce.login(by, Via.CONSOLE, request.client)
        cookie = session_cookie(self.cookie, key, self.sessions.remaining(session), tls=self.tls)
        headers = [("Location", request.path), ("Set-Cookie", cookie)]
        return Response(HTTPStatus.SEE_OTHER, b"", "text/plain", headers)

    def _logout(self, request: Request) -> Response:
        key = request.cookies().get(self.cookie)
        session = self.sessions.get(key)
        if session is not None:
            sent = request.header("x-csrf-token") or api.parse_body(
                request.body, request.header("content-type")
            ).get("csrf")
            if not csrf_matches(session, sent):
                raise HttpError(HTTPStatus.FORBIDDEN, "the CSRF token is missing or wrong")
            self.sessions.close(key)
        cleared = session_cookie(self.cookie, "", 0, tls=self.tls)
        page = _page("Logged out", "Logged out. `agentd console` prints a new login link.")
        return Response(HTTPStatus.OK, page, "text/html; charset=utf-8", [("Set-Cookie", cleared)])

    def _stream(self, request: Request, session: Session | None) -> Stream:
        if self.streams >= MAX_STREAMS:
            raise HttpError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"{MAX_STREAMS} streams are open already; close a page and try again",
                {"Retry-After": "10"},
            )
        if session is None:  # a token's stream: it ends when the token is revoked
            secret = (request.header("authorization") or "").partition(" ")[2].strip()
            return Stream(lambda: bearer(self.tokens, secret) is not None, reads=True)
        key = request.cookies().get(self.cookie)
        return Stream(lambda: self.sessions.get(key) is not None)

    async def _api(self, request: Request, operator: Operator) -> Response:
        found = next(
            ((route, task_id) for route in api.ROUTES
             if (task_id := route.match(request.method, request.path)) is not None),
            None,
        )  # fmt: skip
        if found is None:
            if request.path.startswith("/api/"):
                raise HttpError(
                    HTTPStatus.NOT_FOUND, f"no {request.method} {request.path[:80]} here"
                )
            raise PageRefusal(HTTPStatus.NOT_FOUND, "no such page; the console is at /")
        route, task_id = found

        def run() -> dict[str, Any]:
            body = api.parse_body(request.body, request.header("content-type"))
            call = api.Call(self.spool, self.config, operator, task_id, body, request.query)
            answer = {"data": route.run(call)}
            return answer if route.redacted else redact.clean_prose(answer)

        try:
            data = await self.off_loop(run)
        except Exception as exc:  # (each is answered; a bug is logged too)
            answer = api.refusal(exc, self.spool)
            if answer is None:
                self.announce.error(request.path, exc)
                answer = (HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error: "
                          "the daemon's log says more"}, {})  # fmt: skip
            status, body_out, headers = answer
            return refused(status, redact.clean_prose(body_out), headers)
        return self._json(route.status, data["data"])

    def _json(self, status: int, data: Any) -> Response:
        return Response(status, dump_json(data))


def refused(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    """A refusal: its JSON body (``{"error": ONE LINE}``) and headers."""
    return Response(status, dump_json(body), "application/json", list((headers or {}).items()))


class PageRefusal(HttpError):
    """A refusal of a page a person opened: said in HTML, the same one line."""


def _whoami(operator: Operator, session: Session | None, sessions: Sessions) -> dict[str, Any]:
    answer: dict[str, Any] = {"by": operator.by, "via": str(operator.via)}
    if session is not None:
        answer |= {"csrf": session.csrf, "expires_in": round(sessions.remaining(session))}
    return answer


def _static(name: str) -> bytes:
    return (resources.files("supervisor.console") / "static" / name).read_bytes()


def _page(title: str, text: str) -> bytes:
    import html  # noqa: PLC0415  (only the few pages of text need it)

    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>agentd: '
        f'{html.escape(title)}</title><link rel="stylesheet" href="/static/console.css"></head>'
        f'<body class="notice"><main><h1>agentd</h1><p>{html.escape(text)}</p></main></body></html>'
    ).encode()
