"""HTTP/1.1 as the console speaks it: a request read within limits, a response written.

The console serves one page and a JSON API to browsers and scripts, on the standard
library's asyncio streams (docs/design.md section 12 says why no server library): this
module is the whole of its HTTP, and it accepts only what those clients send.

* A request's head (its line and headers) is at most ``HEAD_LIMIT`` bytes, read whole
  within ``HEAD_TIMEOUT`` seconds of the connection (``IDLE_TIMEOUT`` of the last answer
  on a kept-open one): a client that trickles it (slowloris) or says nothing is cut off.
  A body is announced by ``Content-Length``, at most ``BODY_LIMIT`` bytes (else 413,
  before a byte of it is read), and read within ``BODY_TIMEOUT``. A chunked body, a
  second ``Content-Length`` or ``Host``, a header folded over two lines, a target that
  is not a path: 400, and the connection closes.
* Methods: GET, HEAD and POST (else 405); versions 1.0 and 1.1 (else 505).
* A connection is kept open between requests as HTTP/1.1 says; after any refusal of
  this module it is closed.

``HttpError`` carries a refusal's status and its one line; the caller turns it into a
response (``supervisor.console.app``), so that every refusal has the same JSON shape.
"""

from __future__ import annotations

import asyncio
import email.utils
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

#: The most bytes of a request line and its headers.
HEAD_LIMIT = 16 * 1024
#: The most bytes of a request body: a recorded result may have 1 MiB of text, which
#: JSON escaping may grow.
BODY_LIMIT = 4 * 1024 * 1024
#: Seconds to read a request's head (from when the connection is ready for one), and its body.
HEAD_TIMEOUT = 10.0
BODY_TIMEOUT = 30.0
#: Seconds a kept-open connection may take to send its next request whole.
IDLE_TIMEOUT = 15.0
#: Seconds a response (or an event of a stream) may take to be written.
WRITE_TIMEOUT = 10.0

METHODS = ("GET", "HEAD", "POST")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: Headers a request may carry once only: a second one is how smuggling begins.
_SINGLE = ("host", "content-length", "transfer-encoding", "authorization", "origin", "cookie")


class HttpError(Exception):
    """A refusal: ``status`` and the one line that says why and what to do."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # percent-decoded, without the query
    query: Mapping[str, str]  # the first value of each name
    headers: Mapping[str, str]  # lower-case names
    body: bytes
    client: str  # the peer's address
    keep_alive: bool
    target: str  # as sent: the path and the query

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def cookies(self) -> dict[str, str]:
        jar: dict[str, str] = {}
        for part in (self.headers.get("cookie") or "").split(";"):
            name, eq, value = part.strip().partition("=")
            if eq and name and name not in jar:
                jar[name] = value.strip().strip('"')
        return jar


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


async def read_request(reader: asyncio.StreamReader, client: str, *, first: bool) -> Request | None:
    """The next request on the connection; None when the client closed it (or, for a
    kept-open one, stayed silent past ``IDLE_TIMEOUT``) before sending one."""
    try:
        async with asyncio.timeout(HEAD_TIMEOUT if first else IDLE_TIMEOUT):
            head = await reader.readuntil(b"\r\n\r\n")
    except TimeoutError:
        if first:
            raise HttpError(
                HTTPStatus.REQUEST_TIMEOUT, "the request took too long to come"
            ) from None
        return None
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise HttpError(HTTPStatus.BAD_REQUEST, "the request ended inside its headers") from None
    except asyncio.LimitOverrunError:
        raise HttpError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"the request's headers are over {HEAD_LIMIT} bytes",
        ) from None
    method, target, version, headers = _parse_head(head)
    length = _content_length(headers)
    body = b""
    if length:
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                body = await reader.readexactly(length)
        except (TimeoutError, asyncio.IncompleteReadError):
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "the request's body did not come whole"
            ) from None
    path, _, query = target.partition("?")
    try:
        decoded = unquote(path, errors="strict")
    except UnicodeDecodeError:
        decoded = "\0"
    if not decoded.isprintable():
        raise HttpError(HTTPStatus.BAD_REQUEST, "the request's path holds control characters")
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return Request(
        method=method,
        path=decoded,
        query=dict(reversed(parse_qsl(query, keep_blank_values=True))),
        headers=headers,
        body=body,
        client=client,
        keep_alive=keep,
        target=target,
    )


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    text = head.decode("latin-1")  # (every byte is a latin-1 character)
    line, *lines = text[:-4].split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3:
        raise HttpError(HTTPStatus.BAD_REQUEST, "the request line is not METHOD PATH VERSION")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.1 and 1.0 are spoken")
    if method not in METHODS:
        raise HttpError(
            HTTPStatus.METHOD_NOT_ALLOWED, f"{method[:20]!r} is not a method the console takes"
        )
    if not target.startswith("/") or len(target) > 4096:
        raise HttpError(HTTPStatus.BAD_REQUEST, "the request's target is not a path")
    headers: dict[str, str] = {}
    for raw in lines:
        name, colon, value = raw.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise HttpError(HTTPStatus.BAD_REQUEST, "a request header is not NAME: VALUE")
        name = name.lower()
        value = value.strip(" \t")
        if name in headers:
            if name in _SINGLE:
                raise HttpError(HTTPStatus.BAD_REQUEST, f"the {name} header is given twice")
            headers[name] += ", " + value
        else:
            headers[name] = value
    if version == "HTTP/1.1" and "host" not in headers:
        raise HttpError(HTTPStatus.BAD_REQUEST, "an HTTP/1.1 request names its Host")
    return method, target, version, headers


def _content_length(headers: Mapping[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise HttpError(
            HTTPStatus.BAD_REQUEST, "a chunked body is not taken: send it with Content-Length"
        )
    value = headers.get("content-length", "0")
    if not value.isascii() or not value.isdigit() or len(value) > 12:
        raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number of bytes")
    length = int(value)
    if length > BODY_LIMIT:
        raise HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request's body is {length} bytes, over the {BODY_LIMIT // (1024 * 1024)} MiB "
            "a request may carry",
        )
    return length


def head_bytes(
    status: int, headers: list[tuple[str, str]], *, length: int | None, keep_alive: bool
) -> bytes:
    """A response's status line and headers (``length`` None: a stream, no length)."""
    phrase = HTTPStatus(status).phrase
    lines = [f"HTTP/1.1 {status} {phrase}", f"Date: {email.utils.formatdate(usegmt=True)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def write(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write ``data`` and wait until the peer took it, within ``WRITE_TIMEOUT``."""
    writer.write(data)
    async with asyncio.timeout(WRITE_TIMEOUT):
        await writer.drain()
