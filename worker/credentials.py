"""Where the API key comes from, and how it travels between agentd's processes.

A tool runs as the worker's user (as root, when agentd does), so it can read every
process environment that user can: ``/proc/PID/environ`` shows the block a process was
given when it was executed, whatever it did to ``os.environ`` afterwards, and a forked
child shows its parent's. The key therefore sits in no process environment once agentd
has started (docs/design.md section 5):

* Sources, for each secret (``ANTHROPIC_API_KEY``, ``ANTHROPIC_AUTH_TOKEN``, and the
  shared store's URL ``AGENTD_STORE``, whose password is one), the first
  that is set: the variable itself; ``NAME_FILE``, a file holding it; the systemd
  credential (``LoadCredential=anthropic_api_key:...`` in the unit, read from
  ``$CREDENTIALS_DIRECTORY``). ``gather`` reads them.
* ``take_over`` is the first thing every agentd process does (the daemon, the fork
  server, ``python -m worker``). A process that finds a secret, or where one can be read
  (``NAME_FILE``, ``CREDENTIALS_DIRECTORY``), in its own environment executes itself
  again, once (same pid, so systemd still knows its main process), with those removed and
  the secrets handed over through an inherited pipe that the new image reads and closes
  at once. From then on the secrets live in memory (``held``) only.
* A child gets them the same way (``start_process``): the daemon (and ``agentd start
  --detach``, the daemon) starts the fork server and fresh workers with an environment
  without secrets (``without_credentials``) and a pipe that holds them
  (``handing_over``). A worker forked from the fork server inherits them in memory.
* SIGHUP makes the daemon read again the secrets it read from a file (``NAME_FILE``:
  ``reread``), for the workers it starts from then on. Neither a variable nor a systemd
  credential can change under a running process (systemd does not refresh
  ``LoadCredential=`` on a reload): those need a restart, as ``how_to_change`` says.
* Every such process is non-dumpable (``PR_SET_DUMPABLE`` 0), so a tool running as the
  same user can neither read its ``/proc/PID/environ`` or memory nor attach to it. Root
  can still read the memory of any process; that is what the sandbox is for.

The worker passes the key to the SDK explicitly, and its redactor (``worker.events``)
replaces every held secret in logs, events and tool results.

The ``${cred:NAME}`` values of ``[mcp.servers]`` (docs/design.md section 11) are read where
a server starts (``credential``): from ``$CREDENTIALS_DIRECTORY/NAME``, else from the file
``$AGENTD_CRED_NAME_FILE`` names (NAME upper-cased). Those pointers travel like the
secrets (``Credentials.pointers``: out of every environment, their files hidden from
tools), and a value read joins the secrets this process holds, so it is redacted too.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote, unquote, urlsplit

from worker.errors import ConfigError
from worker.store.durable import read_regular

if TYPE_CHECKING:
    import subprocess

API_KEY = "ANTHROPIC_API_KEY"
AUTH_TOKEN = "ANTHROPIC_AUTH_TOKEN"  # noqa: S105  (a variable's name, not a token)
#: The shared store's URL (docs/design.md section 10), which may hold its password.
STORE = "AGENTD_STORE"
#: The OTLP exporter's headers (docs/design.md section 14: an API key of the collector,
#: say), the generic and the traces' own: the daemon's alone, never handed to a worker.
OTLP_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
OTLP_TRACES_HEADERS = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
EXPORTER_SECRETS = (OTLP_HEADERS, OTLP_TRACES_HEADERS)
#: Each secret by its environment name, with the name of its systemd credential.
CREDENTIAL_NAMES: Mapping[str, str] = {
    API_KEY: "anthropic_api_key",
    AUTH_TOKEN: "anthropic_auth_token",
    STORE: "agentd_store",
    OTLP_HEADERS: "otel_exporter_otlp_headers",
    OTLP_TRACES_HEADERS: "otel_exporter_otlp_traces_headers",
}
#: The environment variable that names the descriptor of a handover pipe.
HANDOVER = "AGENTD_CREDENTIALS_FD"
FILE_SUFFIX = "_FILE"
#: Where a secret was read from (``Credentials.origins``), besides the path of its file.
FROM_ENVIRONMENT = "environment"
FROM_SYSTEMD = "systemd"
#: The systemd credentials folder, as ``Credentials.pointers`` keeps it.
CREDENTIALS_DIRECTORY = "CREDENTIALS_DIRECTORY"
#: ``$AGENTD_CRED_NAME_FILE``: the file that holds the credential ``${cred:NAME}``.
CRED_FILE_PREFIX = "AGENTD_CRED_"
#: The key of a ``${cred:NAME}`` value among the values held.
CRED_KEY = "cred:"
#: A secret longer than this is refused: the handover pipe must hold all of them at once
#: (a pipe holds 64 KiB before a write blocks), and no key is anywhere near it.
MAX_SECRET = 16 * 1024
PR_SET_DUMPABLE = 4


def otlp_headers(text: str) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS`` as the OTLP specification writes it: ``key=value``
    pairs, comma-separated, each part URL-encoded; a part without ``=`` is left out."""
    headers = {}
    for part in text.split(","):
        key, equals, value = part.partition("=")
        if equals and key.strip():
            headers[unquote(key.strip()).lower()] = unquote(value.strip())
    return headers


@dataclass(frozen=True)
class Credentials:
    """The secrets a process holds, by environment name. Its repr never shows them."""

    values: Mapping[str, str] = field(default_factory=dict)
    #: The files the values were read from (a key file, systemd's credentials folder):
    #: what a sandboxed tool must not see, once no environment names them any more.
    files: tuple[str, ...] = ()
    #: Where each value was read from: ``FROM_ENVIRONMENT``, ``FROM_SYSTEMD`` or the
    #: absolute path of the file ``NAME_FILE`` named (which ``reread`` reads again).
    origins: Mapping[str, str] = field(default_factory=dict)
    #: Where ``${cred:NAME}`` values can be read (``credential``): ``CREDENTIALS_DIRECTORY``
    #: and each ``AGENTD_CRED_NAME_FILE``, by variable, as absolute paths.
    pointers: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> str | None:
        return self.values.get(name)

    def with_value(self, name: str, value: str) -> Credentials:
        """These credentials with ``name`` set to ``value`` (given on the command line)."""
        origins = {**self.origins, name: FROM_ENVIRONMENT}
        return Credentials({**self.values, name: value}, self.files, origins, self.pointers)

    def secrets(self) -> frozenset[str]:
        """The secret values, for redaction: the store URL's password on its own too (a
        driver's message may quote it without the URL), and each OTLP header's value."""
        found = {v for v in self.values.values() if v}
        if store := self.values.get(STORE):
            with contextlib.suppress(ValueError):
                if password := urlsplit(store).password:
                    found |= {password, unquote(password)}
        for name in EXPORTER_SECRETS:
            for value in otlp_headers(self.values.get(name) or "").values():
                found |= {value, quote(value, safe="")}
        return frozenset(v for v in found if v)

    def for_workers(self) -> Credentials:
        """What a worker (or the fork server) is handed: every secret but the exporter's,
        which only the daemon's export needs."""
        values = {k: v for k, v in self.values.items() if k not in EXPORTER_SECRETS}
        origins = {k: v for k, v in self.origins.items() if k not in EXPORTER_SECRETS}
        return Credentials(values, self.files, origins)

    def __bool__(self) -> bool:
        return bool(self.values)

    def __repr__(self) -> str:
        return f"Credentials({', '.join(sorted(self.values))})"

    def encode(self) -> bytes:
        document = {"values": dict(self.values), "files": list(self.files)}
        document |= {"origins": dict(self.origins), "pointers": dict(self.pointers)}
        return json.dumps(document).encode()

    @classmethod
    def decode(cls, data: bytes) -> Credentials:
        try:
            document = json.loads(data)
        except ValueError:
            document = None
        values = document.get("values") if isinstance(document, dict) else None
        files = document.get("files") if isinstance(document, dict) else None
        origins = document.get("origins", {}) if isinstance(document, dict) else None
        pointers = document.get("pointers", {}) if isinstance(document, dict) else None
        if (
            not isinstance(values, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items())
            or not isinstance(files, list)
            or not all(isinstance(f, str) for f in files)
            or not isinstance(origins, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in origins.items())
            or not isinstance(pointers, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in pointers.items())
        ):
            raise ConfigError(
                f"the credentials handed over through ${HANDOVER} are not agentd's; "
                f"unset {HANDOVER} and start agentd again."
            )
        return cls(values, tuple(files), origins, pointers)


# -- the sources ---------------------------------------------------------------------------


def gather(environ: Mapping[str, str], names: Iterable[str] = CREDENTIAL_NAMES) -> Credentials:
    """Every secret (of ``names``) from its first source that is set (see the module
    docstring)."""
    found: dict[str, str] = {}
    files: list[str] = []
    origins: dict[str, str] = {}
    for name in names:
        credential = CREDENTIAL_NAMES[name]
        if value := environ.get(name):
            found[name] = _checked(value, f"${name}")
            origins[name] = FROM_ENVIRONMENT
        elif file := environ.get(name + FILE_SUFFIX):
            found[name] = _read_secret(Path(file), f"{name}{FILE_SUFFIX}={file}")
            files.append(origins.setdefault(name, os.path.abspath(file)))
        elif directory := environ.get("CREDENTIALS_DIRECTORY"):
            path = Path(directory) / credential
            if path.exists():
                found[name] = _read_secret(path, f"the systemd credential {credential}")
                files.append(os.path.abspath(directory))
                origins[name] = FROM_SYSTEMD
    for name in names:  # a key file the variable took precedence over is a secret too
        if environ.get(name) and (file := environ.get(name + FILE_SUFFIX)):
            files.append(os.path.abspath(file))
    if directory := environ.get("CREDENTIALS_DIRECTORY"):  # whatever else it holds
        files.append(os.path.abspath(directory))
    pointers = {
        name: os.path.abspath(value)
        for name, value in environ.items()
        if value and (name == CREDENTIALS_DIRECTORY or is_cred_file_variable(name))
    }
    files += [path for name, path in pointers.items() if name != CREDENTIALS_DIRECTORY]
    return Credentials(found, tuple(dict.fromkeys(files)), origins, pointers)


def is_cred_file_variable(name: str) -> bool:
    """Whether ``name`` is an ``AGENTD_CRED_NAME_FILE`` variable."""
    return (
        name.startswith(CRED_FILE_PREFIX)
        and name.endswith(FILE_SUFFIX)
        and len(name) > len(CRED_FILE_PREFIX) + len(FILE_SUFFIX)
    )


def credential(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The value of ``${cred:NAME}``: ``$CREDENTIALS_DIRECTORY/NAME``, else the file
    ``$AGENTD_CRED_NAME_FILE`` names (as this process was handed them, or its own
    environment's). Once read it is held, so the redactor replaces it everywhere; a
    ``ConfigError`` says where to put it when it is in neither."""
    holder = held()
    if (value := holder.get(CRED_KEY + name)) is not None:
        return value
    variable = f"{CRED_FILE_PREFIX}{name.upper()}{FILE_SUFFIX}"
    directory = holder.pointers.get(CREDENTIALS_DIRECTORY) or environ.get(CREDENTIALS_DIRECTORY)
    file = holder.pointers.get(variable) or environ.get(variable)
    if directory and Path(directory, name).is_file():
        value = _read_secret(Path(directory, name), f"the systemd credential {name}")
    elif file:
        value = _read_secret(Path(file), f"{variable}={file}")
    else:
        raise ConfigError(
            f"${{cred:{name}}}: no such credential; give it with systemd's "
            f"LoadCredential={name}:PATH ($CREDENTIALS_DIRECTORY/{name}) or name the file "
            f"that holds it in ${variable}, and start agentd again."
        )
    hold(
        Credentials(
            {**holder.values, CRED_KEY + name: value}, holder.files, holder.origins, holder.pointers
        )
    )
    return value


def reread(credentials: Credentials) -> Credentials:
    """``credentials`` with every secret that was read from a ``NAME_FILE`` read from it
    again (SIGHUP); ``ConfigError`` when one cannot be, and then nothing changes."""
    values = dict(credentials.values)
    for name, origin in credentials.origins.items():
        if origin not in (FROM_ENVIRONMENT, FROM_SYSTEMD):
            values[name] = _read_secret(Path(origin), f"{name}{FILE_SUFFIX}={origin}")
    return Credentials(values, credentials.files, credentials.origins, credentials.pointers)


def how_to_change(name: str, environ: Mapping[str, str]) -> str:
    """What gives the daemon a new ``name`` (the end of an error about a missing or bad
    one), from where the secrets this process holds were read: a file named by
    ``NAME_FILE`` is read again at SIGHUP; a variable or a systemd credential only at a
    restart. ``environ``: this process's (systemd's ``INVOCATION_ID`` tells a service)."""
    origin = held().origins.get(name)
    file = f"{name}{FILE_SUFFIX}"
    if origin == FROM_SYSTEMD or (origin is None and "INVOCATION_ID" in environ):
        return (
            f"put it in the file the unit's LoadCredential={CREDENTIAL_NAMES[name]}:... names "
            f"and run `systemctl restart agentd` (a reload does not refresh a credential)"
        )
    if origin is not None and origin != FROM_ENVIRONMENT:
        return (
            f"put it in {origin} (the daemon's {file}) and send the daemon SIGHUP, which "
            f"reads that file again: `kill -HUP PID`, PID from `agentd status`"
        )
    return (
        f"the daemon reads it when it starts, so restart it with {file} (read again at "
        f"each SIGHUP) or {name} set: `agentd stop`, then `{file}=PATH agentd start --detach`"
    )


def _read_secret(path: Path, origin: str) -> str:
    try:
        text = read_regular(path, MAX_SECRET, follow_symlinks=True).decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise ConfigError(f"cannot read {origin}: {why}; fix the file or unset it.") from None
    if not text:
        raise ConfigError(f"{origin} is empty; put the key in it or unset it.")
    return _checked(text, origin)


def _checked(value: str, origin: str) -> str:
    if len(value.encode()) > MAX_SECRET:
        raise ConfigError(f"{origin} is longer than {MAX_SECRET} bytes; it holds no key.")
    return value


#: What no process environment keeps: the secrets, and where they can be read (a tool
#: that reads a daemon's /proc/PID/environ would otherwise learn which file to read).
HIDDEN = frozenset(
    {"CREDENTIALS_DIRECTORY", *CREDENTIAL_NAMES, *(n + FILE_SUFFIX for n in CREDENTIAL_NAMES)}
)


def hidden(name: str) -> bool:
    """Whether no process environment keeps the variable ``name`` (``HIDDEN``, and each
    ``AGENTD_CRED_NAME_FILE``)."""
    return name in HIDDEN or is_cred_file_variable(name)


def without_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without secrets, pointers to them or a handover: what a child process
    may be executed with."""
    return {k: v for k, v in environ.items() if not hidden(k) and k != HANDOVER}


#: What every variable libpq reads starts with (``PGPASSWORD``, ``PGPASSFILE``,
#: ``PGSERVICEFILE``, ``PGHOST``...): none reaches a hook or a tool.
LIBPQ_PREFIX = "PG"
#: Where libpq looks for a service file that no variable names, besides ``PGSYSCONFDIR``:
#: the folders builds of it are configured with (Debian's, PostgreSQL's own, /etc).
SERVICE_FILES = (
    "/etc/postgresql-common/pg_service.conf",
    "/usr/local/pgsql/etc/pg_service.conf",
    "/etc/pg_service.conf",
)
#: The folders a PostgreSQL server puts its Unix socket in by default (a socket in the
#: host's /tmp is out of reach already: the sandbox has a /tmp of its own).
SOCKET_FOLDERS = ("/run/postgresql", "/var/run/postgresql")


def without_libpq(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any of libpq's variables (``LIBPQ_PREFIX``)."""
    return {k: v for k, v in environ.items() if not k.startswith(LIBPQ_PREFIX)}


def store_paths(environ: Mapping[str, str], url: str) -> list[str]:
    """What a tool must not reach while a worker holds the store's ``url``: each file
    libpq may read a password, a service or a client key from (``~/.pgpass``,
    ``PGPASSFILE``, ``PGSERVICEFILE``, ``~/.pg_service.conf`` and the system one,
    ``~/.postgresql``, ``PGSSLKEY``), and the folders of the server's Unix socket, where
    a tool of the same user could log in without any password (peer or trust).

    Paths that do not exist are given too: the sandbox skips them."""
    homes = {environ.get("HOME") or ""}
    with contextlib.suppress(KeyError):
        homes.add(pwd.getpwuid(os.getuid()).pw_dir)  # libpq's own guess without HOME
    paths = [
        os.path.join(home, name)
        for home in sorted(homes - {""})
        for name in (".pgpass", ".pg_service.conf", ".postgresql")
    ]
    paths += [environ[n] for n in ("PGPASSFILE", "PGSERVICEFILE", "PGSSLKEY") if environ.get(n)]
    if folder := environ.get("PGSYSCONFDIR"):
        paths.append(os.path.join(folder, "pg_service.conf"))
    paths += SERVICE_FILES
    hosts = environ.get("PGHOST", "").split(",")
    with contextlib.suppress(Exception):  # psycopg parses it as libpq does (a store only)
        from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

        hosts += str(conninfo_to_dict(url).get("host") or "").split(",")
    sockets = [h for h in hosts if h.startswith("/") and not Path(h).is_relative_to("/tmp")]  # noqa: S108
    return [os.path.abspath(p) for p in (*paths, *SOCKET_FOLDERS, *sockets)]


# -- what this process holds ---------------------------------------------------------------

_held = Credentials()


def held() -> Credentials:
    """The secrets this process holds (none until ``take_over`` or ``hold``)."""
    return _held


def hold(credentials: Credentials) -> None:
    global _held  # noqa: PLW0603  (the one process-wide holder of secrets)
    _held = credentials


def take_over(environ: MutableMapping[str, str] | None = None) -> Credentials:
    """Become the holder of this process's secrets: the first call of every agentd
    process. Takes what a parent handed over, or gathers the sources; when a secret sits in
    this process's own environment (or a pointer to one: ``HIDDEN``), executes the process
    again without it (and does not return)."""
    environ = os.environ if environ is None else environ
    make_undumpable()
    handed = receive(environ)
    if handed is None:
        handed = gather(environ)
        if any(hidden(name) for name in environ):
            _execute_again(handed, environ)
    hold(handed)
    return handed


def make_undumpable() -> bool:
    """``PR_SET_DUMPABLE`` 0: ``/proc/PID/environ``, ``mem`` and ptrace of this process are
    closed to everyone but root. Kept across fork, reset by exec (a tool's process is an
    ordinary one). False where the call is not available."""
    import ctypes  # noqa: PLC0415  (only a process that holds secrets needs it: most commands never do)

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _execute_again(credentials: Credentials, environ: Mapping[str, str]) -> NoReturn:
    env = without_credentials(environ)
    env[HANDOVER] = str(_pipe_holding(credentials))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os.execve(sys.executable, sys.orig_argv, env)  # noqa: S606  (this very program again)


# -- the handover --------------------------------------------------------------------------


def _pipe_holding(credentials: Credentials) -> int:
    """The read end of a pipe that holds ``credentials`` and is closed for writing, made
    inheritable (the write end is closed before anyone else can have it)."""
    data = credentials.encode()
    read_end, write_end = os.pipe()
    try:
        while data:
            data = data[os.write(write_end, data) :]
    finally:
        os.close(write_end)
    os.set_inheritable(read_end, True)
    return read_end


@contextlib.contextmanager
def handing_over(
    credentials: Credentials, env: Mapping[str, str]
) -> Iterator[tuple[dict[str, str], tuple[int, ...]]]:
    """The environment and the descriptors to pass (``pass_fds``) to start a child that is
    to receive ``credentials``; the parent's end is closed when the block ends."""
    if not credentials:
        yield dict(env), ()
        return
    fd = _pipe_holding(credentials)
    try:
        yield {**env, HANDOVER: str(fd)}, (fd,)
    finally:
        os.close(fd)


def start_process(
    command: Sequence[str], credentials: Credentials, env: Mapping[str, str], **options: Any
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(command, **options)`` with ``env`` less every secret in it, and
    ``credentials`` handed over through a pipe: how agentd starts its own processes."""
    import subprocess  # noqa: PLC0415  (only the commands that start processes pay for it)

    with handing_over(credentials, without_credentials(env)) as (child_env, pass_fds):
        return subprocess.Popen(command, env=child_env, pass_fds=pass_fds, **options)


def receive(environ: MutableMapping[str, str]) -> Credentials | None:
    """What a parent handed over through the pipe ``$AGENTD_CREDENTIALS_FD`` names (read
    and closed here), or None when it handed over nothing."""
    value = environ.pop(HANDOVER, None)
    if value is None:
        return None
    try:
        fd = int(value)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"descriptor {fd} is not a pipe")
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"{HANDOVER}={value} names no handover pipe ({exc}); unset it and start again."
        ) from None
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 4 * MAX_SECRET:
                break
    finally:
        os.close(fd)
    return Credentials.decode(b"".join(chunks))
