"""Class 13, secrets: a canary API key tried through every channel a tool, or a reader of
the spool, has (docs/design.md section 5, "a tool cannot read the API key").

A real daemon (``agentd start``, in the foreground and with ``--detach``) is given a canary
key, in turn through each of its sources: ``ANTHROPIC_API_KEY``, ``ANTHROPIC_API_KEY_FILE``
and a systemd credential (``$CREDENTIALS_DIRECTORY/anthropic_api_key``). Its workers run
on the real SDK against the local Messages API server (``worker.testing.messages_api``), which
accepts no key but the canary, so every request that is answered proves the key reached
the SDK. Tasks run fresh workers (a scripted task queued before the daemon starts: it
needs no SDK, so its start does not wait for the fork server) and forked ones (tasks on
the SDK, whose starts wait for the server); every task's one tool call is a
``run_command`` probe that hunts for the key the way a hostile tool would:

* its own environment;
* ``/proc/$PPID/environ`` (its worker), and ``environ`` and ``cmdline`` of every process
  in ``/proc`` (the daemon, the fork server, other workers);
* every file of the spool, recursively;
* every file a readable environment points at (``*_FILE=``, ``CREDENTIALS_DIRECTORY=``,
  and ``/run/credentials``, where systemd puts credentials);
* its workspace: one task per daemon has the canary planted there (a key a user left in a
  file), the control that proves the hunt finds a key where one is.

The probe reports what it found twice: as is (which the worker's redaction must replace
before the result is recorded or sent) and base64-encoded (which no redaction can
recognise), so the harness sees what the tool really reached. All along, a sampler reads
``/proc/PID/environ`` of the daemon and of every descendant (as the user running the
campaign: root in CI, the hard case, since root reads every process's environment) to
find the canary, or the path of its file, in any exec-time environment. After the run,
the harness greps every spool file, the daemon's log, every request body the server
received and the output of ``status``, ``logs`` and ``history``.

Figures: leaks per channel, all 0 (violations); the controls (the planted key found,
and recorded as ``[redacted]``; every request authenticated with the canary; every kind
of process sampled; every task done) must hold. ``run(quick, config=..., variant=...)``
takes the worker configuration as a parameter, so the same class runs under another
``[tools]`` setting (a sandbox) unchanged.

``python -m tests.chaos.secrets [--full]`` prints the table and exits 1 on any violation;
``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.coordination import ring, running_pid
from supervisor.submit import submit
from tests.daemon import Daemon, subreaper
from tests.faults.report import Figure, campaign_main
from tests.support import (
    REPO,
    journal_records,
    of_kind,
    poll_for,
    reply,
    tool_use,
    worker_env,
)
from tests.support import text as text_block
from worker.events import read_events
from worker.redactor import REDACTED
from worker.testing.messages_api import MessagesAPIServer, Reply, by_turn

FAULT = "secrets"
PREFIX = "agentd-canary-"
SOURCES = ("env", "file", "credential")
CONFIG = """\
max_workers = 8
[heartbeat]
interval = 0.2
timeout = 5.0
[restart]
backoff_initial = 0.05
backoff_max = 0.2
stop_grace = 2.0
"""
#: What the probe reports, one line each: ``CHANNEL:base64 of what it found there``.
CHANNELS = {
    "env": "tool: its own environment",
    "ppid": "tool: /proc/$PPID/environ (its worker)",
    "proc": "tool: /proc/*/environ and cmdline",
    "spool": "tool: spool files",
    "files": "tool: files an environment points at",
}
PROBE = r"""P={prefix}
hunt() {{ tr '\0' '\n' | grep -ao "$P[0-9a-f]*" | sort -u; }}
report() {{ echo "$1:$(hunt | base64 -w0)"; }}
env | report env
cat /proc/$PPID/environ 2>/dev/null | report ppid
cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | report proc
grep -rah "$P" {spool} 2>/dev/null | report spool
{{ for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done 2>/dev/null \
   | sed -n 's/^[A-Z_]*_FILE=//p; s|^CREDENTIALS_DIRECTORY=\(.*\)|\1/*|p'; \
   echo '/run/credentials/*/*'; }} | while read -r pattern; do cat $pattern; done 2>/dev/null \
   | report files
grep -rah "$P" . 2>/dev/null | report workspace
grep -rah "$P" . 2>/dev/null | hunt
sleep 0.5
"""
REPORT_LINE = re.compile(r"^(\w+):([A-Za-z0-9+/=]*)$", re.MULTILINE)


@dataclass
class Findings:
    leaks: Counter[str] = field(default_factory=Counter)
    where: list[str] = field(default_factory=list)  # the first leaks, for the table
    sampled: Counter[str] = field(default_factory=Counter)  # processes by kind
    tasks: int = 0
    done: int = 0
    planted: int = 0
    planted_found: int = 0
    planted_redacted: int = 0
    requests: int = 0
    authenticated: int = 0
    daemons: int = 0
    problems: list[str] = field(default_factory=list)

    def leak(self, channel: str, where: str) -> None:
        self.leaks[channel] += 1
        self.where.append(f"{channel}: {where}")


# -- the sampler -----------------------------------------------------------------------------


@dataclass
class Seen:
    cmdline: str
    leaked: bool = False


class EnvironSampler:
    """Reads ``/proc/PID/environ`` of a daemon and of all its descendants, every
    ``period`` seconds, in a thread: which held a needle (the canary, a key file's path)."""

    def __init__(
        self, root: int, needles: list[bytes], secret: bytes, period: float = 0.05
    ) -> None:
        self.root, self.needles, self.period = root, needles, period
        self.secret = secret  # the one needle a command line may not hold either
        self.seen: dict[int, Seen] = {}
        self.unreadable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EnvironSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def sample(self) -> None:
        parents: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with (
                    contextlib.suppress(OSError, IndexError, ValueError),
                    open(f"/proc/{entry.name}/stat") as f,
                ):
                    parents[int(entry.name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        family, grew = {self.root}, True
        while grew:
            more = {pid for pid, parent in parents.items() if parent in family} - family
            family |= more
            grew = bool(more)
        for pid in family:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                self.unreadable += 1
                continue
            seen = self.seen.setdefault(pid, Seen(cmdline))
            seen.cmdline = cmdline or seen.cmdline
            # A key file's path may stand in bwrap's own command line (it mounts over the
            # file to hide it): that process is outside the sandbox's PID namespace, so no
            # sandboxed tool can read it. The key itself may be in no command line at all.
            seen.leaked |= any(n in environ for n in self.needles)
            seen.leaked |= self.secret in cmdline.encode()


def kinds(sampler: EnvironSampler, daemon_pid: int, workers: set[int]) -> dict[int, str]:
    """Each sampled process by what it is: the daemon, the fork server, a fresh or a forked
    worker (forked ones keep the fork server's command line), or a tool's process."""
    found = {}
    for pid, seen in sampler.seen.items():
        forked = "worker.forkserver" in seen.cmdline
        if pid == daemon_pid:
            found[pid] = "daemon"
        elif pid in workers:
            found[pid] = "forked worker" if forked else "fresh worker"
        elif forked:
            found[pid] = "fork server"
        else:
            found[pid] = "tool process"
    return found


# -- one daemon ------------------------------------------------------------------------------


@dataclass
class Key:
    """The canary and what a daemon is given to find it."""

    canary: str
    source: str
    root: Path

    def environment(self) -> dict[str, str]:
        if self.source == "env":
            return {"ANTHROPIC_API_KEY": self.canary}
        if self.source == "file":
            path = self.root / "keys" / "anthropic_api_key"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.canary + "\n")
            return {"ANTHROPIC_API_KEY_FILE": str(path)}
        creds = self.root / "credentials"
        creds.mkdir(parents=True, exist_ok=True)
        (creds / "anthropic_api_key").write_text(self.canary)
        return {"CREDENTIALS_DIRECTORY": str(creds)}

    def needles(self) -> list[bytes]:
        return [
            self.canary.encode(),
            str(self.root / "keys").encode(),
            str(self.root / "credentials").encode(),
        ]


def probe_command(spool: Path) -> str:
    return PROBE.format(prefix=PREFIX, spool=spool)


def start_daemon(daemon: Daemon, env: dict[str, str], detach: bool) -> int:
    if not detach:
        return daemon.start(env, timeout=30).pid
    done = subprocess.run(
        daemon.command("--log-format", "json", "start", "--detach"),
        cwd=REPO,
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"agentd start --detach failed: {done.stderr.strip()}")
    pid = running_pid(daemon.spool)
    if pid is None:
        raise RuntimeError("agentd start --detach returned with no daemon running")
    return pid


def daemon_events(daemon: Daemon) -> list[dict[str, Any]]:
    return read_events(daemon.log_path) + read_events(daemon.spool.root / "supervisor.log")


def one_daemon(root: Path, key: Key, config: str, *, detach: bool, found: Findings) -> None:
    server = MessagesAPIServer(api_key=key.canary)
    daemon = Daemon(root, config)
    command = probe_command(daemon.spool.root)
    server.responder = by_turn(
        [Reply.tool_use("run_command", {"command": command}), Reply.text("Done.")]
    )
    env = {
        **key.environment(),
        "ANTHROPIC_BASE_URL": server.base_url,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    planted_ws = root / "planted-workspace"
    planted_ws.mkdir()
    (planted_ws / "notes.txt").write_text(f"a key someone left here: {key.canary}\n")

    def submit_task(name: str, workspace: Path | None = None, script: Path | None = None) -> str:
        submit(
            daemon.spool,
            daemon.config,
            prompt=f"{name}: go",
            name=name,
            workspace=workspace,
            script=script,
        )
        ring(daemon.spool, name)
        return name

    script = root / "fresh-script.json"  # the same probe, from the scripted model
    probe = reply(tool_use("run_command", command=command))
    script.write_text(json.dumps({"responses": [probe, reply(text_block("Done."))]}))

    with server, contextlib.ExitStack() as stack:
        stack.callback(daemon.cleanup)
        daemon.spool.ensure()
        names = [submit_task("fresh", script=script)]  # started before the server is ready
        pid = start_daemon(daemon, env, detach)
        found.daemons += 1
        sampler = stack.enter_context(EnvironSampler(pid, key.needles(), key.canary.encode()))
        if not poll_quietly(
            lambda: any(e.get("event") == "forkserver_ready" for e in daemon_events(daemon)), 60
        ):
            found.problems.append(f"{key.source}: the fork server never became ready")
        names += [submit_task("forked"), submit_task("planted", planted_ws)]
        final = ("done", "failed", "held", "cancelled")
        if not poll_quietly(lambda: all(daemon.row(n)["state"] in final for n in names), 60):
            found.problems.append(
                f"{key.source}: tasks did not end: {[daemon.row(n)['state'] for n in names]}"
            )
        outputs = [daemon.cli(*args)[1] for n in names for args in (("logs", n), ("history", n))]
        outputs.append(daemon.cli("status", "--json")[1])
        sampler.sample()
        outputs.append("".join(daemon.cli("stop")[1:]))
        stack.close()  # the sampler, then every process of the spool that is left
        workers = {
            e["pid"]
            for n in names
            for e in daemon.events(n, "worker_spawned")
            if isinstance(e.get("pid"), int)
        }
        audit(daemon, key, sampler, kinds(sampler, pid, workers), names, outputs, found)
        found.requests += len(server.headers)
        for body, headers in zip(server.requests, server.headers, strict=True):
            sent = headers.get("x-api-key") or headers.get("authorization", "").removeprefix(
                "Bearer "
            )
            found.authenticated += sent == key.canary
            if key.canary in repr(body):
                found.leak("model request bodies", f"{key.source}: a request body")


def poll_quietly(predicate: Callable[[], object], timeout: float) -> bool:
    try:
        poll_for(predicate, timeout, interval=0.05)
    except AssertionError:
        return False
    return True


def audit(
    daemon: Daemon,
    key: Key,
    sampler: EnvironSampler,
    kind_of: dict[int, str],
    names: list[str],
    outputs: list[str],
    found: Findings,
) -> None:
    canary = key.canary
    for pid, kind in kind_of.items():
        found.sampled[kind] += 1
        if sampler.seen[pid].leaked:
            found.leak(f"/proc/PID/environ: {kind}", f"{key.source}: pid {pid}")
    for path in sorted(daemon.spool.root.rglob("*")):
        if path.is_file() and canary.encode() in path.read_bytes():
            found.leak("spool files", f"{key.source}: {path.relative_to(daemon.spool.root)}")
    with contextlib.suppress(FileNotFoundError):
        if canary in daemon.log_path.read_text(errors="replace"):
            found.leak("daemon log", f"{key.source}: {daemon.log_path.name}")
    for i, text in enumerate(outputs):
        if canary in text:
            found.leak("CLI output", f"{key.source}: output {i}")
    for name in names:
        found.tasks += 1
        found.done += daemon.row(name)["state"] == "done"
        results = of_kind(journal_records(daemon.task(name)), "result")
        if not results:
            found.problems.append(f"{key.source}/{name}: no tool result recorded")
        for result in results:
            content = str(result.get("content"))
            if canary in content:
                found.leak("recorded tool results", f"{key.source}/{name}")
            reached = decode(content)
            for channel, label in CHANNELS.items():
                if canary in reached.get(channel, ()):
                    found.leak(label, f"{key.source}/{name}")
            if name == "planted":
                found.planted += 1
                found.planted_found += canary in reached.get("workspace", ())
                found.planted_redacted += REDACTED in content


def decode(content: str) -> dict[str, set[str]]:
    """What the probe reached, by channel, from its base64 report lines."""
    reached: dict[str, set[str]] = {}
    for channel, data in REPORT_LINE.findall(content):
        with contextlib.suppress(ValueError):
            reached[channel] = set(base64.b64decode(data).decode().split())
    return reached


# -- the campaign ----------------------------------------------------------------------------


def plan(quick: bool) -> list[tuple[str, bool]]:
    """(key source, detached) for each daemon run."""
    if quick:
        return [("env", False), ("file", True), ("credential", False)]
    return [(source, detach) for _ in range(2) for source in SOURCES for detach in (False, True)]


def run(
    quick: bool, config: str = CONFIG, variant: str = "run_command as configured"
) -> list[Figure]:
    found = Findings()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-secrets-") as tmp, subreaper():
        for i, (source, detach) in enumerate(plan(quick)):
            key = Key(PREFIX + secrets.token_hex(16), source, Path(tmp) / f"run-{i}")
            try:
                one_daemon(key.root, key, config, detach=detach, found=found)
            except Exception as exc:  # the harness failed: a visible problem, not a pass
                found.problems.append(f"{source}: {type(exc).__name__}: {exc}")
    return figures(found, quick, variant, time.monotonic() - started)


def figures(found: Findings, quick: bool, variant: str, seconds: float) -> list[Figure]:
    f = found
    channels = [
        *CHANNELS.values(),
        "recorded tool results",
        "model request bodies",
        "spool files",
        "daemon log",
        "CLI output",
    ]
    process_kinds = ("daemon", "fork server", "fresh worker", "forked worker", "tool process")
    out = [
        Figure(FAULT, "worker config", variant),
        Figure(
            FAULT,
            "daemons started (key from env, file, credential)",
            f.daemons,
            violation=f.daemons < len(plan(quick)),
        ),
        Figure(FAULT, "tasks done", f"{f.done}/{f.tasks}"),
        Figure(FAULT, "tasks not done", f.tasks - f.done, violation=f.tasks - f.done > 0),
    ]
    out += [Figure(FAULT, f"leaks: {c}", f.leaks[c], violation=f.leaks[c] > 0) for c in channels]
    for kind in process_kinds:
        label = f"/proc/PID/environ: {kind}"
        out.append(
            Figure(
                FAULT, f"processes sampled: {kind}", f.sampled[kind], violation=f.sampled[kind] == 0
            )
        )
        out.append(Figure(FAULT, f"leaks: {label}", f.leaks[label], violation=f.leaks[label] > 0))
    out += [
        Figure(
            FAULT,
            "planted key found by the tool (control)",
            f"{f.planted_found}/{f.planted}",
            violation=f.planted_found < f.planted or not f.planted,
        ),
        Figure(
            FAULT,
            "planted key recorded as [redacted]",
            f"{f.planted_redacted}/{f.planted}",
            violation=f.planted_redacted < f.planted,
        ),
        Figure(
            FAULT,
            "requests authenticated with the canary",
            f"{f.authenticated}/{f.requests}",
            violation=f.authenticated < f.requests or not f.requests,
        ),
        Figure(FAULT, "harness problems", len(f.problems), violation=bool(f.problems)),
    ]
    for item in [*f.where, *f.problems][: 5 if quick else 20]:
        out.append(Figure(FAULT, "leak or problem", item, violation=True))
    out.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.secrets", __doc__ or "", argv, seeded=False)


if __name__ == "__main__":
    sys.exit(main())
