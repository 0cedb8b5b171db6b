"""The one redactor of secrets: ``Redactor`` and ``redact``, its instance for this process.

It keeps API keys and credentials out of every log line and event file (docs/design.md
section 4: ``supervisor.logging`` puts ``redact`` in the structlog chain, and
``worker.events.TaskEventLog`` cleans every event with it) and, through
``clean_secrets``, the key out of every tool result before it is recorded or sent
(section 5: ``Recorder.record``). What it replaces: the values of secret-named keys,
secret-shaped substrings (Anthropic keys, HTTP auth credentials), and the literal values
of the secrets the process holds (``worker.credentials``) or finds in its environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from typing import Any

from worker import credentials

#: What a secret is replaced with.
REDACTED = "[redacted]"

# Values of keys named like these are secrets, whatever they hold. A key matches when
# its last word is one of these (after lowercasing and turning "-" into "_"), so
# `x-api-key` and `access_token` match while `input_tokens` and `max_tokens` do not.
_SECRET_KEY = re.compile(
    r"(?:^|_)(?:api_?key|access_key|private_key|authorization|token|secret|password|passwd"
    r"|cookie|credentials?)$"
)
# Secrets inside any string: Anthropic keys, and the credential of an HTTP auth header.
_ANTHROPIC_KEY = re.compile(r"sk-ant-[A-Za-z0-9_-]+")
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
# The literal values of secret-named environment variables ($ANTHROPIC_API_KEY, say, or
# $GITHUB_TOKEN) and of the secrets the process holds (worker.credentials: the key is in
# no environment) are redacted too, unless too short to be real secrets: redacting every
# "x" would make logs unreadable and protect nothing.
_MIN_LITERAL_SECRET = 8
_MAX_DEPTH = 16


class Redactor:
    """Processor that replaces secrets in an event dict, at any depth.

    The value of a secret-named key becomes ``[redacted]``; inside every other string,
    each substring shaped like a secret does (the rest of the message stays readable).
    Containers are copied, never changed in place: they may belong to the caller.

    ``environ``: where secret-named variables are read (default: this process's);
    ``secrets``: the secret values to replace wherever they appear (default: those the
    process holds at the time of each call, ``worker.credentials.held``).
    """

    def __init__(
        self, environ: Mapping[str, str] | None = None, secrets: Collection[str] | None = None
    ) -> None:
        self._environ = os.environ if environ is None else environ
        self._secrets = secrets
        #: ``_literals``' last answer, with what it was computed from
        self._memo: tuple[credentials.Credentials | None, tuple[Any, ...], list[str]] | None = None

    def __call__(self, logger: Any, method_name: str, event_dict: Any) -> Any:
        """The structlog processor interface."""
        return self.clean_mapping(event_dict)

    def clean_mapping(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``mapping`` without secrets."""
        return self._mapping(mapping, self._literals(), 0)

    def clean_prose(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        """``clean_mapping`` for what people and models wrote (a transcript, shown by
        ``agentd show`` and the console): the same, except that the word after "Basic"
        or "Bearer" stays, which in prose is rarely a credential ("Basic idea")."""
        return self._mapping(mapping, self._literals(), 0, prose=True)

    def clean_text(self, text: str) -> str:
        """``text`` with every secret-shaped substring replaced."""
        return self._text(text, self._literals())

    def clean_secrets(self, text: str) -> str:
        """``text`` with every known secret value replaced, and nothing else: for a tool's
        output, which is the model's view of the world (a file that says "Basic idea" or
        holds an example key keeps it; only values known to be secrets go)."""
        return _replace_literals(text, self._literals())

    def _literals(self) -> list[str]:
        """The literal secrets to replace, longest first. Computed again only when the
        held credentials or the environment changed: a worker cleans every tool result,
        and scanning the environment each time cost more than the rest of a turn's fold."""
        holder = credentials.held() if self._secrets is None else None
        environ = _items(self._environ)
        memo = self._memo
        if memo is not None and memo[0] is holder and memo[1] == environ:
            return memo[2]
        literals = self._find_literals(holder)
        self._memo = (holder, environ, literals)
        return literals

    def _find_literals(self, holder: credentials.Credentials | None) -> list[str]:
        known = holder.secrets() if holder is not None else self._secrets or ()
        found = {
            value
            for name, value in self._environ.items()
            if len(value) >= _MIN_LITERAL_SECRET and _is_secret_key(name)
        }
        found.update(v for v in known if len(v) >= _MIN_LITERAL_SECRET)
        # longest first: a secret that contains another is replaced whole
        return sorted(found, key=len, reverse=True)

    def _mapping(
        self, mapping: Mapping[Any, Any], literals: list[str], depth: int, *, prose: bool = False
    ) -> dict[Any, Any]:
        clean: dict[Any, Any] = {}
        for key, value in mapping.items():
            if isinstance(key, str) and _is_secret_key(key):
                clean[key] = REDACTED if value is not None else None
            else:
                clean[key] = self._value(value, literals, depth + 1, prose=prose)
        return clean

    def _value(self, value: Any, literals: list[str], depth: int, *, prose: bool = False) -> Any:
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, str):
            return self._text(value, literals, prose=prose)
        if depth > _MAX_DEPTH:
            return self._text(_safe_repr(value), literals, prose=prose)
        if isinstance(value, Mapping):
            return self._mapping(value, literals, depth, prose=prose)
        if isinstance(value, list | tuple):
            items = [self._value(v, literals, depth + 1, prose=prose) for v in value]
            return items if isinstance(value, list) else tuple(items)
        # Any other object is rendered through its repr later: if that would show a
        # secret (an exception quoting a header, say), log the cleaned text instead.
        text = _safe_repr(value)
        clean = self._text(text, literals, prose=prose)
        return value if clean == text else clean

    def _text(self, text: str, literals: list[str], *, prose: bool = False) -> str:
        text = _replace_literals(text, literals)
        if "://" in text:
            text = without_password(text)
        if "sk-ant-" in text:
            text = _ANTHROPIC_KEY.sub(REDACTED, text)
        return text if prose else _AUTH_SCHEME.sub(rf"\1 {REDACTED}", text)


#: The redaction processor, with the secrets this process holds and those of its environment.
redact = Redactor()


#: The password of a URL in a text: ``scheme://user:PASSWORD@``.
_URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]*@", re.IGNORECASE)


def without_password(text: str) -> str:
    """``text`` with the password of every URL in it replaced (``[redacted]``)."""
    return _URL_PASSWORD.sub(rf"\1{REDACTED}@", text)


def _replace_literals(text: str, literals: list[str]) -> str:
    for literal in literals:
        if literal in text:
            text = text.replace(literal, REDACTED)
    return text


def _items(environ: Mapping[str, str]) -> tuple[Any, ...]:
    """An environment's items as a tuple cheap to compare: for ``os.environ``, the bytes
    it decodes from (its own ``items()`` decodes every variable on each call)."""
    raw = getattr(environ, "_data", None)  # os._Environ keeps them in this dict
    return tuple(raw.items()) if isinstance(raw, dict) else tuple(environ.items())


def _is_secret_key(name: str) -> bool:
    return _SECRET_KEY.search(name.lower().replace("-", "_")) is not None


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:  # a broken __repr__ must not take logging down with it
        return f"<{type(value).__name__} object>"
