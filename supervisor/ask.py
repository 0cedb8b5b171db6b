"""Asking the running daemon for ``agentd status --json`` (``supervisor.entry`` asks
first; ``supervisor.status_socket`` answers): the question, its answer, and when it is
asked at all.

A status call costs what the interpreter costs to start, not what the command line costs
to import and every task's files cost to read. The daemon keeps each task's row while the
task's files stay as they were, and answers on ``SPOOL/status.sock``. Its answer is
exactly what the command line would print, so it is asked only when nothing given could
make the two differ:

* the command is ``[--spool DIR] [--config FILE] status --json`` and nothing else;
* the spool is named (``--spool``, ``$AGENTD_SPOOL``, systemd's ``$STATE_DIRECTORY``), or
  neither config names one, and it is the very path the daemon serves;
* no shared store is named (``$AGENTD_STORE``, its file or systemd credential) and the
  spool is not a node's (``store.json``): the daemon answers for its own files only;
* the config file this command would read has the very bytes the daemon accepted (the
  same prices, the same everything), which the daemon compares.

Otherwise, or when no daemon answers within ``ASK_TIMEOUT`` (none runs, it is stopped,
the socket is stale), the command line reads the files itself, as it always could. This
module imports the standard library alone.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from worker import paths

#: In the spool: where the daemon answers (``supervisor.status_socket``).
SOCKET = "status.sock"
#: The one question: ``ASK``, the spool's path and a newline, a ``1`` (the spool was
#: named) or ``0`` and a newline, then the config file's bytes to the end.
ASK = b"status-json\n"
#: The first line of an answer: ``OK`` then the document, or a line that says why not.
OK = b"ok\n"
#: How long a command waits for the daemon before it reads the files itself.
ASK_TIMEOUT = 2.0
#: The global options a status the daemon answers may be given.
GLOBAL_OPTIONS = ("--spool", "--config")
#: The environment that names a shared store (``worker.credentials``: ``AGENTD_STORE``).
STORE_SOURCES = ("AGENTD_STORE", "AGENTD_STORE_FILE", "CREDENTIALS_DIRECTORY")


def answered(args: Sequence[str], environ: Mapping[str, str]) -> bytes | None:
    """The running daemon's answer to ``args`` (the document with its newline), or None
    when the command line is to answer (see the module docstring)."""
    asked = _status_options(args)
    if asked is None or any(environ.get(name) for name in STORE_SOURCES):
        return None
    spool, named = _spool(asked.get("--spool"), environ)
    try:
        config = _config_bytes(asked.get("--config"), environ)
        folder = os.open(spool, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        if os.path.lexists(os.path.join(spool, "store.json")):
            return None
        return _ask(f"/proc/self/fd/{folder}/{SOCKET}", spool, named, config)
    finally:
        os.close(folder)


def _status_options(args: Sequence[str]) -> dict[str, str] | None:
    """The global options of ``[--spool DIR] [--config FILE] status --json`` (each given
    once, in either order, as ``--NAME VALUE`` or ``--NAME=VALUE``); None for any other
    command line."""
    options: dict[str, str] = {}
    rest = list(args)
    while rest and rest[0].startswith("--"):
        name, _, value = rest[0].partition("=")
        if name not in GLOBAL_OPTIONS or name in options:
            return None
        if not value:
            if len(rest) < 2 or "=" in rest[0]:
                return None
            value, rest = rest[1], rest[1:]
        options[name], rest = value, rest[1:]
    return options if rest == ["status", "--json"] else None


def _spool(option: str | None, environ: Mapping[str, str]) -> tuple[str, bool]:
    """The spool the command line would read, and whether it was named (as
    ``supervisor.commands.context.resolve_spool`` finds and spells it)."""
    if named := option or environ.get("AGENTD_SPOOL"):
        return str(Path(named).expanduser().absolute()), True
    return str(paths.default_spool(environ)), bool(environ.get("STATE_DIRECTORY"))


def _config_bytes(option: str | None, environ: Mapping[str, str]) -> bytes:
    """The bytes of the config file the command line would read (none: empty). A file
    that is not a regular one is for the command line to refuse in its own words."""
    path = Path(option) if option else paths.named_config(environ)
    if path is None:
        return b""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(path)
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read(paths.CONFIG_FILE_LIMIT + 1)
    finally:
        os.close(fd)


def _ask(address: str, spool: str, named: bool, config: bytes) -> bytes | None:
    """Ask the daemon at ``address``; its document, or None."""
    question = ASK + os.fsencode(spool) + b"\n" + (b"1\n" if named else b"0\n") + config
    if b"\n" in os.fsencode(spool):
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(ASK_TIMEOUT)
            conn.connect(address)
            conn.sendall(question)
            conn.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := conn.recv(1 << 20):
                chunks.append(chunk)
    except OSError:  # none listens, it is stopped (a timeout), the socket is not one
        return None
    answer = b"".join(chunks)
    return answer[len(OK) :] if answer.startswith(OK) and answer.endswith(b"\n") else None
