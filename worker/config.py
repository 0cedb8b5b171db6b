"""Configuration: the typed shape of ``agentd.toml`` and its loader.

Keys and defaults are documented in ``config/agentd.toml``; the names are part of the
public contract (docs/design.md section 2). Durations are seconds (floats).

``load_config()`` finds the file (docs/design.md section 2: an explicit path, else
``$AGENTD_CONFIG``, else the first that exists of ``paths.user_config_path()`` and
``paths.SYSTEM_CONFIG``, else none: the defaults), parses it and validates every value.
Anything wrong raises ``ConfigError`` (exit 78) with one line that names the file, the
key and what is allowed. ``default_config_text()`` is the commented default file that
``agentd init`` writes; ``config/agentd.toml`` is a copy of it (a test keeps the two equal).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import keyword
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import date, datetime, time
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn, cast

from worker import paths
from worker.budget import (
    PRICE_KEYS,
    Budget,
    Price,
    price_of,
    price_table,
    valid_tokens,
    valid_usd,
)
from worker.errors import ConfigError
from worker.mcp import settings as mcp_settings
from worker.mcp.naming import TOOL_PATTERN
from worker.mcp.settings import McpConfig
from worker.paths import CONFIG_FILE_LIMIT
from worker.store.durable import read_regular
from worker.tools.effect import Effect
from worker.tools.sandbox import SandboxMode

#: What ``[tools.policy]`` may say about a tool's dangling calls on resume.
TOOL_POLICIES = ("rerun", "hold")

# The Messages API accepts tool names of this shape; a policy for any other name could
# never apply to a tool.
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class HeartbeatConfig:
    interval: float = 1.0
    timeout: float = 10.0


@dataclass(frozen=True)
class DeadlineConfig:
    model_call: float = 600.0
    tool_call: float = 900.0


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    crash_loop_limit: int = 5
    stop_grace: float = 10.0


@dataclass(frozen=True)
class ModelConfig:
    name: str = "claude-sonnet-5-5"
    max_tokens: int = 4096


#: ``[tools] default`` when left out: every built-in and module tool, no MCP server's
#: (a pattern reaches MCP tools only when it begins with ``mcp__``: ``worker.mcp.naming``).
ALL_LOCAL_TOOLS = ("*",)


@dataclass(frozen=True)
class ToolsConfig:
    modules: tuple[str, ...] = ()
    default: tuple[str, ...] = ALL_LOCAL_TOOLS  # names and globs a task gets without --tools
    sandbox: SandboxMode = SandboxMode.AUTO
    network: bool = True
    max_processes: int = 512  # a task's processes and threads at once (its cgroup's pids.max)
    max_memory: int = 2 * 1024**3  # bytes a task's processes may use (its cgroup's memory.max)
    policy: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: the tools (names and globs, as ``--tools`` takes them) and the effect classes whose
    #: calls wait for an operator's approval before they run (docs/guides/tools.md)
    ask: tuple[str, ...] = ()
    ask_effects: tuple[str, ...] = ()


@dataclass(frozen=True)
class ApprovalsConfig:
    """How long an operator's approval lasts (docs/guides/tools.md): a decision not
    used by a worker within ``expire_after`` seconds is void; a call asked before it runs
    and not answered within ``ask_timeout`` is skipped. None: never."""

    expire_after: float | None = None
    ask_timeout: float | None = None


#: The units a period may be written with (``[approvals]``): "90s", "30m", "24h", "30d".
PERIOD_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
PERIOD = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([smhd])")


def parse_period(value: object) -> float | None:
    """A period in seconds: a number (seconds, may be fractional) or a string with a unit
    (``PERIOD_UNITS``: "90s", "30m", "24h", "30d"); None when ``value`` is neither, or is
    not greater than 0."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) if abs(value) < 1e300 else math.inf
    elif isinstance(value, str) and (found := PERIOD.fullmatch(value.strip())):
        seconds = float(found[1]) * PERIOD_UNITS[found[2]]
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return None
    return seconds


def period_text(seconds: float) -> str:
    """``seconds`` as a person writes it: the largest unit that divides it ("1h", "90m",
    "30d", "1.5s")."""
    for unit, factor in sorted(PERIOD_UNITS.items(), key=lambda u: -u[1]):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


#: The least ``[tools] max_processes`` and ``max_memory`` may be: a worker itself runs in
#: its task's cgroup, with its threads and its interpreter.
MIN_PROCESSES = 16
MIN_MEMORY = 256 * 1024**2
#: The suffixes of a size in ``[tools] max_memory``: powers of 1024.
SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
SIZE = re.compile(r"([0-9]+)([KMGT])")


@dataclass(frozen=True)
class HooksConfig:
    """Commands the daemon runs on a task's hold, failure or end (``supervisor.hooks``):
    each an argv list, empty for none."""

    on_held: tuple[str, ...] = ()
    on_failed: tuple[str, ...] = ()
    on_done: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = ""  # "HOST:PORT" of the Prometheus endpoint; "" serves none

    @property
    def address(self) -> tuple[str, int] | None:
        """``listen`` as (host, port), the brackets of an IPv6 host taken off; None: off."""
        if not self.listen:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass(frozen=True)
class ConsoleConfig:
    """The console: a web page and a JSON API served by the daemon (docs/design.md
    section 12; ``supervisor.console``)."""

    listen: str = ""  # "HOST:PORT"; "" serves none
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key, served over TLS
    tls_key: Path | None = None
    hostnames: tuple[str, ...] = ()  # the names it is reached by besides listen's host
    session_timeout: float = 8 * 3600.0  # seconds a login lasts

    @property
    def address(self) -> tuple[str, int] | None:
        """``listen`` as (host, port), the brackets of an IPv6 host taken off; None: off."""
        return MetricsConfig(self.listen).address

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is this machine's loopback only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


@dataclass(frozen=True)
class ClusterConfig:
    lease: float = 10.0  # seconds a task's lease lasts unless its holder renews it


#: The shortest lease: a renewal must fit in it, several times over.
MIN_LEASE = 1.0
#: A node's name: what leases, status and logs call it (the hostname by default).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def node_name() -> str:
    """The name this machine's daemon goes by: its hostname (docs/design.md section 10)."""
    import socket  # noqa: PLC0415  (only a node's name needs it: most commands never ask)

    return socket.gethostname() or "localhost"


#: What ``[context] strategy`` may be: who compacts a transcript that outgrows the window.
CONTEXT_STRATEGIES = ("client", "server")


#: The context window of a model family, by model-name prefix: the families known to
#: differ from ``DEFAULT_WINDOW`` (every other Claude model has 200,000 tokens; the 1M
#: window of some takes a beta header agentd does not send).
MODEL_WINDOWS = (("claude-instant-1", 100_000), ("claude-2.0", 100_000))
DEFAULT_WINDOW = 200_000


def model_window(model: str) -> int:
    """The context window of ``model``'s family, in tokens."""
    return next((w for prefix, w in MODEL_WINDOWS if model.startswith(prefix)), DEFAULT_WINDOW)


@dataclass(frozen=True)
class ContextConfig:
    """When and how a long task's transcript is compacted (docs/design.md section 4)."""

    window: int | None = None  # the model's context size in tokens; None: its family's
    compact_at: float = 0.8  # compact once tokens_used reaches this fraction of the window
    keep_turns: int = 4  # the latest turns kept verbatim; the rest become a summary
    strategy: str = "client"
    instructions: str = ""  # appended to the summary instruction

    def window_for(self, model: str) -> int:
        """The window a task on ``model`` has: ``window`` when set, else its family's."""
        return self.window or model_window(model)

    def threshold_for(self, model: str) -> int:
        """``tokens_used`` at or past which a task on ``model`` compacts."""
        return math.ceil(self.compact_at * self.window_for(model))

    @property
    def threshold(self) -> int:
        """The threshold of a task on the default family (or the ``window`` set)."""
        return self.threshold_for("")


#: What ``[telemetry] otlp_protocol`` may be (``OTEL_EXPORTER_OTLP_PROTOCOL`` likewise).
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True)
class TelemetryConfig:
    """OpenTelemetry traces (docs/design.md section 14): exported by the daemon over OTLP
    when ``otlp_endpoint`` (or ``$OTEL_EXPORTER_OTLP_ENDPOINT``) is set."""

    otlp_endpoint: str = ""  # a base URL: /v1/traces is appended (http/protobuf)
    otlp_protocol: str = "http/protobuf"
    capture_content: bool = False  # prompts, replies and tool text in the spans


@dataclass(frozen=True)
class Config:
    spool: Path | None = None
    max_workers: int = 8
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    deadlines: DeadlineConfig = DeadlineConfig()
    restart: RestartConfig = RestartConfig()
    model: ModelConfig = ModelConfig()
    tools: ToolsConfig = ToolsConfig()
    hooks: HooksConfig = HooksConfig()
    metrics: MetricsConfig = MetricsConfig()
    console: ConsoleConfig = ConsoleConfig()
    context: ContextConfig = ContextConfig()
    store: str | None = None  # a postgresql:// URL: the shared store (None: the spool)
    node: str | None = None  # this node's name in a cluster (None: the hostname)
    cluster: ClusterConfig = ClusterConfig()
    mcp: McpConfig = field(default_factory=McpConfig)
    #: every task's budget unless ``submit`` gives one (docs/design.md section 13)
    budget: Budget = field(default_factory=Budget)
    #: ``[prices."PREFIX"]``: over the built-in prices (``worker.budget.price_table``)
    prices: Mapping[str, Price] = field(default_factory=lambda: MappingProxyType({}))
    telemetry: TelemetryConfig = TelemetryConfig()
    approvals: ApprovalsConfig = ApprovalsConfig()
    source: Path | None = None  # the file this was read from, for error messages

    @property
    def price_table(self) -> Mapping[str, Price]:
        """The built-in prices with ``[prices]`` over them (``worker.budget``)."""
        return price_table(self.prices)


# -- loading ---------------------------------------------------------------------------


def load_config(path: Path | None = None, *, environ: Mapping[str, str] = os.environ) -> Config:
    """Read and validate the config file; the defaults when there is none.

    The file is ``path`` when given, else ``$AGENTD_CONFIG`` when set and non-empty,
    else ``paths.discovered_config()``; with none of them ``Config()`` is returned. A file
    that was named but does not exist is an error, not a silent fallback to the
    defaults. ``Config.source`` says which file was read, so that the daemon hands its
    workers the very same one.
    """
    return read_config(path, environ=environ)[0]


def read_config(
    path: Path | None = None, *, environ: Mapping[str, str] = os.environ
) -> tuple[Config, bytes | None]:
    """``load_config``, and the bytes it parsed (None: no file, the defaults). The daemon
    hands workers a copy of exactly the bytes it accepted, so that an edit of the file
    it has not (or could not) reload never reaches a worker."""
    how = ""
    if path is None:
        if named := environ.get(paths.CONFIG_ENV, ""):
            path, how = Path(named), f" (named by ${paths.CONFIG_ENV})"
        elif (path := paths.discovered_config(environ)) is None:
            return Config(), None
    try:
        data = read_regular(path, CONFIG_FILE_LIMIT, follow_symlinks=True)
        if len(data) > CONFIG_FILE_LIMIT:
            raise ConfigError(
                f"{path}: is larger than the 1 MiB a config file may have{how}; "
                "name the config file."
            )
        document = tomllib.loads(data.decode())
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: config file not found{how}; create it with `agentd init` "
            f"or name an existing file."
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder{how}, not a config file.") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file{how}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: is not UTF-8 text; save it as UTF-8.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: is not valid TOML: {e}.") from None
    return _parse(document, path, environ), data


def config_changes(old: Config, new: Config) -> list[str]:
    """The dotted keys whose values differ between two configs (``source`` aside), in the
    order of the fields: what a reload changes."""
    changed = []
    for f in fields(Config):
        if f.name == "source":
            continue
        before, after = getattr(old, f.name), getattr(new, f.name)
        if is_dataclass(before) and is_dataclass(after):
            changed += [
                f"{f.name}.{sub.name}"
                for sub in fields(before)
                if getattr(before, sub.name) != getattr(after, sub.name)
            ]
        elif before != after:
            changed.append(f.name)
    return changed


def _parse(doc: dict[str, Any], source: Path, environ: Mapping[str, str]) -> Config:
    top = _Table(source, "", doc, Config())
    top.check_keys()
    spool = _spool(top, environ) if "spool" in doc else None
    max_workers = top.count("max_workers")

    t = top.table("heartbeat")
    heartbeat = HeartbeatConfig(interval=t.duration("interval"), timeout=t.duration("timeout"))
    if heartbeat.timeout <= heartbeat.interval:
        t.fail(
            "timeout",
            f"must be a number of seconds greater than heartbeat.interval "
            f"({heartbeat.interval}), got {_show(heartbeat.timeout)}",
        )

    t = top.table("deadlines")
    deadlines = DeadlineConfig(
        model_call=t.duration("model_call"), tool_call=t.duration("tool_call")
    )

    t = top.table("restart")
    restart = RestartConfig(
        backoff_initial=t.duration("backoff_initial"),
        backoff_max=t.duration("backoff_max"),
        crash_loop_limit=t.count("crash_loop_limit"),
        stop_grace=t.duration("stop_grace"),
    )
    if restart.backoff_max < restart.backoff_initial:
        t.fail(
            "backoff_max",
            f"must be a number of seconds of at least restart.backoff_initial "
            f"({restart.backoff_initial}), got {_show(restart.backoff_max)}",
        )

    t = top.table("model")
    model = ModelConfig(name=t.text("name"), max_tokens=t.count("max_tokens"))

    t = top.table("tools")
    tools = ToolsConfig(
        modules=_modules(t),
        default=_default_tools(t),
        sandbox=SandboxMode(t.choice("sandbox", [m.value for m in SandboxMode])),
        network=t.flag("network"),
        max_processes=_max_processes(t),
        max_memory=_max_memory(t),
        policy=_policy(t.table("policy", known_keys=False)),
        ask=_tool_patterns(t, "ask"),
        ask_effects=_effects(t, "ask_effects"),
    )

    t = top.table("hooks")
    hooks = HooksConfig(
        on_held=_argv(t, "on_held"), on_failed=_argv(t, "on_failed"), on_done=_argv(t, "on_done")
    )
    metrics = MetricsConfig(listen=_listen(top.table("metrics")))
    console = _console(top.table("console"))
    context = _context(top.table("context"), model)
    store = _store(top) if "store" in doc else None
    node = _node(top) if "node" in doc else None
    t = top.table("cluster")
    cluster = ClusterConfig(lease=t.duration("lease"))
    if cluster.lease < max(MIN_LEASE, 2 * heartbeat.interval):
        t.fail(
            "lease",
            f"must be a number of seconds of at least {MIN_LEASE:g} and at least twice "
            f"heartbeat.interval ({heartbeat.interval}), which renews it; "
            f"got {_show(cluster.lease)}",
        )

    mcp = mcp_settings.parse(top.table("mcp"), tool_call=deadlines.tool_call, network=tools.network)
    t = top.table("budget")
    budget = Budget(usd=_budget_usd(t), tokens=_budget_tokens(t))
    prices = _prices(top.table("prices", known_keys=False))
    if budget.usd is not None and price_of(model.name, price_table(prices)) is None:
        t.fail(
            "usd",
            f"needs the price of model.name ({model.name!r}), which has none; add "
            f'[prices."{model.name}"] (input, output, ... in USD per million tokens)',
        )
    t = top.table("telemetry")
    telemetry = TelemetryConfig(
        otlp_endpoint=_endpoint(t),
        otlp_protocol=t.choice("otlp_protocol", list(OTLP_PROTOCOLS)),
        capture_content=t.flag("capture_content"),
    )
    t = top.table("approvals")
    approvals = ApprovalsConfig(
        expire_after=t.period("expire_after"), ask_timeout=t.period("ask_timeout")
    )

    return Config(
        spool=spool,
        max_workers=max_workers,
        heartbeat=heartbeat,
        deadlines=deadlines,
        restart=restart,
        model=model,
        tools=tools,
        hooks=hooks,
        metrics=metrics,
        console=console,
        context=context,
        store=store,
        node=node,
        cluster=cluster,
        mcp=mcp,
        budget=budget,
        prices=prices,
        telemetry=telemetry,
        approvals=approvals,
        source=source,
    )


class _Table:
    """One table of the document, next to the dataclass instance that holds its defaults.

    Every accessor validates one key and fails with a message that names the file, the
    dotted key and what is allowed.
    """

    def __init__(self, source: Path, name: str, data: Mapping[str, Any], defaults: Any) -> None:
        self.source = source
        self.name = name
        self.data = data
        self.defaults = defaults

    def key(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def fail(self, key: str, message: str) -> NoReturn:
        raise ConfigError(f"{self.source}: {self.key(key)} {message}.")

    def value(self, key: str) -> object:
        return self.data[key] if key in self.data else getattr(self.defaults, key, None)

    def table(self, key: str, *, known_keys: bool = True) -> _Table:
        """The sub-table ``key``; its keys must be fields of its dataclass if ``known_keys``."""
        data = self.data.get(key, {})
        if not isinstance(data, dict):
            self.fail(key, f"must be a table ([{self.key(key)}]), got {_show(data)}")
        defaults = getattr(self.defaults, key)
        table = _Table(self.source, self.key(key), data, defaults)
        if known_keys:
            table.check_keys()
        return table

    def sub(self, key: str, defaults: Any) -> _Table:
        """The table at the dotted ``key`` below this one (its caller checked that it is a
        table), with ``defaults``: for tables the user names, such as [mcp.servers.NAME]."""
        data: Any = self.data
        for part in key.split("."):
            data = data[part]
        return _Table(self.source, self.key(key), data, defaults)

    def shown(self, value: object) -> str:
        return _show(value)

    def check_keys(self) -> None:
        allowed = [f.name for f in fields(self.defaults) if f.name != "source"]
        for key in self.data:
            if key not in allowed:
                where = f"[{self.name}]" if self.name else "the top level"
                import difflib  # noqa: PLC0415  (only a misspelt key needs it)

                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                shown = key if _TOOL_NAME.fullmatch(key) else _show(key)  # one line, always
                self.fail(shown, f"is not a known key; {where} takes {', '.join(allowed)}{hint}")

    def duration(self, key: str) -> float:
        value = self.value(key)
        try:
            seconds = float(value) if isinstance(value, int | float) else math.nan
        except OverflowError:  # an integer too large for a float (TOML allows any size)
            seconds = math.inf
        if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
            self.fail(key, f"must be a number of seconds greater than 0, got {_show(value)}")
        return seconds

    def period(self, key: str) -> float | None:
        """A period that may be left out (None: never), in seconds or with a unit."""
        value = self.value(key)
        if value is None:
            return None
        seconds = parse_period(value)
        if seconds is None:
            self.fail(
                key,
                'must be a number of seconds greater than 0 or a period such as "90s", "30m", '
                f'"24h" or "30d", got {_show(value)}',
            )
        return seconds

    def count(self, key: str) -> int:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(key, f"must be a whole number of at least 1, got {_show(value)}")
        return value

    def choice(self, key: str, allowed: list[str]) -> str:
        value = self.value(key)
        if not isinstance(value, str) or value not in allowed:
            quoted = [f'"{a}"' for a in allowed]
            options = " or ".join([", ".join(quoted[:-1]), quoted[-1]] if quoted[:-1] else quoted)
            self.fail(key, f"must be {options}, got {_show(value)}")
        return value

    def flag(self, key: str) -> bool:
        value = self.value(key)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {_show(value)}")
        return value

    def text(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str) or not value.strip() or value != value.strip():
            example = _show(getattr(self.defaults, key))
            self.fail(key, f"must be a name such as {example}, got {_show(value)}")
        return value


def _spool(top: _Table, environ: Mapping[str, str]) -> Path:
    value = top.value("spool")
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        top.fail("spool", f"must be the path of a folder, got {_show(value)}")
    home = environ.get("HOME")
    if (value == "~" or value.startswith("~/")) and home:
        path = Path(home + value[1:])
    else:
        path = Path(os.path.expanduser(value))
    if str(path).startswith("~"):
        top.fail("spool", f"starts with a ~ that cannot be expanded, got {_show(value)}")
    # A relative spool is relative to the config file, whatever the daemon's cwd is.
    return path if path.is_absolute() else top.source.parent.absolute() / path


def _store(top: _Table) -> str:
    """``store``: a PostgreSQL URL without a password. The config file is copied into the
    spool for workers (and is often world-readable), so a password never goes in it: it
    goes in PGPASSFILE, the libpq environment or ``$AGENTD_STORE``."""
    value = top.value("store")
    if not isinstance(value, str) or not value.startswith(STORE_SCHEMES):
        top.fail("store", f"must be a postgresql:// URL, got {_show(value)}")
    if url_has_password(value):
        top.fail(
            "store",
            "holds a password, which a config file must not (it is copied into the spool); "
            "give it by PGPASSFILE or PGPASSWORD, or the whole URL by $AGENTD_STORE",
        )
    return value


def url_has_password(url: str) -> bool:
    """Whether ``url`` carries a password, in its user part or as a parameter."""
    userinfo = url.partition("://")[2].partition("/")[0].rpartition("@")[0]
    return ":" in userinfo or "password=" in url.partition("?")[2]


#: What a ``store`` URL starts with: libpq's two schemes.
STORE_SCHEMES = ("postgresql://", "postgres://")


def _node(top: _Table) -> str:
    value = top.value("node")
    if not isinstance(value, str) or not NODE_NAME.fullmatch(value):
        top.fail("node", f"must be a name of letters, digits, '.', '_' and '-', got {_show(value)}")
    return value


def _modules(tools: _Table) -> tuple[str, ...]:
    value = tools.value("modules")
    if not isinstance(value, list | tuple):
        tools.fail("modules", f"must be an array of module names, got {_show(value)}")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not _is_module_name(name):
            tools.fail(
                f"modules[{i}]",
                f'must be a Python module name such as "mypackage.tools", got {_show(name)}',
            )
    return tuple(value)


def _default_tools(tools: _Table) -> tuple[str, ...]:
    """``[tools] default``: the names and globs a task gets when ``--tools`` is not given."""
    return _tool_patterns(tools, "default")


def _tool_patterns(tools: _Table, key: str) -> tuple[str, ...]:
    """An array of tool names and globs, as ``--tools`` takes them."""
    value = tools.value(key)
    if not isinstance(value, list | tuple):
        tools.fail(key, f"must be an array of tool names and globs, got {_show(value)}")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not TOOL_PATTERN.fullmatch(name):
            tools.fail(
                f"{key}[{i}]",
                'must be a tool name or a glob such as "read_file" or "mcp__git__*" (letters, '
                f"digits, _, -, *, ?, [...]), got {_show(name)}",
            )
    return tuple(value)


def _effects(tools: _Table, key: str) -> tuple[str, ...]:
    """An array of effect classes (``worker.tools.effect.Effect``)."""
    value = tools.value(key)
    known = [e.value for e in Effect]
    if not isinstance(value, list | tuple) or not all(v in known for v in value):
        tools.fail(
            key, f"must be an array of effect classes ({', '.join(known)}), got {_show(value)}"
        )
    return tuple(value)


def _max_processes(tools: _Table) -> int:
    value = tools.value("max_processes")
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_PROCESSES:
        tools.fail(
            "max_processes",
            f"must be a whole number of at least {MIN_PROCESSES} (a task's processes and "
            f"threads at once, its worker's included), got {_show(value)}",
        )
    return value


def _max_memory(tools: _Table) -> int:
    value = tools.value("max_memory")
    size = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (found := SIZE.fullmatch(value.strip().upper())):
        size = int(found[1]) * SIZE_UNITS[found[2]]
    if size is None or size < MIN_MEMORY:
        tools.fail(
            "max_memory",
            f'must be a number of bytes or a size such as "2G" (K, M, G, T: powers of '
            f"1024), of at least {size_text(MIN_MEMORY)}, got {_show(value)}",
        )
    return size


def size_text(size: int) -> str:
    """A number of bytes as ``max_memory`` may say it: "2G", "768M" (or the bytes)."""
    for unit, factor in reversed(SIZE_UNITS.items()):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _argv(hooks: _Table, key: str) -> tuple[str, ...]:
    """A command as an argv list (no shell: run ``["sh", "-c", "..."]`` for one)."""
    value = hooks.value(key)
    if not isinstance(value, list | tuple) or not all(
        isinstance(arg, str) and arg and "\0" not in arg for arg in value
    ):
        hooks.fail(
            key,
            'must be a command as an array of strings, such as ["/usr/local/bin/page-me"], '
            f"or [] for none, got {_show(value)}",
        )
    return tuple(value)


def _budget_usd(budget: _Table) -> float | None:
    value = budget.value("usd")
    if value is None:
        return None
    if not valid_usd(value):
        budget.fail("usd", f"must be a number of US dollars of at least 0, got {_show(value)}")
    return float(cast(float, value))


def _budget_tokens(budget: _Table) -> int | None:
    value = budget.value("tokens")
    if value is None:
        return None
    if not valid_tokens(value):
        budget.fail("tokens", f"must be a whole number of tokens of at least 0, got {_show(value)}")
    return cast(int, value)


def _prices(prices: _Table) -> Mapping[str, Price]:
    """``[prices."PREFIX"]``: USD per million tokens. ``input`` and ``output`` are
    required; a cache rate left out is the Messages API's usual one: writes 1.25 (5
    minutes) and 2 (1 hour) times the input's, reads 0.1 times it."""
    table: dict[str, Price] = {}
    for prefix, rates in prices.data.items():
        where = _show(prefix) if not _TOOL_NAME.fullmatch(prefix) else prefix
        if not prefix.strip() or not isinstance(rates, dict):
            prices.fail(
                where,
                'must be a table of rates, such as [prices."claude-sonnet-5-5"] with input = 2.0 '
                "and output = 10.0 (USD per million tokens)",
            )
        row = _Table(prices.source, f"prices.{where}", rates, Price.of(0, 0, 0, 0, 0))
        row.check_keys()
        for key in rates:
            if not valid_usd(rates[key]):
                row.fail(key, f"must be USD per million tokens, 0 or more, got {_show(rates[key])}")
        for key in ("input", "output"):
            if key not in rates:
                row.fail(key, "is required (USD per million tokens)")
        given = {k: Decimal(str(v)) for k, v in rates.items()}
        base = given["input"]
        usual = {"cache_write": base * Decimal("1.25"), "cache_write_1h": base * 2}
        rate = {**usual, "cache_read": base * Decimal("0.1"), **given}
        table[prefix] = Price(*(rate[k] for k in PRICE_KEYS))
    return MappingProxyType(table)


def _endpoint(telemetry: _Table) -> str:
    value = telemetry.value("otlp_endpoint")
    if not isinstance(value, str) or (value and not value.startswith(("http://", "https://"))):
        telemetry.fail(
            "otlp_endpoint",
            'must be the collector\'s base URL, such as "http://127.0.0.1:4318", or "" for '
            f"none, got {_show(value)}",
        )
    return value


def _policy(policy: _Table) -> Mapping[str, str]:
    for tool in policy.data:
        if not _TOOL_NAME.fullmatch(tool):
            policy.fail(
                _show(tool),
                "is not a tool name; a tool name is 1 to 64 letters, digits, _ or -",
            )
        policy.choice(tool, list(TOOL_POLICIES))
    return MappingProxyType(dict(policy.data))


def _console(t: _Table) -> ConsoleConfig:
    """``[console]``: a listen address like ``metrics.listen``; off the loopback, only with
    TLS (``tls_cert`` and ``tls_key``, given together); ``hostnames``, the names a proxy
    or a certificate gives it; ``session_timeout``."""
    listen = _listen(t, example="127.0.0.1:8770")
    cert, key = _file_path(t, "tls_cert"), _file_path(t, "tls_key")
    if (cert is None) != (key is None):
        given, missing = ("tls_cert", "tls_key") if key is None else ("tls_key", "tls_cert")
        t.fail(given, f"is given without console.{missing}; TLS needs both (or neither)")
    names = t.value("hostnames")
    if not isinstance(names, list | tuple) or not all(
        isinstance(n, str) and _HOSTNAME.fullmatch(n) for n in names
    ):
        t.fail(
            "hostnames",
            'must be an array of host names such as ["agentd.example.com"] (no scheme, '
            f"no port), got {_show(names)}",
        )
    console = ConsoleConfig(
        listen=listen,
        tls_cert=cert,
        tls_key=key,
        hostnames=tuple(n.lower() for n in names),
        session_timeout=t.duration("session_timeout"),
    )
    address = console.address
    if address is not None and not is_loopback(address[0]) and not console.tls:
        t.fail(
            "listen",
            f"= {_show(listen)} is not a loopback address, and the console is served there "
            "only over TLS: set console.tls_cert and console.tls_key, or listen on "
            '"127.0.0.1:PORT" (behind a reverse proxy that serves TLS)',
        )
    return console


#: A host name or address of ``[console] hostnames``: letters, digits, dots and dashes,
#: or an IPv6 address in brackets.
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\]")


def _file_path(t: _Table, key: str) -> Path | None:
    """A file named by ``key``: None when left out; relative to the config file's folder,
    ``~`` expanded. Its contents are read where they are used (the console's process,
    ``agentd config check``), not here: every command reads this file, as users who may
    not read a private key."""
    value = t.value(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        t.fail(key, f"must be the path of a PEM file, got {_show(value)}")
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else t.source.parent.absolute() / path


def _listen(metrics: _Table, example: str = "127.0.0.1:9464") -> str:
    """``metrics.listen`` (``console.listen``): "" or HOST:PORT. The host is never implied:
    an address without one would be every interface, and metrics leave the machine only
    when the operator writes an address that lets them (``0.0.0.0:9464``)."""
    value = metrics.value("listen")
    if not isinstance(value, str):
        metrics.fail("listen", f'must be "HOST:PORT" or "" (off), got {_show(value)}')
    if not value:
        return value
    host, colon, port = value.rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    bracketed = host != bare
    wrong = (
        not colon
        or not bare
        or any(c.isspace() or c in "/[]" for c in bare)
        or (":" in bare) != bracketed  # an IPv6 host is written in brackets, [::1]:9464
        or not port.isascii()
        or not port.isdigit()
        or not 1 <= int(port) <= 65535
    )
    if wrong:
        every = "0.0.0.0:" + example.rpartition(":")[2]
        metrics.fail(
            "listen",
            f'must be "HOST:PORT" with a port from 1 to 65535, such as "{example}" '
            f'(this machine only) or "{every}" (every interface), got {_show(value)}',
        )
    return value


def _context(t: _Table, model: ModelConfig) -> ContextConfig:
    window = None if t.value("window") is None else t.count("window")
    if (window or model_window(model.name)) <= model.max_tokens:
        got = _show(window) if window else f"the window of {model.name}, {model_window(model.name)}"
        t.fail(
            "window",
            f"must be a number of tokens greater than model.max_tokens ({model.max_tokens}), "
            f"got {got}",
        )
    compact_at = t.value("compact_at")
    if (
        isinstance(compact_at, bool)
        or not isinstance(compact_at, int | float)
        or not 0 < compact_at < 1
    ):
        t.fail(
            "compact_at",
            f"must be a fraction between 0 and 1, such as 0.8, got {_show(compact_at)}",
        )
    keep_turns = t.value("keep_turns")
    if isinstance(keep_turns, bool) or not isinstance(keep_turns, int) or keep_turns < 0:
        t.fail("keep_turns", f"must be a whole number of at least 0, got {_show(keep_turns)}")
    instructions = t.value("instructions")
    if not isinstance(instructions, str):
        t.fail("instructions", f'must be a string ("" for none), got {_show(instructions)}')
    return ContextConfig(
        window=window,
        compact_at=float(compact_at),
        keep_turns=keep_turns,
        strategy=t.choice("strategy", list(CONTEXT_STRATEGIES)),
        instructions=instructions,
    )


def _is_module_name(name: str) -> bool:
    parts = name.split(".")
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in parts)


def _show(value: object) -> str:
    """A value as the user wrote it in TOML, short and on one line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        # JSON leaves C1 controls and Unicode line separators as they are: escape them too
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
        return text if len(text) <= 60 else text[:56] + '..."'
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= 60 else text[:56] + "..."
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, datetime | date | time):
        return "a date/time"
    return type(value).__name__


# -- the default document --------------------------------------------------------------


def config_document(config: Config) -> dict[str, Any]:
    """``config`` as a TOML document (a plain dict); ``spool`` only when it is set."""
    doc: dict[str, Any] = {}
    if config.spool is not None:
        doc["spool"] = str(config.spool)
    if config.store is not None:
        doc["store"] = config.store
    if config.node is not None:
        doc["node"] = config.node
    doc["max_workers"] = config.max_workers
    for section in (config.heartbeat, config.deadlines, config.restart, config.model):
        name = next(f.name for f in fields(Config) if getattr(config, f.name) is section)
        doc[name] = {f.name: getattr(section, f.name) for f in fields(section)}
    doc["tools"] = {
        "modules": list(config.tools.modules),
        "default": list(config.tools.default),
        "sandbox": config.tools.sandbox.value,
        "network": config.tools.network,
        "max_processes": config.tools.max_processes,
        "max_memory": size_text(config.tools.max_memory),
        "policy": dict(config.tools.policy),
        "ask": list(config.tools.ask),
        "ask_effects": list(config.tools.ask_effects),
    }
    doc["hooks"] = {f.name: list(getattr(config.hooks, f.name)) for f in fields(config.hooks)}
    doc["metrics"] = {"listen": config.metrics.listen}
    console = config.console
    doc["console"] = {"listen": console.listen}
    doc["console"] |= {
        k: str(getattr(console, k)) for k in ("tls_cert", "tls_key") if getattr(console, k)
    }
    doc["console"] |= {
        "hostnames": list(console.hostnames),
        "session_timeout": console.session_timeout,
    }
    doc["cluster"] = {"lease": config.cluster.lease}
    doc["context"] = {  # window only when it is set: left out, each model has its own
        f.name: getattr(config.context, f.name)
        for f in fields(config.context)
        if getattr(config.context, f.name) is not None
    }
    # no limit is no key: TOML has no null
    doc["budget"] = {k: v for k, v in config.budget.to_json().items() if v is not None}
    doc["prices"] = {
        prefix: {k: float(getattr(price, k)) for k in PRICE_KEYS}
        for prefix, price in config.prices.items()
    }
    doc["telemetry"] = {f.name: getattr(config.telemetry, f.name) for f in fields(TelemetryConfig)}
    # never is no key: TOML has no null
    doc["approvals"] = {
        f.name: period_text(getattr(config.approvals, f.name))
        for f in fields(ApprovalsConfig)
        if getattr(config.approvals, f.name) is not None
    }
    return doc


def default_config_document() -> dict[str, Any]:
    """The defaults as a TOML document: what ``default_config_text()`` parses to."""
    return config_document(Config())


# One comment per table and per key, by dotted name, and commented-out examples. The
# values come from the dataclasses above, so the default file cannot drift from the code.
_COMMENTS: dict[str, str] = {
    "": """\
agentd configuration. Every key may be left out: it then takes the default shown here.
Durations are seconds and may be fractional. Check a file with `agentd config check`.
Unless --config or $AGENTD_CONFIG names a file, agentd reads the first that exists of
$XDG_CONFIG_HOME/agentd/agentd.toml (~/.config/agentd/agentd.toml, written by
`agentd init`) and /etc/agentd/agentd.toml (`agentd init --system`).""",
    "spool": """\
Where tasks and their journals live. Default, in order: $STATE_DIRECTORY (which
systemd sets from StateDirectory=), then this key, then $XDG_STATE_HOME/agentd
(~/.local/state/agentd). --spool and $AGENTD_SPOOL override all of them.
"~" is expanded; a relative path is relative to the folder of this file.""",
    "max_workers": "At most this many workers run at once; other tasks wait as `queued`.",
    "heartbeat": """\
Liveness. Each worker publishes a heartbeat every `interval` seconds. A worker
whose heartbeat is older than `timeout` seconds cannot checkpoint any more: its
process group is killed at once and the task restarts with resume.""",
    "heartbeat.interval": "Seconds between two heartbeats of a worker.",
    "heartbeat.timeout": "Seconds without a heartbeat before a worker is hung; more than interval.",
    "deadlines": """\
Progress. A model call or tool call that runs past its deadline is stalled: the
worker gets SIGTERM, then restart.stop_grace seconds, then SIGKILL, and the task
restarts with resume.""",
    "deadlines.model_call": "Seconds one model call may take.",
    "deadlines.tool_call": "Seconds one tool call may take.",
    "restart": "What happens after a worker dies or is killed.",
    "restart.backoff_initial": """\
A crash after progress restarts at once; repeated crashes wait an exponential
backoff with jitter that starts at this many seconds...""",
    "restart.backoff_max": """\
...and never exceeds this many seconds. A storage fault (a full, failing or read-only
disk) is no crash: its task waits 0.5 s, doubling up to this same cap, for as long as
the fault lasts, and is retried at once when the daemon's own writes succeed again.""",
    "restart.crash_loop_limit": """\
The same turn crashing this many times ends the task as `failed`, reason `crash_loop`.""",
    "restart.stop_grace": """\
Seconds between SIGTERM and SIGKILL of a worker (stall, cancel, rewind, `agentd stop`).
For a rewind and a stop only the worker gets SIGTERM and stops at its next safe point
(a model call at once, a tool call once its result is recorded); a tool call still
running after this long is killed and is dangling on resume (an unsafe one holds the
task). Keep TimeoutStopSec= of the systemd unit comfortably above it.""",
    "model": "Model calls. `agentd submit --model` overrides the name for one task.",
    "model.name": "The model name sent to the Messages API.",
    "model.max_tokens": "The max_tokens of every model call.",
    "tools": "Tools beyond the built-in ones, and how run_command is contained.",
    "tools.modules": """\
Python modules that define extra tools, imported by every worker, for example
["mycompany.agent_tools"]. They must be importable in agentd's environment.""",
    "tools.default": """\
The tools a task gets when `agentd submit --tools` is not given: names and globs. "*"
is every built-in tool and every tool of the modules above; an MCP server's tools are
offered only where a name or glob that begins with "mcp__" names them, such as
"mcp__git__*" (docs/guides/mcp.md).""",
    "tools.sandbox": """\
Containment of run_command and of MCP servers on bubblewrap (bwrap, Debian package
`bubblewrap`): its own PID, IPC and mount namespaces, the workspace as the only writable place, the
spool and this file's folder invisible, /proc showing its own processes only, and
every process it starts killed when the call ends. "auto" uses bwrap when it works
here and runs commands bare otherwise, saying so at start (sandbox_unavailable, the
status header, agentd_sandbox_available 0); "required" refuses to start the daemon
(exit 78), and a call (an error result, shown in `agentd status`), when bwrap is
missing or cannot create namespaces; "off" never uses it. With a store configured,
"auto" is "required". `agentd init --system` writes "required".""",
    "tools.network": """\
false: run_command gets a network namespace of its own, loopback only (under bwrap).""",
    "tools.max_processes": """\
Where the daemon can delegate cgroups v2 (`agentd status`: "cgroups: delegated"), each
task's worker and every process its tools start run in a cgroup of the task's own: at
most this many processes and threads at once (pids.max), so a fork bomb in one task
cannot starve the others. Without cgroups, a worker the machine cannot start waits in
`backoff` (reason "resources: ...") and the task never fails for it.""",
    "tools.max_memory": """\
The memory the task's cgroup may use (memory.max), in bytes or as "512M", "2G"; past it
the kernel reclaims, then kills a process of that task only.""",
    "tools.policy": """\
What a dangling call of a tool (started, never recorded as finished) gets on resume:
"rerun" runs it again, "hold" waits for an operator (`agentd dangling`,
`agentd approve-dangling`). A tool not listed follows its effect class: read_only,
idempotent and keyed tools rerun, unsafe tools hold.""",
    "tools.ask": """\
Tools whose calls wait for an operator's approval before they run (names and globs, as
`agentd submit --tools` takes them, such as "run_command" or "mcp__git__git_commit"):
the call's intent is recorded, the task is held with reason "approval: TOOL", and
`agentd approve-dangling TASK CALL --rerun` runs it (--skip refuses it, --result
records a result in its place). `agentd submit --ask` adds tools for one task
(docs/guides/tools.md).""",
    "tools.ask_effects": """\
Effect classes whose calls wait for approval the same way, such as ["unsafe"].""",
    "hooks": """\
Commands the daemon runs (as itself, in no sandbox, without the API key) when a task
is held for an operator, fails or is done: an argv list, with the event as one JSON
object on stdin ("event", "task", "reason", "node", and "dangling" for a hold) and
AGENTD_EVENT, AGENTD_TASK in the environment. One that fails or runs past 10 s is
killed and logged as hook_failed; the daemon never waits for a hook. Checked to exist
by `agentd config check`.""",
    "hooks.on_held": "Run when a task is held: a dangling call waits for a decision.",
    "hooks.on_failed": "Run when a task fails (given up after crashes, or failed by its worker).",
    "hooks.on_done": "Run when a task is done.",
    "metrics": """\
Prometheus metrics, served by the daemon at http://LISTEN/metrics (docs/reference/metrics.md).""",
    "metrics.listen": """\
"HOST:PORT" to serve them on, "" for none. The host is required: "127.0.0.1:9464" keeps
them on this machine, "0.0.0.0:9464" (or an interface's address) offers them to others.""",
    "console": """\
The console (docs/guides/console.md): a web page and a JSON API, served by the daemon at
LISTEN, that show every task and its transcript and act on them (decide held calls,
cancel, retry, rewind, fork) as the CLI does. `agentd console` prints the URL to log in
with, `agentd console --token` mints an API token for scripts.""",
    "console.listen": """\
"HOST:PORT" to serve it on, "" for none. A loopback address ("127.0.0.1:8770") keeps it
on this machine (reach it through an SSH tunnel or a reverse proxy); any other address
is served only over TLS (tls_cert and tls_key), else the config is refused.""",
    "console.hostnames": """\
The names browsers reach it by besides the listen address and localhost: the name in a
TLS certificate, or a reverse proxy's ("agentd.example.com"). A request for any other
Host is refused (403), as is a cross-site one (its Origin).""",
    "console.session_timeout": "Seconds a login lasts; then `agentd console` prints a new one.",
    "context": """\
Long tasks (docs/guides/long-tasks.md, "Compaction"). When the context the model saw at
its last call plus what it wrote reaches compact_at of the window, the worker asks the
model for a summary of the transcript except its latest keep_turns turns, records it,
and goes on from the prompt, the summary and the kept turns. A prompt the API calls
too long is compacted once and retried. The journal keeps every turn: history and
rewind see them all.
window is the model's context size in tokens, more than model.max_tokens; left out, it
is the window of the task's model family: 200000 for the Claude models (100000 for
claude-instant-1 and claude-2.0; the 1M window of some takes a beta header agentd does
not send). Set it for a model not listed, or a proxy with a window of its own.""",
    "context.compact_at": "The fraction of the window at which to compact, above 0 and below 1.",
    "context.keep_turns": """\
The latest turns kept verbatim in a compaction (0 or more); a lower value frees more
room when a compacted prompt is still too long.""",
    "context.strategy": """\
"client": agentd makes the summary call, on every backend. "server": the Messages API
compacts by itself (the anthropic backend's beta compact_20260112 edit, triggered at
compact_at of the window); its compaction blocks are recorded with their turn and sent
back verbatim. A backend without it (scripted) compacts as "client" and says so in a
context_strategy_fallback warning event.""",
    "store": """\
Several nodes on one PostgreSQL (docs/guides/cluster.md): a postgresql:// URL
puts every task, its journal and the queue in that database, shared by every node
given the same URL. Left out, tasks live in the spool. --store and $AGENTD_STORE
override it. No password here: PGPASSFILE, PGPASSWORD or $AGENTD_STORE (the whole URL).""",
    "node": """\
This node's name in the cluster (leases, status, logs); default the hostname. --node
and $AGENTD_NODE override it. Two live nodes never share a name.""",
    "cluster": "The shared store (store): how long a node keeps a task it runs.",
    "cluster.lease": """\
Seconds a task's lease lasts unless renewed. Its worker renews it from its heartbeat;
a node that dies, hangs or loses the database for longer loses its tasks to the other
nodes, and a worker that could not renew in time stops itself before it ends. At
least twice heartbeat.interval.""",
    "context.instructions": "Appended to the summary instruction, e.g. what must never be dropped.",
    "mcp": """\
MCP tool servers (docs/guides/mcp.md): each [mcp.servers.NAME] (NAME: lower-case words
joined by _, at most 32 characters) is a server whose tools a task may be offered as
mcp__NAME__TOOL. A stdio server (command) runs in the task's sandbox, cwd the workspace,
with a scrubbed environment plus env; a Streamable HTTP server (url) gets headers.
${cred:NAME} in env and headers is read from $CREDENTIALS_DIRECTORY/NAME, else from the
file $AGENTD_CRED_NAME_FILE (NAME upper-cased) names: never write a secret here.
trust = true uses the server's annotations for effect classes (readOnlyHint: read_only,
else idempotentHint: idempotent, else unsafe); effects always wins; untrusted tools are
unsafe. timeout (at most deadlines.tool_call, its default) bounds a call; network
defaults to [tools] network. Needs the SDK: pip install 'agentd[mcp]'.""",
    "budget": """\
What every task may spend unless `agentd submit --budget-usd X --budget-tokens N` says
otherwise (docs/guides/budgets.md); no key, no limit. usd is US dollars at the prices
below; tokens counts input, output, cache writes and cache reads, over the task's whole
life (every branch, summary calls included). Once a model call brings a task to its
budget or past it, the task is held before its next call (reason "budget: $1.35 of
$1.00"), and `agentd budget TASK --usd X` raises the budget and resumes it. A USD budget
for a model without a price is refused (exit 78).""",
    "prices": """\
USD per million tokens, by model-name prefix (the longest matching prefix wins), over
the built-in prices of the Claude models (`agentd config check` says when they were
taken): input, output, cache_write (5-minute cache writes), cache_write_1h, cache_read.
input and output are required; a cache rate left out is 1.25, 2 and 0.1 times input.""",
    "telemetry": """\
OpenTelemetry traces over OTLP (docs/guides/traces.md): one trace per task across every
restart, with an invoke_agent span per worker run and chat and execute_tool spans
within it. Needs the otel extra (pip install 'agentd[otel]'). On when otlp_endpoint or
$OTEL_EXPORTER_OTLP_ENDPOINT is set (the environment wins), off with
OTEL_SDK_DISABLED=true; $OTEL_EXPORTER_OTLP_HEADERS (a secret: never in a worker, a
tool or the spool) and $OTEL_EXPORTER_OTLP_PROTOCOL are honoured. An exporter that is
slow or away never slows a task: spans are batched, and dropped when the queue is full.""",
    "telemetry.otlp_endpoint": """\
The collector's base URL, such as "http://127.0.0.1:4318" ("/v1/traces" is appended for
http/protobuf; "http://127.0.0.1:4317" for grpc); "" for none.""",
    "telemetry.otlp_protocol": '"http/protobuf" or "grpc".',
    "telemetry.capture_content": """\
true: the spans carry the prompts, the model's replies and the tools' inputs and
results (gen_ai.input.messages, ...); false: names, counts and outcomes only.""",
    "approvals": """\
How long approvals last (docs/guides/tools.md). A period is
seconds, or a string with a unit: "90s", "30m", "24h", "30d"; left out, never.
expire_after: a decision (`agentd approve-dangling`, the console) that no worker has
used this long after it was made is void: the call is held again as a new attempt
(event approval_expired). ask_timeout: a call asked before it runs and not answered
this long after it was asked is skipped; the model is told "no approval within 1h"
(the period as given).""",
}
_EXAMPLES: dict[str, str] = {
    "spool": 'spool = "/var/lib/agentd"',
    "store": 'store = "postgresql://agentd@db.example.com/agentd"\nnode = "web-1"',
    "tools.policy": 'append_file = "rerun"\nrun_command = "hold"',
    "hooks": 'on_held = ["sh", "-c", "curl -fsS -d @- https://hooks.example.com/agentd"]',
    "metrics": 'listen = "127.0.0.1:9464"',
    "console": (
        'listen = "127.0.0.1:8770"\n'
        'tls_cert = "/etc/agentd/console.crt"   # PEM files, both or neither: served over TLS\n'
        'tls_key = "/etc/agentd/console.key"    # (paths relative to this file\'s folder)'
    ),
    "context": "window = 200000",
    "mcp": """\
[mcp.servers.git]
command = ["mcp-server-git", "--repository", "."]
env = {GIT_AUTHOR_NAME = "agent", GIT_AUTHOR_EMAIL = "agent@example.com"}
trust = true
effects = {git_commit = "unsafe"}
timeout = 60

[mcp.servers.tracker]
url = "https://mcp.example.com/mcp"
headers = {Authorization = "Bearer ${cred:tracker_token}"}""",
    "budget": "usd = 5.0\ntokens = 2000000",
    "approvals": 'expire_after = "24h"\nask_timeout = "1h"',
    "prices": '[prices."my-proxy-model"]\ninput = 3.0\noutput = 15.0\ncache_read = 0.3',
}


def _comment(key: str, table: Mapping[str, str] = _COMMENTS) -> str:
    text = table.get(key)
    return "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines()) if text else ""


def _render_table(name: str, table: Mapping[str, Any]) -> str:
    import tomli_w  # noqa: PLC0415  (only `agentd init` writes TOML: loading a config reads it)

    head = f"{_comment(name)}[{name}]\n{_comment(name, _EXAMPLES)}"
    keys: list[str] = []
    subtables: list[str] = []
    for key, value in table.items():
        dotted = f"{name}.{key}"
        if isinstance(value, dict):
            subtables.append(_render_table(dotted, value))
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            # on one line (tomli_w writes an array an item a line): a JSON string is a
            # TOML basic string
            items = ", ".join(json.dumps(v, ensure_ascii=False) for v in value)
            keys.append(_comment(dotted) + f"{key} = [{items}]\n")
        else:
            keys.append(_comment(dotted) + tomli_w.dumps({key: value}))
    if keys and name in _EXAMPLES:
        head += "\n"
    return "\n".join([head + "\n".join(keys), *subtables])


@functools.cache
def _render_default() -> str:
    """The default document as TOML, every table and key under its comment: rendered
    when first asked for (``agentd init``), not by every command that loads a config."""
    import tomli_w  # noqa: PLC0415  (the same)

    blocks = [_comment(""), _comment("spool") + _comment("spool", _EXAMPLES)]
    blocks.append(_comment("store") + "#\n" + _comment("node") + _comment("store", _EXAMPLES))
    for key, value in default_config_document().items():
        if isinstance(value, dict):
            blocks.append(_render_table(key, value))
        else:
            blocks.append(_comment(key) + tomli_w.dumps({key: value}))
    blocks.append(_comment("mcp") + _comment("mcp", _EXAMPLES))  # no server by default
    return "\n".join(blocks)


#: What ``agentd init --system`` writes in place of the default sandbox: the service
#: never runs a tool bare, and a unit that would leave bwrap no namespaces stops the start.
SYSTEM_SANDBOX = """\
# Written by `agentd init --system`: a machine's service never runs a command bare.
sandbox = "required"
"""


def default_config_text(*, system: bool = False) -> str:
    """The commented default config (``config/agentd.toml``): every key at its default,
    each under a comment; for the machine's service (``system``), ``[tools] sandbox =
    "required"``."""
    if not system:
        return _render_default()
    head, _, tail = _render_default().partition('\nsandbox = "auto"\n')
    return head + "\n" + SYSTEM_SANDBOX + tail
