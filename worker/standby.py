"""What a standby worker does ahead of its task (the fork server keeps one: worker/forkserver.py).

A standby is forked from the fork server before any task needs it, so a start takes no
fork. Before it is given a task it holds nothing of one: no task file is open, its
environment is the fork server's (the workers' own, which holds no secret), and the
secrets it holds in memory are the fork server's, which every forked worker inherits.
What it may do ahead is what no task's data goes into: reading the config file the
daemon gives its workers, and building the HTTP client of the SDK's client
(``worker.models.messages_api.prepare_http_client``: no secret, no socket). The config
read is used only while the file is the one read (``ConfigAhead.current``): a file
rewritten since (a reload) is read again at the start; the HTTP client only while the
environment it read (proxies, CA files) is the task's.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from worker.config import Config, load_config
from worker.errors import ConfigError


def file_stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a file from the same path rewritten: its inode, size and times."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class ConfigAhead:
    """A worker config read ahead of the task: the file, as it was when read, and what
    it says."""

    path: Path
    stamp: tuple[int, int, int, int]
    config: Config

    @classmethod
    def read(cls, path: Path) -> ConfigAhead | None:
        """The config at ``path`` read now; None when it cannot be (the worker reads it at
        its start and says what is wrong there)."""
        stamp = file_stamp(path)
        if stamp is None:
            return None
        with contextlib.suppress(ConfigError, OSError):
            config = load_config(path)
            if file_stamp(path) == stamp:  # (not rewritten while it was read)
                return cls(path, stamp, config)
        return None

    def current(self, path: Path | None) -> Config | None:
        """The config read ahead, if ``path`` is the file it was read from and that file
        has not changed since; else None (read it again)."""
        if path is None or Path(path) != self.path or file_stamp(self.path) != self.stamp:
            return None
        return self.config
