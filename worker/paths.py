"""Where agentd looks when nobody says where: the config file and the spool.

A module of the standard library alone, so that ``supervisor.answer`` (asked before the
command line is parsed) finds the same files as the command line would, at the cost of
no import: ``load_config`` and ``resolve_spool`` read these, and so does it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The environment variable that names the config file when no path is given.
CONFIG_ENV = "AGENTD_CONFIG"
#: A config file is read up to this many bytes and one more, never further: a wrong path
#: (``/dev/zero``, a log) is refused in one line instead of being read into memory.
CONFIG_FILE_LIMIT = 1024 * 1024

#: The machine-wide config file, read when no other is named or found in the user's
#: config folder; ``agentd init --system`` writes it. Looked up at each call, so a test
#: can point it elsewhere.
SYSTEM_CONFIG = Path("/etc/agentd/agentd.toml")


def user_config_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CONFIG_HOME/agentd/agentd.toml`` (``~/.config/agentd/agentd.toml``): the
    file ``agentd init`` writes and discovery looks at first."""
    base = environ.get("XDG_CONFIG_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec: a relative value is to be ignored
        base = str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "agentd" / "agentd.toml"


def discovered_config(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The config file nobody named: the first that exists of the user's and the
    machine's (``SYSTEM_CONFIG``), or None for the built-in defaults."""
    for candidate in (user_config_path(environ), SYSTEM_CONFIG):
        if candidate.exists():
            return candidate
    return None


def named_config(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The config file a command reads when ``--config`` is not given: ``$AGENTD_CONFIG``
    when set and non-empty, else ``discovered_config``; None: the built-in defaults."""
    if named := environ.get(CONFIG_ENV, ""):
        return Path(named)
    return discovered_config(environ)


def default_spool(environ: Mapping[str, str] = os.environ) -> Path:
    """The spool nobody named: systemd's ``$STATE_DIRECTORY``, else
    ``$XDG_STATE_HOME/agentd`` (``~/.local/state/agentd``)."""
    if state := environ.get("STATE_DIRECTORY"):
        return Path(state.split(":")[0])
    xdg = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "agentd"
