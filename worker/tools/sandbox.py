"""Containment of ``run_command`` on bubblewrap (docs/design.md section 5).

A command runs as ``bwrap ... -- /bin/sh -c COMMAND`` where bwrap works, so that it has:

* its own PID namespace (``--unshare-pid``, with ``--die-with-parent``): the command is
  process 2 under bwrap's own init, and when that init exits (the command ended) or is
  killed (a timeout, or its worker died: the death signal), the kernel kills every process
  left in the namespace, also one that called ``setsid``, double-forked or daemonized. It
  sees and can signal no process outside: not the daemon, not another task;
* its own IPC namespace, and with ``[tools] network = false`` its own network namespace
  (loopback only);
* ``/proc`` of its own namespace, a minimal ``/dev``, a private ``/tmp`` of bounded size;
* a filesystem that hides by default: an empty root, read-only, in which only the
  system's folders (``worker.tools.installation.SYSTEM``: /usr, /bin, /sbin, /lib*, /etc,
  /opt) are bound read-only, with the file ``/etc/resolv.conf`` leads to; the command's
  own installation read-only, wherever it is (``installed``: a server's venv or
  ``node_modules``, its interpreter); and the workspace read-write, the only writable
  place that outlives the call. Nothing else of the host is there: no /home, /root,
  /var, /run, /srv, /mnt, no host /tmp, so no spool, no key and no task, also one made
  after the process started;
* within what it shows, the spool, the config file (and its folder, when that is a
  folder of its own), the API key's file or credentials folder, with a store the files
  and socket folders libpq could log in with (``worker.credentials.store_paths``), and
  every other task's workspace (``others``, asked at each call) covered by empty
  read-only mounts: a config in /etc/agentd, a spool or another task's workspace inside
  this task's workspace;
* no capabilities (``--cap-drop ALL``: agentd may run as root), a new session (no
  terminal to inject into), and a cleared environment plus the scrubbed tool environment
  (``worker.tool_calls.tool_environment``).

Mounts are made in the order of their depth, so a mount always lands on top of the ones
that contain it: the workspace shows through a hidden folder that holds it, and a hidden
folder inside the workspace (a spool in the user's repository) stays hidden.

``[tools] sandbox`` says what happens without a working bwrap: ``auto`` runs the command
bare (the containment that remains is the worker's process-group kill), ``required``
refuses the call with a one-line reason (``SandboxRefused``, an error tool_result), and
``off`` never uses bwrap. Whether bwrap works (it is installed, and the kernel lets it
create namespaces) is probed once per worker process and cached. Each call's verdict
(``Sandbox.verdict``) is also handed to ``on_verdict``: the worker publishes it in its
heartbeat, and ``agentd status`` shows it.

``--die-with-parent`` arms ``PR_SET_PDEATHSIG``, which fires when the *thread* that
started bwrap ends, not the process: the worker runs tools on its main thread, which
lives as long as the worker does.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from worker.tools.installation import SYSTEM, in_system, installed

SHELL = "/bin/sh"
PRIVATE_TMP = "/tmp"  # noqa: S108  (a fresh tmpfs of the sandbox's own, not the host's /tmp)
#: Bytes the sandbox's /tmp may hold (bwrap ``--size``, since 0.5): a tmpfs lives in
#: memory, and a command that fills it gets ENOSPC instead of taking the host's memory.
PRIVATE_TMP_SIZE = 256 * 1024 * 1024
PROBE_TIMEOUT = 10.0  # seconds: bwrap starts in milliseconds when it works at all


#: A path below the host's /tmp or /var/tmp named in a command (``Sandbox.unseen``).
_HOST_TMP = re.compile(r"(?<![\w.~/-])/(?:var/)?tmp/[^\s'\";|&<>()`$*?]+")


class SandboxMode(StrEnum):
    """``[tools] sandbox``: what run_command does about bubblewrap."""

    AUTO = "auto"  # bwrap when it works, else bare
    REQUIRED = "required"  # bwrap, or the call is refused
    OFF = "off"  # never bwrap


def mode_for(mode: SandboxMode, *, store: bool) -> SandboxMode:
    """The mode in force: with a store configured (PostgreSQL), ``auto`` is ``required``,
    as a bare tool could reach the store's credentials and every task of the cluster, and
    would outlive a frozen worker that the kernel killed at its lease's end
    (``worker.killtimer``): only the sandbox dies with its worker."""
    return SandboxMode.REQUIRED if store and mode is SandboxMode.AUTO else mode


class SandboxRefused(Exception):
    """Under ``required``, bwrap is missing or cannot run: the call must not run bare."""


@dataclass(frozen=True)
class Sandbox:
    """How run_command contains its commands: the ``[tools]`` settings, the paths to hide
    where the sandbox would show them (and ``others``: more of them, asked at each call,
    such as the other tasks' workspaces), and the bwrap to use (a name looked up on
    ``PATH``, or a path)."""

    mode: SandboxMode = SandboxMode.AUTO
    network: bool = True
    hidden: tuple[Path, ...] = ()
    bwrap: str = "bwrap"
    on_verdict: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    others: Callable[[], Iterable[Path]] | None = field(default=None, compare=False, repr=False)

    def problem(self) -> str | None:
        """Why bwrap cannot contain a command here (probed once a process), or None."""
        return probe(self.bwrap, self.network).problem

    def verdict(self) -> str:
        """How commands run: ``bwrap``, ``off``, ``bare: WHY`` (auto) or ``refused: WHY``."""
        if self.mode is SandboxMode.OFF:
            return "off"
        problem = self.problem()
        if problem is None:
            return "bwrap"
        return f"{'refused' if self.mode is SandboxMode.REQUIRED else 'bare'}: {problem}"

    def argv(self, command: str, workspace: Path, env: Mapping[str, str]) -> list[str]:
        """What to execute for ``command`` (bwrap's own arguments carry the environment).

        Raises ``SandboxRefused`` under ``required`` when bwrap cannot run."""
        return self.wrap([SHELL, "-c", command], workspace, env)

    def wrap(
        self,
        argv: Sequence[str],
        workspace: Path,
        env: Mapping[str, str],
        *,
        binds: Sequence[Path] = (),
        shown: Sequence[Path] = (),
    ) -> list[str]:
        """What to execute for ``argv``: under bwrap, with ``binds`` (folders that may be
        hidden, such as a task's private GIT_DIR in the spool) also mounted writable and
        ``shown`` read-only, each at its own path, and the installation of ``argv``
        (``installed``, on the ``PATH`` of ``env``) read-only; ``argv`` itself where the
        command would run bare."""
        verdict = self.verdict()
        if self.on_verdict is not None:
            self.on_verdict(verdict)
        if verdict.startswith("refused"):
            raise SandboxRefused(
                f"run_command refused: [tools] sandbox is required and {self.problem()}; "
                "the command did not run"
            )
        if verdict != "bwrap":
            return list(argv)
        inner = {**env, "TMPDIR": PRIVATE_TMP} if "TMPDIR" in env else dict(env)
        program = installed(argv, env.get("PATH"), workspace=workspace).paths
        extra = [(Path(os.path.realpath(path)), "--bind") for path in binds] + [
            (Path(os.path.realpath(path)), "--ro-bind") for path in [*shown, *program]
        ]
        return [
            probe(self.bwrap, self.network).path,
            *namespace_options(self.network),
            *mount_options(Path(os.path.realpath(workspace)), self._hidden(), extra),
            "--clearenv",
            *(arg for key, value in inner.items() for arg in ("--setenv", key, value)),
            "--",
            *argv,
        ]

    def unseen(self, command: str, workspace: Path) -> str:
        """A note for a command that names a file under the host's /tmp or /var/tmp which
        the sandbox does not show (its /tmp is its own: the file is not there), or ''.
        A path of the spool, the config, a key or another task is never named."""
        found: list[str] = []
        for match in _HOST_TMP.finditer(command):
            text = match.group(0).rstrip(".,:")
            real = Path(os.path.realpath(text))
            if not os.path.lexists(text) or real.is_relative_to(os.path.realpath(workspace)):
                continue
            if any(real.is_relative_to(os.path.realpath(h)) for h in self._hidden()):
                continue
            if text not in found:
                found.append(text)
        if not found:
            return ""
        named = ", ".join(found[:3]) + (" and more" if len(found) > 3 else "")
        return (
            f"{named} {'is' if len(found) == 1 else 'are'} on the host's temporary folder, "
            "which this sandbox does not show (its /tmp is its own, and it shows only the "
            "system's folders and the workspace): copy what the command needs into the "
            "workspace"
        )

    def _hidden(self) -> tuple[Path, ...]:
        return (*self.hidden, *self.others()) if self.others is not None else self.hidden


def namespace_options(network: bool) -> list[str]:
    """Namespaces, lifetime and privileges: everything but the mounts."""
    unshare = ["--unshare-pid", "--unshare-ipc"] + ([] if network else ["--unshare-net"])
    return [*unshare, "--die-with-parent", "--new-session", "--cap-drop", "ALL"]


def mount_options(
    workspace: Path, hidden: Iterable[Path], binds: Iterable[tuple[Path, str]] = ()
) -> list[str]:
    """The filesystem: an empty root, read-only, with the system's folders (``SYSTEM``)
    bound read-only, fresh /proc, /dev and /tmp, the workspace writable at its own path
    (and each of ``binds``: a path and its bwrap option), the hidden paths covered where
    one of those shows them, and ``--chdir`` into the workspace.

    Each mount is made after every mount of a shorter path (at equal depth, a cover before
    the workspace), so it lands on top of those that contain it. Covers of folders are
    made read-only once everything is mounted (bwrap needs them writable to make the
    workspace's mount point inside), and so is the root (bwrap made the mount points of
    the workspace's parents there)."""
    binds = list(binds)
    plan: list[tuple[int, int, list[str]]] = [
        (_depth(Path(PRIVATE_TMP)), 0, ["--size", str(PRIVATE_TMP_SIZE), "--tmpfs", PRIVATE_TMP]),
        (_depth(workspace), 1, ["--bind", str(workspace), str(workspace)]),
        *((_depth(path), 1, [option, str(path), str(path)]) for path, option in binds),
        *((1, 0, step) for step in system_mounts()),
    ]
    # (the private /tmp too: what is hidden on the way to a workspace in it stays read-only)
    shown = [Path(f) for f in (*SYSTEM, PRIVATE_TMP)] + [workspace] + [p for p, _ in binds]
    paths = [
        path
        for path in _existing(hidden)
        if path != workspace and any(path.is_relative_to(s) for s in shown)
    ]
    folders = {path for path in paths if path.is_dir()}
    covered: list[str] = []
    for path in paths:
        if _hidden_already(path, folders, workspace):
            continue  # (a cover would only make an empty mount point show in the other)
        if path.is_dir():
            plan.append((_depth(path), 0, ["--tmpfs", str(path)]))
            covered.append(str(path))
        else:
            plan.append((_depth(path), 0, ["--ro-bind", "/dev/null", str(path)]))
    plan.sort(key=lambda step: step[:2])
    options = ["--proc", "/proc", "--dev", "/dev"]
    for _, _, step in plan:
        options += step
    for path_text in covered:
        options += ["--remount-ro", path_text]
    return [*options, "--remount-ro", "/", "--chdir", str(workspace)]


def system_mounts() -> list[list[str]]:
    """The system's folders as bwrap options: a symlink as itself (``/bin -> usr/bin``),
    a folder bound read-only; and where ``/etc/resolv.conf`` leads out of them (systemd's
    resolver, under /run), that file, so that names resolve."""
    steps: list[list[str]] = []
    for name in SYSTEM:
        if os.path.islink(name):
            steps.append(["--symlink", os.readlink(name), name])
        elif os.path.isdir(name):
            steps.append(["--ro-bind", name, name])
    resolver = Path(os.path.realpath("/etc/resolv.conf"))
    if resolver.is_file() and not in_system(resolver):
        steps.append(["--ro-bind", str(resolver), str(resolver)])
    return steps


def _depth(path: Path) -> int:
    return len(path.parts)


def _hidden_already(path: Path, folders: Set[Path], workspace: Path) -> bool:
    """``path`` lies in another hidden folder, and not in the workspace shown through it.
    (A look-up of each parent: there may be a hidden workspace for each of 1,000 tasks.)"""
    return not path.is_relative_to(workspace) and any(p in folders for p in path.parents)


def _existing(paths: Iterable[Path]) -> list[Path]:
    """The real paths of those that exist, without repeats (a cover needs a mount point,
    and a symlink must be covered where it leads)."""
    found: dict[Path, None] = {}
    for path in paths:
        real = Path(os.path.realpath(path))
        if real.exists() and real != Path("/"):
            found[real] = None
    return list(found)


@dataclass(frozen=True)
class Probe:
    """Where bwrap is, and why it cannot run a command here (None: it can)."""

    path: str
    problem: str | None


@functools.cache
def probe(bwrap: str, network: bool) -> Probe:
    """Whether bwrap can run a command with these namespaces here: it is installed, and
    the kernel lets it create them (a container or an LSM may not).

    Cached for the life of the process (one worker): a few milliseconds, once."""
    import subprocess  # noqa: PLC0415  (only a probe runs bwrap: a config that names a mode needs none)

    path = shutil.which(bwrap)
    if path is None:
        why = f"bwrap not found ({bwrap!r} is not an executable on PATH; install bubblewrap)"
        return Probe(bwrap, why)
    argv = [path, *namespace_options(network), "--ro-bind", "/", "/", "--proc", "/proc"]
    try:
        done = subprocess.run(
            [*argv, "--dev", "/dev", "--", SHELL, "-c", ":"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe(path, f"bwrap cannot start ({exc})")
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or ["no message"]
        return Probe(path, f"bwrap cannot create its namespaces here ({lines[-1][:200]})")
    return Probe(path, None)


def sandbox_for(
    mode: SandboxMode,
    network: bool,
    *,
    spool: Path | None,
    config: Path | None,
    secret_files: Sequence[str] = (),
    on_verdict: Callable[[str], None] | None = None,
    others: Callable[[], Iterable[Path]] | None = None,
) -> Sandbox:
    """The sandbox of one worker: what it hides is the spool, the config file and its
    folder (when the folder is one of its own, not ``/`` or a top-level folder such as
    ``/etc``), and the files the secrets were read from (``Credentials.files``: the API
    key's file, systemd's credentials folder, libpq's), and what ``others`` gives at each
    call. A store with no spool hides none."""
    hidden = [spool] if spool is not None else []
    if config is not None:
        hidden.append(config)
        folder = Path(os.path.realpath(config)).parent
        if _depth(folder) > 2:
            hidden.append(folder)
    hidden += [Path(name) for name in secret_files]
    return Sandbox(mode, network, tuple(hidden), on_verdict=on_verdict, others=others)
