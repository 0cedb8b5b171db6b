"""The console's credentials (docs/design.md section 12): API tokens and one-time logins.

* An **API token** (``agentd console --token``) is for a script: ``Authorization: Bearer
  TOKEN``. It is printed once and kept only as its SHA-256 (``digest``; a token is 256
  random bits, so a plain hash is as good as a slow one), with an id (what ``--list-tokens``
  shows and ``--revoke ID`` takes), who minted it (what its actions record as ``by``,
  section 15) and when. On the spool's files they are kept in ``SPOOL/console/tokens.json``
  (0600, written whole under a lock); on a shared store in its ``console_tokens`` table
  (``SharedStore.add_token``...), so that every node's console accepts them.
* A **login ticket** (``agentd console``) opens the page once: the URL it prints carries a
  secret whose digest names a file of ``SPOOL/console/logins`` (until when, ``LOGIN_TTL``;
  who asked is the file's owner). The console takes it by removing that file: of two
  requests with the same URL, one logs in. Only a GET takes it: a HEAD (a link
  previewer's look at the URL) is answered without it. Tickets are local to the node
  whose console the URL names.

Nothing here ever holds a token or a ticket once it is handed out: only digests are
kept, compared by lookup, and no answer of the console carries one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from supervisor.operator import user_name
from worker.errors import NotFoundError, RecordConflictError, UsageError
from worker.events import utc_now
from worker.spool import Spool
from worker.store.base import JSON
from worker.store.durable import (
    atomic_write_json,
    dump_json,
    load_json,
    open_private,
    open_regular,
    private_dir,
    read_json,
    write_exclusive,
)

#: How every API token begins (a secret scanner can recognise one): then 43 characters.
TOKEN_PREFIX = "agentd_"  # noqa: S105  (a prefix, not a secret)
#: Seconds a login URL of ``agentd console`` can be opened in.
LOGIN_TTL = 300.0
#: An API token's id: what ``--list-tokens`` shows and ``--revoke`` takes.
TOKEN_ID = re.compile(r"tok-[0-9a-f]{8}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: Bytes of a login ticket's file read at most (it is a few dozen).
TICKET_LIMIT = 4096


def digest(secret: str) -> str:
    """The SHA-256 of a token or ticket, in hex: all that is kept of it."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class ApiToken:
    """An API token as kept: never the token itself."""

    id: str
    digest: str
    by: str
    created_at: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "digest": self.digest, "by": self.by, "created_at": self.created_at}

    @classmethod
    def of(cls, data: Any) -> ApiToken | None:
        """The token ``data`` keeps, or None when it is not one (damage, another shape)."""
        if not isinstance(data, dict):
            return None
        fields = [data.get(k) for k in ("id", "digest", "by", "created_at")]
        texts = [f for f in fields if isinstance(f, str) and f]
        return cls(*texts) if len(texts) == len(fields) else None


class TokenStore(Protocol):
    """Where API tokens are kept: ``SpoolTokens``, or a shared store (every node's)."""

    def add_token(self, token: JSON) -> None: ...

    def tokens(self) -> list[JSON]: ...

    def token(self, digest: str) -> JSON | None: ...

    def revoke_token(self, token_id: str) -> bool: ...


class SpoolTokens:
    """API tokens in ``SPOOL/console/tokens.json``: changed whole under ``tokens.lock``,
    read without it (the file is replaced atomically), and kept in memory between reads
    while the file is the same (``token`` is asked at every request with a token)."""

    def __init__(self, spool: Spool) -> None:
        self.folder = spool.root / "console"
        self.path = self.folder / "tokens.json"
        self._seen: tuple[tuple[int, int, int], list[JSON]] | None = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = open_private(private_dir(self.folder) / "tokens.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def tokens(self) -> list[JSON]:
        try:
            stat = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return []
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._seen is not None and self._seen[0] == key:
            return self._seen[1]
        try:
            data = read_json(self.path)
        except (OSError, ValueError):
            data = None
        kept = [t for t in (data if isinstance(data, list) else []) if ApiToken.of(t)]
        self._seen = (key, kept)
        return kept

    def token(self, digest: str) -> JSON | None:
        return next((t for t in self.tokens() if t["digest"] == digest), None)

    def add_token(self, token: JSON) -> None:
        with self._locked():
            kept = self.tokens()
            if any(t["id"] == token["id"] or t["digest"] == token["digest"] for t in kept):
                raise RecordConflictError(f"an API token {token['id']} exists already")
            atomic_write_json(self.path, [*kept, token])

    def revoke_token(self, token_id: str) -> bool:
        with self._locked():
            kept = self.tokens()
            left = [t for t in kept if t["id"] != token_id]
            if len(left) == len(kept):
                return False
            atomic_write_json(self.path, left)
            return True


def token_store(spool: Spool) -> TokenStore:
    """Where this process's API tokens are: the shared store's table on a cluster (every
    node accepts them), else the spool's file."""
    cluster = spool.shared
    return cluster if cluster is not None else SpoolTokens(spool)


def mint(store: TokenStore, by: str) -> tuple[ApiToken, str]:
    """A new API token for ``by``: what is kept, and the token (shown once, then gone)."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(f"tok-{secrets.token_hex(4)}", digest(secret), by, utc_now())
    store.add_token(token.to_json())
    return token, secret


def listed(store: TokenStore) -> list[ApiToken]:
    return [t for t in (ApiToken.of(data) for data in store.tokens()) if t is not None]


def revoke(store: TokenStore, token_id: str) -> None:
    """Forget the token ``token_id``: its next request is refused (401)."""
    if not TOKEN_ID.fullmatch(token_id):
        raise UsageError(
            f"{token_id!r} is no token id (tok- and 8 hex digits); "
            "`agentd console --list-tokens` lists them."
        )
    if not store.revoke_token(token_id):
        raise NotFoundError(
            f"no API token {token_id}; `agentd console --list-tokens` lists the tokens kept."
        )


def bearer(store: TokenStore, secret: str) -> ApiToken | None:
    """The kept token a request's ``Authorization: Bearer`` value is, or None."""
    if not secret.startswith(TOKEN_PREFIX) or len(secret) > 128:
        return None
    return ApiToken.of(store.token(digest(secret)))


# -- one-time logins ------------------------------------------------------------------------


class LoginTickets:
    """The one-time logins ``agentd console`` hands out, in ``SPOOL/console/logins``."""

    def __init__(self, spool: Spool, clock: Any = time.time) -> None:
        self.folder = spool.root / "console" / "logins"
        self.clock = clock

    def issue(self, ttl: float = LOGIN_TTL) -> str:
        """A new ticket, good once within ``ttl`` seconds: the secret of the URL. Whom it
        logs in is the user whose process made it: its file's owner (``redeem``)."""
        secret = secrets.token_urlsafe(32)
        path = private_dir(self.folder) / f"{digest(secret)}.json"
        write_exclusive(path, dump_json({"expires": self.clock() + ttl}))
        self.sweep()
        return secret

    def redeem(self, secret: str) -> str | None:
        """Who the ticket ``secret`` logs in, taking it (it opens nothing again); None when
        there is no such ticket, it was taken, or it expired. Who: the name of the uid that
        owns its file (``operator.user_name``), the ``agentd console`` that made it, never
        a name written in it (docs/design.md section 15)."""
        if not secret or len(secret) > 128:
            return None
        name = digest(secret)
        path = self.folder / f"{name}.json"
        try:
            with os.fdopen(open_regular(path), "rb") as file:
                owner = os.fstat(file.fileno()).st_uid
                data = load_json(file.read(TICKET_LIMIT))
            path.unlink()  # of two requests with one ticket, one unlinks it: that one wins
        except (OSError, ValueError):
            return None
        expires = data.get("expires") if isinstance(data, dict) else None
        if not isinstance(expires, int | float) or expires < self.clock():
            return None
        return user_name(owner)

    def sweep(self) -> None:
        """Remove the tickets that expired (a URL nobody opened)."""
        now = self.clock()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.folder):
                name = entry.name.removesuffix(".json")
                if not _DIGEST.fullmatch(name):
                    continue
                with contextlib.suppress(OSError, ValueError):
                    data = read_json(Path(entry.path))
                    if not isinstance(data, dict) or float(data.get("expires", 0)) < now:
                        os.unlink(entry.path)
