"""The console's API tokens in the PostgreSQL store (docs/design.md section 12): every
node's console accepts them. A token is kept by its SHA-256 digest, never in the clear."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg import errors as pgerrors

from worker.errors import RecordConflictError
from worker.store.base import JSON

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database

#: The API tokens, each with its columns in the order ``_token`` reads them.
_SELECT_TOKENS = (
    "SELECT id, digest, by_user, to_char(created_at AT TIME ZONE 'UTC', "
    '\'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"\') FROM console_tokens'
)


def _token(row: tuple[Any, ...]) -> JSON:
    token_id, digest, by, created_at = row
    return {"id": token_id, "digest": digest, "by": by, "created_at": created_at}


class ConsoleTokens:
    """The API tokens in ``db``'s ``console_tokens`` table."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_token(self, token: JSON) -> None:
        try:
            with self._db.step() as conn:
                conn.execute(
                    "INSERT INTO console_tokens (id, digest, by_user, created_at) "
                    "VALUES (%(id)s, %(digest)s, %(by)s, %(created_at)s)",
                    {k: token[k] for k in ("id", "digest", "by", "created_at")},
                )
        except pgerrors.UniqueViolation:
            raise RecordConflictError(f"an API token {token['id']} exists already") from None

    def tokens(self) -> list[JSON]:
        with self._db.step() as conn:
            rows = conn.execute(_SELECT_TOKENS + " ORDER BY created_at, id").fetchall()
        return [_token(row) for row in rows]

    def token(self, digest: str) -> JSON | None:
        row = self._db.one(
            _SELECT_TOKENS + " WHERE digest = %(digest)s",
            {"digest": digest},
        )
        return _token(row) if row is not None else None

    def revoke_token(self, token_id: str) -> bool:
        row = self._db.one(
            "DELETE FROM console_tokens WHERE id = %(id)s RETURNING 1", {"id": token_id}
        )
        return row is not None
