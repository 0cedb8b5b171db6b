"""``[mcp.servers.NAME]``: the typed settings of each MCP server, and their checks.

::

    [mcp.servers.git]
    command = ["mcp-server-git", "--repository", "."]   # stdio, cwd the task's workspace
    env = {GIT_AUTHOR_NAME = "agent", TOKEN = "${cred:git_token}"}
    trust = true                       # use the server's annotations (default false)
    effects = {git_commit = "unsafe"}  # always wins over annotations
    timeout = 60                       # seconds a call may take (default deadlines.tool_call)
    network = true                     # default: [tools] network
    # url = "https://mcp.example.com/mcp" and headers = {...}: a Streamable HTTP server

``parse`` reads the ``[mcp]`` table through ``ConfigTable``, the seam ``worker.config``'s
table reader fills (this module does not import ``worker.config``, which imports it), so
every message has the shape of every other config error: the file, the dotted key, what is
allowed, what was given.

A secret never sits in the config file: the file is copied into the spool for the workers.
``${cred:NAME}`` in an ``env`` or ``headers`` value is read where a server is started
(``worker.credentials.credential``); a header, or an ``env`` variable named like a secret,
whose value holds a literal credential is refused.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn, Protocol

from worker.errors import ConfigError
from worker.mcp.naming import SERVER_NAME_MAX, is_server_name
from worker.tools.tool import Effect

#: A reference to a credential in a value: ``${cred:NAME}``.
CRED_REF = re.compile(r"\$\{cred:([A-Za-z0-9_]{1,64})\}")
#: What the one-line error for a config with servers and no SDK says to run.
INSTALL_HINT = "pip install 'agentd[mcp]'"
#: An HTTP server's URL.
URL_SCHEMES = ("http://", "https://")

# A literal that is a credential: an auth scheme's credential, or a long run of the
# characters tokens are made of (a key, a JWT, a hex or base64 secret).
_TOKEN_RUN = re.compile(r"[A-Za-z0-9._~+/=-]{20,}")
_SCHEME_ONLY = re.compile(r"\s*(?:Bearer|Basic|Token|Bot)?\s*", re.IGNORECASE)
_SECRET_NAME = re.compile(
    r"(?:^|[_-])(?:api[_-]?key|access[_-]key|private[_-]key|authorization|auth|token|secret"
    r"|password|passwd|cookie|credentials?)$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class McpServer:
    """One ``[mcp.servers.NAME]`` table. Exactly one of ``command`` (a stdio server, started
    in the task's sandbox) and ``url`` (a Streamable HTTP server) is set. ``env`` and
    ``headers`` values may hold ``${cred:NAME}`` references, resolved at start. Its name is
    its key in ``McpConfig.servers``."""

    command: tuple[str, ...] = ()
    url: str = ""
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    trust: bool = False
    effects: Mapping[str, Effect] = field(default_factory=lambda: MappingProxyType({}))
    timeout: float = 0.0  # seconds; parse fills in deadlines.tool_call when left out
    network: bool = True

    @property
    def stdio(self) -> bool:
        return bool(self.command)

    def credentials(self) -> list[str]:
        """The names of the credentials its ``env`` and ``headers`` refer to."""
        values = [*self.env.values(), *self.headers.values()]
        return list(dict.fromkeys(name for v in values for name in CRED_REF.findall(v)))


@dataclass(frozen=True)
class McpConfig:
    """``[mcp]``: the servers by name, in the order of the file."""

    servers: Mapping[str, McpServer] = field(default_factory=lambda: MappingProxyType({}))


class ConfigTable(Protocol):
    """What ``parse`` needs of a table of the config document (``worker.config._Table``)."""

    data: Mapping[str, Any]

    def key(self, key: str) -> str: ...

    def fail(self, key: str, message: str) -> NoReturn: ...

    def sub(self, key: str, defaults: Any) -> ConfigTable: ...

    def check_keys(self) -> None: ...

    def duration(self, key: str) -> float: ...

    def flag(self, key: str) -> bool: ...

    def shown(self, value: object) -> str: ...


def parse(mcp: ConfigTable, *, tool_call: float, network: bool) -> McpConfig:
    """``[mcp]``, every server checked; ``tool_call`` and ``network`` are the defaults of
    ``timeout`` (``deadlines.tool_call``) and ``network`` (``[tools] network``)."""
    mcp.check_keys()
    raw = mcp.data.get("servers", {})
    if not isinstance(raw, dict):
        mcp.fail(
            "servers", f"must be a table of servers ([mcp.servers.NAME]), got {mcp.shown(raw)}"
        )
    servers: dict[str, McpServer] = {}
    for name, table in raw.items():
        if not is_server_name(name):
            mcp.fail(
                f"servers.{mcp.shown(name)}",
                f"is not a server name; a name is lower-case letters and digits in words "
                f"joined by single '_', at most {SERVER_NAME_MAX} characters, such as "
                '"git" or "issue_tracker"',
            )
        if not isinstance(table, dict):
            mcp.fail(
                f"servers.{name}", f"must be a table ([mcp.servers.{name}]), got {mcp.shown(table)}"
            )
        servers[name] = _server(mcp.sub(f"servers.{name}", McpServer()), tool_call, network)
    if servers:
        require_sdk(mcp.key("servers"))
    return McpConfig(MappingProxyType(servers))


def require_sdk(where: str) -> None:
    """Fail in one line when the ``mcp`` SDK is not installed (found, not imported)."""
    try:
        found = importlib.util.find_spec("mcp") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"{where}: MCP servers are configured but the mcp SDK is not installed; "
            f"run `{INSTALL_HINT}` in agentd's environment, or remove [mcp.servers]."
        )


def _server(t: ConfigTable, tool_call: float, network: bool) -> McpServer:
    t.check_keys()
    has_command, has_url = "command" in t.data, "url" in t.data
    if has_command and has_url:
        t.fail("url", "and command are both given; a server has one: command or url")
    if not has_command and not has_url:
        t.fail(
            "command",
            "is missing: give command (the server's argv, an array) for a stdio server, "
            "or url for a Streamable HTTP server",
        )
    command: tuple[str, ...] = ()
    url = ""
    if has_command:
        value = t.data["command"]
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(a, str) and a and "\0" not in a for a in value)
        ):
            t.fail(
                "command",
                "must be the server's command as a non-empty array of strings, such as "
                f'["mcp-server-git", "--repository", "."], got {t.shown(value)}',
            )
        command = tuple(value)
        if "headers" in t.data:
            t.fail("headers", "applies to a url server only; a command server takes env")
    else:
        url = t.data["url"]
        if (
            not isinstance(url, str)
            or not url.startswith(URL_SCHEMES)
            or any(c.isspace() or c == "\0" for c in url)
            or len(url) <= len(url.partition("://")[0]) + 3
        ):
            t.fail("url", f"must be an http:// or https:// URL, got {t.shown(url)}")
        if "@" in url.partition("://")[2].partition("/")[0]:
            t.fail(
                "url", "holds a user or password; give a credential in headers with ${cred:NAME}"
            )
        if "env" in t.data:
            t.fail("env", "applies to a command server only; a url server takes headers")
    env = _strings(t, "env", secret_names=True)
    headers = _strings(t, "headers", secret_names=False)
    timeout = t.duration("timeout") if "timeout" in t.data else tool_call
    if timeout > tool_call:
        t.fail(
            "timeout",
            f"must be at most deadlines.tool_call ({tool_call:g}), past which the daemon "
            f"stops the worker; got {t.shown(t.data['timeout'])}",
        )
    return McpServer(
        command=command,
        url=url,
        env=env,
        headers=headers,
        trust=t.flag("trust"),
        effects=_effects(t),
        timeout=timeout,
        network=t.flag("network") if "network" in t.data else network,
    )


def _strings(t: ConfigTable, key: str, *, secret_names: bool) -> Mapping[str, str]:
    """``env`` or ``headers``: a table of strings, each ``${cred:NAME}`` well formed, no
    literal secret (every header is checked; of ``env``, variables named like secrets)."""
    value = t.data.get(key, {})
    if not isinstance(value, dict):
        t.fail(key, f'must be a table of strings, such as {{NAME = "value"}}, got {t.shown(value)}')
    for name, text in value.items():
        where = (
            f"{key}.{name}" if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f"{key}.{t.shown(name)}"
        )
        if key == "env" and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            t.fail(where, "is not an environment variable name (letters, digits and _)")
        if key == "headers" and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", name):
            t.fail(where, "is not an HTTP header name")
        if not isinstance(text, str) or "\0" in text or "\n" in text or "\r" in text:
            t.fail(where, f"must be a string on one line, got {t.shown(text)}")
        literal = CRED_REF.sub("", text)
        if "${" in literal:
            t.fail(where, "has a ${...} that is not ${cred:NAME} (NAME: letters, digits and _)")
        if (key == "headers" or (secret_names and _SECRET_NAME.search(name))) and _secret_like(
            name, literal
        ):
            t.fail(
                where,
                "holds what looks like a literal secret, which a config file must not (it is "
                "copied into the spool); put the secret in a credential and write "
                "${cred:NAME} (read from $CREDENTIALS_DIRECTORY/NAME or the file "
                "$AGENTD_CRED_NAME_FILE names)",
            )
    return MappingProxyType(dict(value))


def _secret_like(name: str, literal: str) -> bool:
    """A value (its ``${cred:...}`` references taken out) that carries a credential: a
    secret-named one with more than an auth scheme's word, or any long token-like run."""
    if _TOKEN_RUN.search(literal):
        return True
    return bool(_SECRET_NAME.search(name)) and not _SCHEME_ONLY.fullmatch(literal)


def _effects(t: ConfigTable) -> Mapping[str, Effect]:
    value = t.data.get("effects", {})
    if not isinstance(value, dict):
        t.fail("effects", f'must be a table of tool = "class", got {t.shown(value)}')
    allowed = [e.value for e in Effect]
    for tool, effect in value.items():
        if not isinstance(effect, str) or effect not in allowed:
            t.fail(
                f"effects.{t.shown(tool)}",
                f"must be one of {', '.join(repr(a) for a in allowed)}, got {t.shown(effect)}",
            )
    return MappingProxyType({tool: Effect(effect) for tool, effect in value.items()})
