"""Security: file modes, symlinks, hostile names and a canary API key.

* Modes: under umask 000, 022 and 077 a task runs through the real daemon and CLI (submit,
  start --detach, a hold, approve-dangling, status, logs, history, stop), its tools
  writing files, folders and a shell's output. Then every folder of the spool must be
  0700 and every file 0600.
* Canary: ``ANTHROPIC_API_KEY=sk-ant-canary-...`` is in the environment the daemon and
  every CLI command of that run are started with. It must appear in no byte of any file of
  the spool (the daemon's log is one), in no CLI output, and not in the recorded result of
  a ``run_command`` ``env``. A worker started with it in its environment, whose tool
  copies ``/proc/$PPID/environ`` (its worker's) and every ``/proc/*/environ`` it can read
  into files of its workspace (files a tool writes are not redacted, so this shows what it
  reached), must not have reached it either (class 13, ``tests/chaos/secrets.py``, hunts
  for it through every channel).
* Symlinks planted in the spool: a task folder that is a symlink, and tasks whose
  journal, spec, script, state, heartbeat, snapshot, exit, events, log, lock, decision
  file, decisions folder or workspace is a symlink to a file or folder outside. The daemon
  runs them all and the CLI reads and decides them; nothing outside may change, and no
  byte of what is outside may show up in the spool or in a CLI output.
* Workspace symlinks and hostile tool paths: tools given symlinks planted in the
  workspace (to a file, a folder and a missing file outside), ``..``, absolute paths, NUL
  and overlong names: each gets an error result and nothing outside changes.
* Hostile ids: task ids and call ids with ``..``, ``/``, NUL, upper case, overlong names
  (in every command that takes one, and ``python -m worker``): refused with exit 2, and
  nothing created.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import cli
from supervisor.record import TaskRecord
from tests.faults.common import (
    STABLE_ENV,
    final_state,
    reap_spool,
    records,
    run_worker,
    stopwatch,
)
from tests.faults.report import Figure
from tests.support import REPO, reply, scripted_task, text, tool_use, worker_env
from worker.spool import Spool, TaskDir
from worker.store.journal import JOURNAL_VERSION, encode

FAULT = "security"
UMASKS = (0o000, 0o022, 0o077)
CONFIG = """\
[heartbeat]
interval = 0.2
timeout = 5.0
[restart]
backoff_initial = 0.05
backoff_max = 0.2
crash_loop_limit = 3
stop_grace = 2.0
[tools]
modules = ["tests.faults.tools"]
"""


@dataclass
class Findings:
    files: int = 0
    wrong_modes: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    proc_leak: list[str] = field(default_factory=list)
    env_checked: int = 0
    planted: int = 0
    followed: list[str] = field(default_factory=list)
    escapes: int = 0
    escapes_followed: list[str] = field(default_factory=list)
    ids: int = 0
    ids_accepted: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the harness could not do its part


# -- processes -----------------------------------------------------------------------------


@dataclass
class Env:
    canary: str
    config: Path
    outputs: list[str] = field(default_factory=list)  # every CLI output, for the canary

    def environ(self) -> dict[str, str]:
        return worker_env({**STABLE_ENV, "ANTHROPIC_API_KEY": self.canary})

    def agentd(
        self, spool: Path, *args: str, umask: int = 0o077
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            sys.executable,
            "-m",
            "supervisor",
            "--spool",
            str(spool),
            "--config",
            str(self.config),
        ]
        done = subprocess.run(
            [*cmd, *args],
            cwd=REPO,
            env=self.environ(),
            capture_output=True,
            text=True,
            timeout=90,
            umask=umask,
            check=False,
        )
        self.outputs.append(done.stdout + done.stderr)
        return done


def wait_for(what: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.1)
    return what()


def state_of(spool: Path, task_id: str) -> str:
    return TaskRecord.load(TaskDir(spool, task_id)).state


def walk(root: Path) -> list[Path]:
    """Every file, folder and symlink under ``root`` (symlinks are not followed)."""
    found = [root]
    for base, dirs, files in os.walk(root, followlinks=False):
        found += [Path(base) / d for d in dirs] + [Path(base) / f for f in files]
    return found


def tree_print(root: Path) -> dict[str, tuple[int, str]]:
    """What a folder outside the spool holds: path -> (mode, content digest)."""
    out: dict[str, tuple[int, str]] = {}
    for path in walk(root):
        st = path.lstat()
        digest = ""
        if stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            digest = "-> " + os.readlink(path)
        out[str(path.relative_to(root))] = (st.st_mode, digest)
    return out


def grep_files(root: Path, needles: list[str]) -> list[str]:
    """``path: needle`` for every regular file under ``root`` holding a needle."""
    hits = []
    for path in walk(root):
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        hits += [f"{path.relative_to(root)}: {n[:24]}" for n in needles if n.encode() in data]
    return hits


# -- modes and the canary -------------------------------------------------------------------


def _mode_script() -> list[dict[str, Any]]:
    return [
        reply(
            text("Looking around."),
            tool_use("run_command", command="env"),
            tool_use("write_file", path="deep/er/a.txt", content="a"),
            tool_use("append_file", path="log.txt", content="one\n"),
        ),
        reply(tool_use("outbox_send", to="ops", body="b"), tool_use("die_once", marker="m")),
        reply(tool_use("run_command", command="echo hi > cmd.txt; mkdir -p made/dir; umask")),
        reply(text("Done.")),
    ]


def modes_and_canary(root: Path, env: Env, umask: int, found: Findings) -> None:
    spool = root / f"spool-{umask:03o}" / "agentd"
    script = root / f"script-{umask:03o}.json"
    script.write_text(json.dumps({"responses": _mode_script()}))
    sub = env.agentd(
        spool, "submit", "--prompt", "go", "--name", "t1", "--script", str(script), umask=umask
    )
    if sub.returncode != 0:
        found.problems.append(f"umask {umask:03o}: submit failed: {sub.stderr.strip()}")
        return
    start = env.agentd(spool, "start", "--detach", umask=umask)
    if start.returncode != 0:
        found.problems.append(f"umask {umask:03o}: start failed: {start.stderr.strip()}")
        return
    try:
        if not wait_for(lambda: state_of(spool, "t1") == "held", 30):
            found.problems.append(
                f"umask {umask:03o}: the task never held ({state_of(spool, 't1')})"
            )
        env.agentd(spool, "dangling", "--json", umask=umask)
        env.agentd(spool, "approve-dangling", "t1", "--all", "--rerun", umask=umask)
        if not wait_for(lambda: state_of(spool, "t1") == "done", 30):
            found.problems.append(
                f"umask {umask:03o}: the task never finished ({state_of(spool, 't1')})"
            )
        for args in (["status"], ["status", "--json"], ["logs", "t1"], ["history", "t1"]):
            env.agentd(spool, *args, umask=umask)
    finally:
        env.agentd(spool, "stop", umask=umask)
        if reap_spool(spool):
            found.problems.append(f"umask {umask:03o}: `agentd stop` left processes running")
    for path in walk(spool):
        st = path.lstat()
        found.files += 1
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) != want:
            found.wrong_modes.append(
                f"umask {umask:03o}: {path.relative_to(spool.parent)} {oct(st.st_mode)}"
            )
    found.leaks += [f"umask {umask:03o}: {hit}" for hit in grep_files(spool, [env.canary])]
    task = TaskDir(spool, "t1")
    env_results = [
        r
        for r in records(task)
        if r.get("k") == "result" and "AGENTD_TASK=" in str(r.get("content"))
    ]
    if not env_results:
        found.problems.append(f"umask {umask:03o}: no recorded result of `env`")
    for result in env_results:
        found.env_checked += 1
        content = str(result.get("content"))
        if env.canary in content or "ANTHROPIC_API_KEY" in content:
            found.leaks.append(f"umask {umask:03o}: the tool environment holds the key")


def proc_environ_probe(root: Path, env: Env, found: Findings) -> None:
    """Can a shell tool read the key from its worker's (or any) ``/proc/PID/environ``?"""
    spool = Spool(root / "probe-spool").ensure()
    task = scripted_task(
        spool,
        [
            reply(
                tool_use(
                    "run_command",
                    command="tr '\\0' '\\n' < /proc/$PPID/environ > ppid.txt; "
                    "cat /proc/[0-9]*/environ > all.txt 2>/dev/null; wc -c ppid.txt",
                )
            ),
            reply(text("ok")),
        ],
        name="probe",
    )
    run_worker(task, env={"ANTHROPIC_API_KEY": env.canary})
    if not (task.path / "workspace" / "ppid.txt").exists():
        found.problems.append("the /proc probe did not run")
    found.proc_leak += [
        f"a run_command tool read the key from /proc: {hit}"
        for hit in grep_files(task.path, [env.canary])
    ]


# -- symlinks planted in the spool ----------------------------------------------------------

LINKED_FILES = (
    "journal", "spec", "script", "state", "heartbeat", "snapshot", "exit", "events",
    "output", "lock", "lock-running", "heartbeat-running",
)  # fmt: skip


def _linked_script() -> list[dict[str, Any]]:
    return [
        reply(
            tool_use("write_file", path="w.txt", content="w"),
            tool_use("append_file", path="log.txt", content="one\n"),
        ),
        reply(tool_use("die_once", marker="m")),
        reply(text("Done.")),
    ]


def _plant(spool: Spool, outside: Path, name: str, link: str) -> str:
    """A task whose ``link`` (a TaskDir attribute, or "decision", "decisions",
    "workspace" or "folder") is a symlink to something outside holding a marker."""
    marker = f"OUTSIDE-{name}-{secrets.token_hex(4)}"
    target = outside / name
    target.mkdir(parents=True)
    if link == "folder":
        src = scripted_task(Spool(outside / "src").ensure(), _linked_script(), name=name)
        os.rename(src.path, target / "task")
        (target / "task" / "marker.txt").write_text(marker)
        os.symlink(target / "task", spool.tasks_dir / name)
        return marker
    task = scripted_task(spool, _linked_script(), name=name)
    if link in ("decisions", "workspace"):
        (target / "dir").mkdir()
        (target / "dir" / "marker.txt").write_text(marker)
        path = task.decisions if link == "decisions" else task.path / "workspace"
        with contextlib.suppress(FileNotFoundError):
            path.rmdir()
        os.symlink(target / "dir", path)
        return marker
    path = getattr(task, link.removesuffix("-running"))
    (target / "file").write_bytes(_outside_content(task, link, marker))
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.symlink(target / "file", path)
    if link.endswith("-running"):  # as an earlier daemon that died would have left it
        task.state.write_text(json.dumps({"state": "running", "pid": 1, "pid_started": 1.0}))
    return marker


def _outside_content(task: TaskDir, link: str, marker: str) -> bytes:
    """Valid content for the linked file, holding ``marker``: following the link would
    use it (and show the marker) instead of failing on garbage."""
    now = time.time()
    content: Any = marker
    if link == "journal":
        head = {"k": "header", "v": JOURNAL_VERSION}
        turn = {
            "k": "turn", "turn": 1, "stop_reason": "end_turn", "usage": {},
            "message": {"role": "assistant", "content": [{"type": "text", "text": marker}]},
        }  # fmt: skip
        return encode(head) + encode(turn)
    if link == "script":
        content = {"responses": [{"content": [{"type": "text", "text": marker}]}]}
    elif link == "spec":
        content = {**task.load_spec().to_json(), "prompt": marker}
    elif link == "state":
        content = {"state": "failed", "reason": marker}
    elif link == "heartbeat":
        content = {"pid": 1, "at": now, "turn": 0, "phase": marker, "phase_started": now}
    elif link == "exit":
        content = {"code": 0, "state": "done", "reason": marker, "pid": 1}
    elif link == "events":
        return (json.dumps({"event": marker, "timestamp": "x", "level": "info"}) + "\n").encode()
    return json.dumps(content).encode() if not isinstance(content, str) else content.encode()


def planted_symlinks(root: Path, env: Env, found: Findings) -> None:
    spool = Spool(root / "link-spool" / "agentd").ensure()
    outside = root / "outside"
    names: dict[str, str] = {}
    markers: list[str] = []
    for link in (*LINKED_FILES, "decisions", "workspace", "folder"):
        name = f"link-{link}"
        markers.append(_plant(spool, outside, name, link))
        names[name] = link
    scripted_task(spool, _linked_script(), name="good")
    before = tree_print(outside)
    found.planted += len(names)
    start = env.agentd(spool.root, "start", "--detach")
    if start.returncode != 0:
        found.problems.append(f"symlinks: start failed: {start.stderr.strip()}")
        return
    try:
        wait_for(lambda: state_of(spool.root, "good") == "held", 30)
        base = ["--spool", str(spool.root), "--config", str(env.config)]
        env.outputs.append(call_cli([*base, "approve-dangling", "good", "--all", "--rerun"])[1])
        for name, link in names.items():
            for args in (["status", name], ["logs", name], ["history", name], ["dangling", name]):
                env.outputs.append("".join(map(str, call_cli([*base, *args], out=True))))
            if state_of(spool.root, name) == "held" or link == "folder":
                env.outputs.append(
                    call_cli([*base, "approve-dangling", name, "--all", "--rerun"])[1]
                )
        if not wait_for(lambda: state_of(spool.root, "good") == "done", 30):
            found.problems.append(
                f"symlinks: the good task did not finish ({state_of(spool.root, 'good')})"
            )
        wait_for(
            lambda: all(state_of(spool.root, n) in ("done", "failed", "held") for n in names
                        if names[n] != "folder"),
            20,
        )  # fmt: skip
        env.agentd(spool.root, "status", "--json")
        for name in names:
            env.outputs.append(call_cli([*base, "cancel", name])[1])
        env.outputs.append(call_cli([*base, "submit", "--prompt", "x", "--name", "link-folder"])[1])
    finally:
        env.agentd(spool.root, "stop")
        if reap_spool(spool.root):
            found.problems.append("symlinks: `agentd stop` left processes running")
    after = tree_print(outside)
    for name, link in names.items():
        changed = sorted(
            k for k in set(before) | set(after)
            if k.split(os.sep)[0] == name and before.get(k) != after.get(k)
        )  # fmt: skip
        if changed:
            found.followed.append(f"{link}: changed outside: {', '.join(changed)[:120]}")
    outputs = "\n".join(env.outputs)
    for hit in grep_files(spool.root, markers):
        found.followed.append(f"outside content in the spool: {hit}")
    for marker in markers:
        if marker in outputs:
            found.followed.append(f"outside content in a CLI output: {marker[:24]}")


# -- workspace symlinks and tool paths ---------------------------------------------------------


def tool_escapes(root: Path, found: Findings) -> None:
    outside = root / "tool-outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_text("OUTSIDE-SECRET-FILE")
    (outside / "dir" / "inner.txt").write_text("OUTSIDE-SECRET-DIR")
    spool = Spool(root / "tool-spool").ensure()
    calls = [
        ("read_file", {"path": "file_link"}),
        ("read_file", {"path": "dir_link/inner.txt"}),
        ("list_dir", {"path": "dir_link"}),
        ("write_file", {"path": "file_link", "content": "x"}),
        ("write_file", {"path": "dir_link/new.txt", "content": "x"}),
        ("write_file", {"path": "missing_link", "content": "x"}),
        ("append_file", {"path": "file_link", "content": "x"}),
        ("append_file", {"path": "missing_link", "content": "x"}),
        ("append_file", {"path": "dir_link/inner.txt", "content": "x"}),
        ("outbox_send", {"to": "x", "body": "x"}),  # with outbox/ a symlink out
        ("read_file", {"path": "../../../../../../etc/hostname"}),
        ("read_file", {"path": "/etc/hostname"}),
        ("write_file", {"path": "/tmp/agentd-escape", "content": "x"}),
        ("write_file", {"path": "a/../../escape.txt", "content": "x"}),
        ("write_file", {"path": "bad\0name", "content": "x"}),
        ("write_file", {"path": "x" * 5000, "content": "x"}),
        ("write_file", {"path": ".", "content": "x"}),
        ("list_dir", {"path": ".."}),
    ]
    responses = [reply(*(tool_use(name, **args) for name, args in calls)), reply(text("done"))]
    task = scripted_task(spool, responses, name="escapes")
    workspace = task.path / "workspace"
    workspace.mkdir(mode=0o700)
    os.symlink(outside / "secret.txt", workspace / "file_link")
    os.symlink(outside / "dir", workspace / "dir_link")
    os.symlink(outside / "missing.txt", workspace / "missing_link")
    os.symlink(outside / "dir", workspace / "outbox")
    before = tree_print(outside)
    done = run_worker(task)
    after = tree_print(outside)
    state = final_state(task)
    found.escapes += len(calls)
    if done.code != 0:
        found.problems.append(
            f"tool escapes: worker exit {done.code}: {done.stderr.strip()[-200:]}"
        )
    for call_id, call in state.calls.items():
        result = call.result or {}
        if not result.get("is_error"):
            found.escapes_followed.append(
                f"{call.tool}({json.dumps(call.input)[:60]}) ran: {call_id}"
            )
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        found.escapes_followed.append(f"changed outside: {changed}")
    if Path("/tmp/agentd-escape").exists():
        found.escapes_followed.append("wrote /tmp/agentd-escape")
    for hit in grep_files(task.path, ["OUTSIDE-SECRET"]):
        found.escapes_followed.append(f"outside content read: {hit}")


# -- hostile ids --------------------------------------------------------------------------------

BAD_IDS = [
    "..", ".", "../x", "../../etc", "/abs", "a/b", "a\0b", "x" * 65, "Upper", "-dash",
    ".dot", "_under", "a b", "a\nb", "é", "t1/..", "a" * 4096,
]  # fmt: skip
BAD_CALL_IDS = ["../x", "a/b", "a\0b", "x" * 129, "a b", ".."]


def call_cli(argv: list[str], *, out: bool = False) -> tuple[int, str]:
    """``agentd ARGV`` in this process: its exit code and stderr (with ``out``, stdout
    and stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, (stdout.getvalue() if out else "") + stderr.getvalue()


def hostile_ids(root: Path, found: Findings) -> None:
    spool = Spool(root / "id-spool" / "agentd").ensure()
    scripted_task(spool, [reply(text("hi"))], name="t1")
    base = ["--spool", str(spool.root)]
    listing = sorted(os.listdir(spool.root.parent)), sorted(os.listdir(spool.tasks_dir))
    for bad in BAD_IDS:
        commands = [
            ["submit", "--prompt", "x", "--name", bad],
            ["status", bad],
            ["dangling", bad],
            ["logs", bad],
            ["history", bad],
            ["cancel", bad],
            ["retry", bad],
            ["rewind", bad, "--to", "0", "--yes"],
            ["fork", bad, "--at", "0"],
            ["fork", "t1", "--at", "0", "--name", bad],
            ["approve-dangling", bad, "--all"],
        ]
        for argv in commands:
            found.ids += 1
            code, err = call_cli(base + argv)
            if code != 2 or len(err.strip().splitlines()) != 1:
                found.ids_accepted.append(f"{argv[0]} {bad[:20]!r}: exit {code} {err.strip()[:80]}")
        found.ids += 1
        if "\0" not in bad:
            path = spool.tasks_dir / bad
            done = subprocess.run(
                [sys.executable, "-m", "worker", str(path)],
                cwd=REPO,
                env=worker_env(STABLE_ENV),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if done.returncode != 2:
                found.ids_accepted.append(f"python -m worker {bad[:20]!r}: exit {done.returncode}")
    for bad in BAD_CALL_IDS:
        found.ids += 1
        code, _ = call_cli([*base, "approve-dangling", "t1", bad])
        if code != 2:
            found.ids_accepted.append(f"approve-dangling call id {bad[:20]!r}: exit {code}")
    if (sorted(os.listdir(spool.root.parent)), sorted(os.listdir(spool.tasks_dir))) != listing:
        found.ids_accepted.append("a refused id created something in the spool")


# -- the campaign ----------------------------------------------------------------------------


def run(quick: bool) -> list[Figure]:
    found = Findings()
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-sec-") as tmp:
        root = Path(tmp)
        config = root / "agentd.toml"
        config.write_text(CONFIG)
        env = Env("sk-ant-canary-" + secrets.token_hex(16), config)
        for umask in UMASKS:
            modes_and_canary(root, env, umask, found)
        proc_environ_probe(root, env, found)
        planted_symlinks(root, env, found)
        tool_escapes(root, found)
        hostile_ids(root, found)
        for i, output in enumerate(env.outputs):
            if env.canary in output:
                found.leaks.append(f"CLI output {i}")
        seconds = elapsed()
    f = found
    figures = [
        Figure(FAULT, "umasks tried", len(UMASKS)),
        Figure(FAULT, "files checked", f.files, violation=not f.files),
        Figure(FAULT, "wrong modes", len(f.wrong_modes), violation=bool(f.wrong_modes)),
        Figure(FAULT, "tool environments checked", f.env_checked, violation=not f.env_checked),
        Figure(FAULT, "canary leaks", len(f.leaks), violation=bool(f.leaks)),
        Figure(
            FAULT, "canary read via /proc/*/environ", len(f.proc_leak), violation=bool(f.proc_leak)
        ),
        Figure(FAULT, "symlinks planted in the spool", f.planted),
        Figure(FAULT, "symlinks followed", len(f.followed), violation=bool(f.followed)),
        Figure(FAULT, "tool escapes tried", f.escapes),
        Figure(FAULT, "tool escapes followed", len(f.escapes_followed), bool(f.escapes_followed)),
        Figure(FAULT, "hostile ids tried", f.ids),
        Figure(FAULT, "hostile ids accepted", len(f.ids_accepted), violation=bool(f.ids_accepted)),
        Figure(FAULT, "harness problems", len(f.problems), violation=bool(f.problems)),
    ]
    for name, items in (
        ("wrong mode", f.wrong_modes),
        ("leak", [*f.leaks, *f.proc_leak]),
        ("followed", f.followed),
        ("escape", f.escapes_followed),
        ("id accepted", f.ids_accepted),
        ("problem", f.problems),
    ):
        for item in items[: 3 if quick else 20]:
            figures.append(Figure(FAULT, name, item, violation=True))
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures
