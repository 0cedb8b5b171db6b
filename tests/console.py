"""The console under test (docs/design.md section 12): a real daemon serving it, and a
client that speaks to it as a browser or a script does (``http.client``: every header is
the test's to choose, a wrong Host or a foreign Origin too).

Shared by the console's tests (``tests/supervisor/test_console*.py``) and its benchmark.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.daemon import Daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def console_table(port: int, extra: str = "") -> str:
    return f'[console]\nlisten = "127.0.0.1:{port}"\n{extra}'


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Client:
    """A browser's or a script's view of one console: its address, the cookies it was
    given, its CSRF token, its bearer token."""

    port: int
    tls: ssl.SSLContext | None = None
    cookies: dict[str, str] = field(default_factory=dict)
    csrf: str = ""
    bearer: str = ""
    host: str | None = None  # the Host header (default: 127.0.0.1:PORT)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        raw: bytes | None = None,
    ) -> Answer:
        if self.tls is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, timeout=60, context=self.tls
            )
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        sent = {"Host": self.host if self.host is not None else f"127.0.0.1:{self.port}"}
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if self.bearer:
            sent["Authorization"] = f"Bearer {self.bearer}"
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        if method == "POST" and self.csrf:
            sent["X-CSRF-Token"] = self.csrf
        if data is not None:
            sent["Content-Length"] = str(len(data))
        sent.update(headers or {})
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in sent.items():
                conn.putheader(name, value)
            conn.endheaders(data)
            response = conn.getresponse()
            answer = Answer(response.status, response.getheaders(), response.read())
        finally:
            conn.close()
        for value in answer.all("Set-Cookie"):
            name, _, rest = value.partition("=")
            cookie = rest.split(";")[0]
            if "Max-Age=0" in value:
                self.cookies.pop(name, None)
            else:
                self.cookies[name] = cookie
        return answer

    def get(self, path: str, **kw: Any) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Answer:
        return self.request("POST", path, body if body is not None else {}, **kw)

    def login(self, url: str) -> Answer:
        """Open a login URL of ``agentd console``; then fetch the session's CSRF token."""
        parts = urlsplit(url)
        answer = self.get(f"{parts.path}?{parts.query}")
        if answer.status == 303:
            self.csrf = str(self.get("/api/session").json()["csrf"])
        return answer


def login_url(daemon: Daemon, env: dict[str, str] | None = None) -> str:
    done = daemon.run_cli("console", env=env)
    assert done.returncode == 0, done
    return done.stdout.strip()


def logged_in(daemon: Daemon, port: int, env: dict[str, str] | None = None) -> Client:
    client = Client(port)
    assert client.login(login_url(daemon, env)).status == 303
    return client


def api_token(daemon: Daemon, env: dict[str, str] | None = None) -> str:
    done = daemon.run_cli("console", "--token", env=env)
    assert done.returncode == 0, done
    return done.stdout.strip()


def self_signed(folder: Path, name: str = "localhost") -> tuple[Path, Path]:
    """A certificate for ``name`` (and 127.0.0.1) and its key, made by openssl."""
    cert, key = folder / "console.crt", folder / "console.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name},IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
