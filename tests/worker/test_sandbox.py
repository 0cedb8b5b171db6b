"""The run_command sandbox on the real bwrap: what a command can see, write and signal,
and that nothing it starts outlives its call or its worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.status import status_row
from tests.support import (
    finish,
    journal_records,
    kill_processes_with,
    make_spool,
    of_kind,
    poll_for,
    processes_with,
    reply,
    run_worker,
    scripted_task,
    start_worker,
    text,
    tool_use,
    unique_sleep,
)
from worker import credentials
from worker.protocol import ExitCode
from worker.spool import Spool
from worker.store.files import FileStore
from worker.tool_calls import OtherWorkspaces, tool_environment
from worker.tools.builtin import run_command
from worker.tools.registry import ToolContext, ToolError
from worker.tools.sandbox import (
    PRIVATE_TMP_SIZE,
    Sandbox,
    SandboxMode,
    mount_options,
    probe,
    sandbox_for,
)

# Skipped on a developer machine without a working bwrap; never in CI (.ci/run installs it),
# where these tests then fail instead.
pytestmark = pytest.mark.skipif(
    probe("bwrap", False).problem is not None and not os.environ.get("CI"),
    reason=f"bwrap does not work here ({probe('bwrap', False).problem}); "
    "install bubblewrap to run these tests",
)

SECRET = "canary-secret-5f1e"  # noqa: S105  (a canary, not a password)


@pytest.fixture
def spool(tmp_path: Path) -> Spool:
    """A spool with one task's records and the default workspace inside it."""
    spool = make_spool(tmp_path)
    task = spool.tasks_dir / "t1"
    (task / "workspace").mkdir(parents=True)
    (task / "journal").write_text(SECRET)
    (spool.root / "supervisor.json").write_text(json.dumps({"pid": 1, "secret": SECRET}))
    return spool


@pytest.fixture
def config(tmp_path: Path) -> Path:
    folder = tmp_path / "etc" / "agentd"
    folder.mkdir(parents=True)
    (folder / "env").write_text(f"ANTHROPIC_API_KEY={SECRET}\n")
    path = folder / "agentd.toml"
    path.write_text(f"# {SECRET}\n")
    return path


def sandboxed(spool: Spool, config: Path, *, network: bool = True) -> Sandbox:
    return sandbox_for(SandboxMode.REQUIRED, network, spool=spool.root, config=config)


def sh(sandbox: Sandbox, workspace: Path, command: str, timeout: float = 20.0) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "AGENTD_TASK": "t1"}
    ctx = ToolContext(workspace, "t1", "toolu_1", "key", timeout, env, sandbox)
    return run_command.run(ctx, {"command": command})


def test_the_spool_and_the_config_are_invisible(spool: Spool, config: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    command = (
        f"pwd; ls -a ..; cat ../journal ../../../supervisor.json {config} {config.parent}/env;"
        f" ls -a {config.parent}; grep -r {SECRET[:6]} {spool.root} {config.parent}; true"
    )
    out = sh(sandboxed(spool, config), workspace, command)
    assert SECRET not in out
    assert str(workspace) in out  # the workspace is there, at its own path
    assert "No such file" in out
    listing = out.split("--- stdout ---\n")[1].split("--- stderr ---")[0].split()
    assert "journal" not in listing and "agentd.toml" not in listing


def test_writes_outside_the_workspace_fail(spool: Spool, config: Path, tmp_path: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    outside = tmp_path / "outside"
    outside.mkdir()
    before = (spool.tasks_dir / "t1" / "journal").read_bytes()
    targets = ["../journal", "../state.json", "../../t2/journal", f"{outside}/x", "/usr/x"]
    command = "; ".join(f"echo bad > {t} && echo WROTE {t}" for t in targets)
    out = sh(sandboxed(spool, config), workspace, command + "; echo ok > inside.txt; true")
    assert "WROTE" not in out
    assert "Read-only file system" in out
    assert (workspace / "inside.txt").read_text() == "ok\n"  # the workspace is writable
    assert (spool.tasks_dir / "t1" / "journal").read_bytes() == before
    assert sorted(os.listdir(spool.tasks_dir / "t1")) == ["journal", "workspace"]
    assert not (outside / "x").exists()


def test_tmp_is_private_to_the_call(spool: Spool, config: Path, tmp_path: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    name = f"agentd-sandbox-{os.getpid()}"
    out = sh(sandboxed(spool, config), workspace, f"echo x > /tmp/{name} && ls /tmp")
    assert out.startswith("exit code 0\n") and name in out
    assert not (Path("/tmp") / name).exists()  # the host's /tmp


def test_tmp_has_a_size(spool: Spool, config: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    out = sh(sandboxed(spool, config), workspace, "stat -f -c '%b %S' /tmp")
    blocks, block_size = out.split("--- stdout ---\n")[1].split()[:2]
    assert int(blocks) * int(block_size) == PRIVATE_TMP_SIZE


def test_proc_shows_only_the_sandbox_processes(spool: Spool, config: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    me = os.getpid()
    command = f"ls /proc | grep -c '^[0-9]'; kill -0 {me} || echo cannot-signal; cat /proc/1/comm"
    out = sh(sandboxed(spool, config), workspace, command)
    stdout = out.split("--- stdout ---\n")[1].split("\n--- stderr ---")[0].split()
    # bwrap's init (pid 1), the shell, and ls and grep of the pipeline
    assert int(stdout[0]) <= 4, out
    assert "cannot-signal" in stdout
    assert stdout[-1] == "bwrap"


def interfaces(proc_net_dev: str) -> set[str]:
    return {line.split(":")[0].strip() for line in proc_net_dev.splitlines() if ":" in line}


def test_no_network_leaves_only_loopback(spool: Spool, config: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    closed = sh(sandboxed(spool, config, network=False), workspace, "cat /proc/net/dev")
    assert interfaces(closed) == {"lo"}
    opened = sh(sandboxed(spool, config, network=True), workspace, "cat /proc/net/dev")
    assert interfaces(opened) == interfaces(Path("/proc/net/dev").read_text())


def test_required_without_bwrap_fails_closed_with_the_reason(tmp_path: Path) -> None:
    verdicts: list[str] = []
    missing = str(tmp_path / "no" / "bwrap")
    sandbox = Sandbox(SandboxMode.REQUIRED, bwrap=missing, on_verdict=verdicts.append)
    with pytest.raises(ToolError) as caught:
        sh(sandbox, tmp_path, "echo ran > ran.txt")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("run_command refused: [tools] sandbox is required and bwrap not")
    assert "install bubblewrap" in message and "did not run" in message
    assert not (tmp_path / "ran.txt").exists()
    assert verdicts == [f"refused: {sandbox.problem()}"]
    # auto runs the same command bare, and says so
    auto = Sandbox(SandboxMode.AUTO, bwrap=missing, on_verdict=verdicts.append)
    assert sh(auto, tmp_path, "echo ran > ran.txt").startswith("exit code 0")
    assert verdicts[-1].startswith("bare: bwrap not found")


def test_a_worker_without_bwrap_shows_the_refusal_in_status(tmp_path: Path) -> None:
    """Under ``required``, a worker whose PATH has no bwrap records an error result with
    the reason, and `agentd status` shows it in the task's row."""
    spool = make_spool(tmp_path)
    config = tmp_path / "agentd.toml"
    config.write_text('[heartbeat]\ninterval = 0.1\n[tools]\nsandbox = "required"\n')
    task = scripted_task(
        spool,
        [
            reply(tool_use("run_command", command="echo ran > ran.txt")),
            reply(text("Done."), delay=0.5),  # the heartbeat beats meanwhile
        ],
    )
    code = run_worker(task, env={"PATH": str(tmp_path), "AGENTD_CONFIG": str(config)})
    assert code == ExitCode.DONE
    (result,) = of_kind(journal_records(task), "result")
    assert result["is_error"] and "sandbox is required and bwrap not found" in result["content"]
    assert not (task.path / "workspace" / "ran.txt").exists()
    row = status_row(task)
    assert row["sandbox"].startswith("refused: bwrap not found")


def test_a_setsid_child_dies_when_the_call_ends(spool: Spool, config: Path) -> None:
    workspace = spool.tasks_dir / "t1" / "workspace"
    marker = unique_sleep()
    command = f"setsid sh -c 'sleep {marker}' >/dev/null 2>&1 </dev/null & echo started"
    try:
        out = sh(sandboxed(spool, config), workspace, command)
        assert "started" in out
        poll_for(lambda: not processes_with(marker), 30.0, what="the setsid child to be gone")
    finally:
        kill_processes_with(marker)


def test_a_killed_worker_takes_its_sandbox_with_it(tmp_path: Path) -> None:
    """kill -9 of the worker alone (not its group): bwrap's death signal, then its PID
    namespace, end every process of the call, also one that left the group."""
    spool = make_spool(tmp_path)
    inner, outer = unique_sleep(), unique_sleep().replace("30.", "31.", 1)
    command = f"setsid sh -c 'sleep {inner}' >/dev/null 2>&1 </dev/null & sleep {outer}"
    task = scripted_task(spool, [reply(tool_use("run_command", command=command, timeout=60))])
    proc = start_worker(task)
    try:
        poll_for(
            lambda: len(processes_with(inner)) and len(processes_with(outer)),
            15.0,
            what="the command",
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        poll_for(
            lambda: not processes_with(inner) and not processes_with(outer),
            2.0,
            what="the sandbox to end",
        )
    finally:
        kill_processes_with(inner)
        kill_processes_with(outer)
        proc.communicate()


def test_mounts_land_on_top_of_those_that_contain_them(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    workspace = spool / "tasks" / "t1" / "workspace"
    inner = tmp_path / "repo" / ".spool"  # a spool inside a workspace given with --workspace
    for path in (workspace, inner):
        path.mkdir(parents=True)
    options = mount_options(workspace, [spool])
    assert options.index("--tmpfs", options.index(str(spool)) - 1) < options.index("--bind")
    assert options[options.index("--bind") + 1] == str(workspace)
    assert options[-6:-2] == ["--remount-ro", str(spool), "--remount-ro", "/"]
    assert options[-2:] == ["--chdir", str(workspace)]
    options = mount_options(tmp_path / "repo", [inner])
    assert options.index("--bind") < options.index(str(inner))


def test_a_spool_inside_the_workspace_stays_hidden(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    spool = Spool(repo / ".spool").ensure()
    (spool.root / "supervisor.json").write_text(SECRET)
    (repo / "readme").write_text("hello")
    sandbox = sandbox_for(SandboxMode.REQUIRED, True, spool=spool.root, config=None)
    out = sh(sandbox, repo, "cat readme; ls -a .spool; cat .spool/supervisor.json; true")
    assert "hello" in out and SECRET not in out


def test_a_config_in_a_top_level_folder_hides_the_file_only(tmp_path: Path) -> None:
    sandbox = sandbox_for(SandboxMode.AUTO, True, spool=tmp_path, config=Path("/etc/agentd.toml"))
    assert Path("/etc") not in sandbox.hidden
    assert Path("/etc/agentd.toml") in sandbox.hidden
    named = sandbox_for(
        SandboxMode.AUTO,
        True,
        spool=tmp_path,
        config=None,
        secret_files=("/run/credentials/agentd.service",),
    )
    assert Path("/run/credentials/agentd.service") in named.hidden


def test_the_probe_runs_once_a_process(tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    count = tmp_path / "count"
    fake.write_text(f"#!/bin/sh\necho x >> {count}\nexit 1\n")
    fake.chmod(0o755)
    sandbox = Sandbox(SandboxMode.REQUIRED, bwrap=str(fake))
    for _ in range(3):
        assert sandbox.verdict().startswith("refused: bwrap cannot create its namespaces")
    assert count.read_text() == "x\n"


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A folder outside the host's /tmp, which the sandbox replaces with its own anyway:
    what is hidden there is hidden by the mounts under test."""
    folder = Path(tempfile.mkdtemp(prefix="agentd-sandbox-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_workspace_of_a_task_made_while_the_worker_runs_is_hidden_from_its_next_call(
    outside_tmp: Path,
) -> None:
    """The worker reads the other tasks' workspaces again before each call's intent (so
    that a storage fault there is a wait, nothing recorded): a task made during one call,
    with its workspace inside this task's (which the sandbox shows), has it hidden from
    the next call; the first call, which began before that task was made, read it."""
    spool = make_spool(outside_tmp)
    mine = outside_tmp / "mine"
    later = mine / "later"
    later.mkdir(parents=True)
    (later / "secret").write_text(SECRET)
    wait = "while [ ! -e go ]; do sleep 0.05; done"  # (the test lets it go on)
    first = tool_use("run_command", "c1", command=f"{wait}; cat {later}/secret")
    second = tool_use("run_command", "c2", command=f"cat {later}/secret; true")
    task = scripted_task(
        spool, [reply(first), reply(second), reply(text("done"))], name="t1", workspace=mine
    )
    worker = start_worker(task)
    poll_for(lambda: of_kind(journal_records(task), "intent"), 30, what="the first call")
    scripted_task(spool, [reply(text("done"))], name="t2", workspace=later)
    (mine / "go").touch()  # the first call goes on (t2 was made after its intent: shown)
    assert finish(worker)[0] == ExitCode.DONE
    results = {r["call_id"]: r["content"] for r in of_kind(journal_records(task), "result")}
    assert SECRET in results["c1"]  # (the control: made after the first call's intent)
    assert SECRET not in results["c2"]


def test_with_a_store_what_libpq_could_log_in_with_is_hidden(outside_tmp: Path) -> None:
    # (inside the workspace, which the sandbox shows: elsewhere they are not shown at all)
    workspace = outside_tmp / "ws"
    home, elsewhere, sockets = (workspace / n for n in ("home", "etc", "run"))
    for folder in (workspace, home, elsewhere, sockets, home / ".postgresql"):
        folder.mkdir()
    secrets = [
        home / ".pgpass",
        home / ".pg_service.conf",
        home / ".postgresql" / "postgresql.key",
        elsewhere / "pgpass",
        elsewhere / "pg_service.conf",
        sockets / ".s.PGSQL.5432.lock",
    ]
    for path in secrets:
        path.write_text(f"*:*:*:agentd:{SECRET}\n")
    env = {
        "HOME": str(home),
        "PGPASSFILE": str(elsewhere / "pgpass"),
        "PGSERVICEFILE": str(elsewhere / "pg_service.conf"),
    }
    url = f"postgresql://agentd@/postgres?host={sockets}"
    hidden = credentials.store_paths(env, url)
    command = f"cat {' '.join(map(str, secrets))}; true"
    bare = sandbox_for(SandboxMode.REQUIRED, True, spool=None, config=None)
    assert sh(bare, workspace, command).count(SECRET) == len(secrets)  # the control
    sandbox = sandbox_for(SandboxMode.REQUIRED, True, spool=None, config=None, secret_files=hidden)
    out = sh(sandbox, workspace, command)
    assert SECRET not in out
    assert sh(sandbox, workspace, f"ls -a {sockets}").split() == [
        *("exit", "code", "0", "---", "stdout", "---", ".", ".."),
        *("---", "stderr", "---"),
    ]
    assert sh(sandbox, workspace, "echo ok > x; cat x").startswith(
        "exit code 0\n--- stdout ---\nok"
    )


def test_no_libpq_variable_reaches_a_tool() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root", "PGPASSWORD": SECRET, "PGPASSFILE": "/x"}
    assert tool_environment(env, "t1", "/w") == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "AGENTD_TASK": "t1",
        "AGENTD_WORKSPACE": "/w",
    }


def test_another_tasks_workspace_is_hidden_and_a_shared_one_stays_writable(
    outside_tmp: Path,
) -> None:
    """Another task's workspace is not shown (nothing outside the system's folders and the
    task's own is); one inside this task's workspace, made after the worker started, is
    covered from the next refresh; a workspace two tasks share stays writable."""
    spool = make_spool(outside_tmp)
    mine, theirs = outside_tmp / "mine", outside_tmp / "theirs"
    later = mine / "later"
    for folder in (mine, theirs, later):
        folder.mkdir()
        (folder / "secret").write_text(SECRET)
    done = [reply(text("done"))]
    scripted_task(spool, done, name="t1", workspace=mine)
    scripted_task(spool, done, name="t2", workspace=theirs)
    scripted_task(spool, done, name="t3", workspace=mine)  # shares t1's
    others = OtherWorkspaces(FileStore(spool.root), "t1")
    sandbox = sandbox_for(SandboxMode.REQUIRED, True, spool=spool.root, config=None, others=others)
    command = "cat {0}/secret; echo x > {0}/planted; true"
    off = sandbox_for(SandboxMode.OFF, True, spool=None, config=None)
    assert SECRET in sh(off, mine, f"cat {theirs}/secret")  # the control: bare
    out = sh(sandbox, mine, command.format(theirs))
    assert SECRET not in out and not (theirs / "planted").exists()
    assert SECRET in sh(sandbox, mine, command.format(later))  # (no task's yet: its own)
    (later / "planted").unlink()
    scripted_task(spool, done, name="t4", workspace=later)  # after the worker started
    others.refresh()  # (the loop reads them again before each call: the test above)
    out = sh(sandbox, mine, command.format(later))
    assert SECRET not in out and not (later / "planted").exists()
    assert SECRET in sh(sandbox, mine, command.format(mine))  # its own, shared with t3
    assert (mine / "planted").read_text() == "x\n"


def test_a_command_that_names_the_hosts_tmp_is_told_it_is_not_shown(outside_tmp: Path) -> None:
    """A script a user put in the host's /tmp is not in the sandbox's own /tmp: the
    result says so once, plainly; a path there that the host lacks too, the workspace's
    own files and the spool's are not named."""
    host_tmp = Path(tempfile.mkdtemp(prefix="agentd-host-tmp-", dir="/tmp"))
    try:
        script = host_tmp / "build.sh"
        script.write_text("echo built\n")
        spool = make_spool(host_tmp)
        workspace = outside_tmp / "ws"
        workspace.mkdir()
        sandbox = sandbox_for(SandboxMode.REQUIRED, True, spool=spool.root, config=None)
        out = sh(sandbox, workspace, f"sh {script}")
        assert "built" not in out and "No such file" in out
        tail = out.split("--- sandbox ---\n")[1]
        assert tail == (
            f"{script} is on the host's temporary folder, which this sandbox does not show "
            "(its /tmp is its own, and it shows only the system's folders and the workspace): "
            "copy what the command needs into the workspace\n"
        )
        quiet = f"ls {host_tmp}/absent {spool.root}/tasks; echo x > /tmp/mine; cat /tmp/mine"
        assert "--- sandbox ---" not in sh(sandbox, workspace, quiet)
        bare = sandbox_for(SandboxMode.OFF, True, spool=None, config=None)
        assert "built" in sh(bare, workspace, f"sh {script}")  # the control: it is there
    finally:
        shutil.rmtree(host_tmp, ignore_errors=True)
