"""The daemon's config and secrets, and what SIGHUP does to them (docs/design.md section
7): the config file read again, accepted whole or refused in one line, and the secrets
read from ``NAME_FILE`` sources read again.

``Settings`` holds the config in use and the file it came from, the copy workers read
(``WORKER_CONFIG``: an edit of the operator's file reaches workers only through a reload
that accepts it) and the secrets the daemon holds. ``reload`` says what changed; the
daemon applies it (the fork server started again with new secrets, the limits applied at
the next verdict).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor import logging as agentd_logging
from worker import credentials
from worker.config import Config, config_changes, read_config
from worker.errors import ConfigError, StorageError
from worker.events import Event
from worker.store.durable import atomic_write

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor

#: In the spool: a copy of the config file as the daemon last accepted it, which workers
#: read. An edit of the operator's file reaches them only through a reload that accepts it.
WORKER_CONFIG = "config.toml"
#: Keys a reload applies at once: the daemon reads them at each decision.
LIVE_KEYS = ("max_workers", "heartbeat.timeout", "deadlines.", "restart.", "hooks.", "console.")
#: Keys a worker reads when it starts: workers started after the reload have them.
WORKER_KEYS = ("heartbeat.interval", "model.", "tools.", "mcp.")

#: ``emit(event, level=..., **fields)``: the daemon's log line for an event of its own.
Emit = Callable[..., None]


@dataclass(frozen=True)
class Reloaded:
    """A reload the daemon accepted: the config keys that changed, by when they apply,
    and the names of the secrets read again that changed."""

    changed: list[str]
    applied: list[str]  # at once
    new_workers: list[str]  # by workers started from now on
    restart_needed: list[str]  # the spool first: the daemon serves the spool it started on
    renewed: list[str] = field(default_factory=list)


class Settings:
    def __init__(
        self, spool_root: Path, config: Config, config_path: Path | None, emit: Emit
    ) -> None:
        self.spool_root = spool_root
        self.config = config
        self.config_path = config_path
        self.worker_config = config_path  # what workers read (WORKER_CONFIG once accepted)
        # the bytes of the file accepted (b"": none, the defaults); None before the first
        self.accepted: bytes | None = None
        self.credentials = credentials.held()
        self.emit = emit

    @property
    def file(self) -> Path | None:
        """The file the daemon's config was read from, which HUP reads again (None: no
        file, the defaults)."""
        return self.config_path or self.config.source

    def accept_file(self, *, at_start: bool, renewed: list[str] | None = None) -> bool:
        """Read the config file and, when it validates, make it the daemon's and copy its
        bytes to ``WORKER_CONFIG`` for workers. At start the config the command line read
        a moment ago is in use already: a file changed since is refused as at a reload,
        and workers are given the file itself (as without the copy)."""
        try:
            config, data = read_config(self.file)
            if data is not None:
                atomic_write(self.spool_root / WORKER_CONFIG, data)
        except (ConfigError, StorageError, OSError) as exc:  # OSError: syncing the folder
            # (``renewed``: the secrets a reload read again that changed, applied all the same)
            fields: dict[str, Any] = {"renewed": renewed} if renewed else {}
            self.emit(
                Event.CONFIG_RELOAD_FAILED,
                level="warning",
                reason=str(exc),
                at_start=at_start,
                **fields,
            )
            return False
        self.config = config
        self.accepted = data or b""
        self.worker_config = self.spool_root / WORKER_CONFIG if data is not None else None
        return True

    def reread_credentials(self) -> list[str]:
        """The secrets read from a ``NAME_FILE`` are read again; the names of those that
        changed, which from now on are the daemon's. A file that cannot be read is refused
        (``config_reload_failed``, naming it): the secrets in use stay."""
        try:
            renewed = credentials.reread(self.credentials)
        except ConfigError as exc:
            self.emit(Event.CONFIG_RELOAD_FAILED, level="warning", reason=str(exc), at_start=False)
            return []
        before = self.credentials.values
        changed = sorted(k for k, v in renewed.values.items() if before.get(k) != v)
        if changed:
            credentials.hold(renewed)
            self.credentials = renewed
        return changed

    def reload(self, renewed: list[str]) -> Reloaded | None:
        """Read the config file again (``renewed``: the secrets that changed, said with
        it). A file that does not validate, or a copy for workers that cannot be written,
        is refused: ``config_reload_failed`` with the one-line reason, and the config in
        use stays (None). A good one is the daemon's, and ``config_reloaded`` lists the
        keys that changed, by when they apply."""
        before = self.config
        if not self.accept_file(at_start=False, renewed=renewed):
            return None
        changed = config_changes(before, self.config)
        applied = [key for key in changed if key.startswith(LIVE_KEYS)]
        new_workers = [key for key in changed if key.startswith(WORKER_KEYS)]
        restart = [key for key in changed if key not in applied and key not in new_workers]
        done = Reloaded(changed, applied, new_workers, restart, renewed)
        self.emit(
            Event.CONFIG_RELOADED,
            file=str(self.file) if self.file else None,
            changed=done.changed,
            applied=done.applied,
            new_workers=done.new_workers,
            restart_needed=done.restart_needed,
            renewed=done.renewed,  # the secrets read again from their files that changed
        )
        return done


class Reloader:
    """The daemon's role that carries out SIGHUP (``reload``)."""

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon

    def reload(self) -> None:
        """SIGHUP: reopen the log file (for logrotate), read the secrets kept in files and
        the config file again (``supervisor.reload``). A good config is applied: at once
        (max_workers, heartbeat.timeout, deadlines, restart, hooks, console: judged at the
        next verdict), by workers started from now on (heartbeat.interval, model, tools,
        mcp), or at the next start (anything else, the spool first). A lower max_workers
        stops no running worker; it starts no more until the count is under it. Secrets
        that changed go to the workers started from now on (the fork server is started
        again with them) and, the store's, to its next login."""
        daemon = self.daemon
        try:
            reopened = agentd_logging.reopen_log_file()
        except OSError as exc:
            daemon.emit(Event.LOG_REOPEN_FAILED, level="warning", error=str(exc))
        else:
            if reopened is not None:
                daemon.emit(Event.LOG_REOPENED, path=str(reopened))
        renewed = daemon.settings.reread_credentials()
        if renewed:
            held = daemon.settings.credentials
            if credentials.STORE in renewed:
                try:  # a password that stopped working is a wait, until this new one
                    daemon.placement.relogin(held.values[credentials.STORE])
                except ConfigError as exc:
                    daemon.emit(Event.CONFIG_RELOAD_FAILED, level="warning", reason=str(exc))
            if daemon.forks is not None:
                daemon.forks.renew(held.for_workers())
            daemon.announcer.publish_info()
        before = daemon.config
        if daemon.settings.reload(renewed) is None:
            return
        daemon.liveness.rejudge_all()  # every worker judged by the new limits now
        if daemon.forks is not None:  # the standby read the old config ahead: a new one
            daemon.forks.renew_standby()
        if daemon.surfaces.reload(before) and daemon.announcer.info:  # the console moved
            daemon.announcer.info.update(daemon.surfaces.console_info())
            daemon.announcer.publish_info()
        daemon.wake()
