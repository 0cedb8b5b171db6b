"""Tasks on MCP servers, each run by real ``python -m worker`` processes killed for real
(docs/design.md section 11): the tool list recorded at the first start, ``mcp-server-git``
under ``trust = true`` through kill -9s (read-only calls re-run, a commit held and then
made exactly once), a server's own death absorbed, a server that cannot list its tools,
a lazy start on resume, results and secrets, an operator's ``--result``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from typing import Any

from supervisor.decisions import decide
from tests.mcp.servers import fault_server, git_server, write_config
from tests.support import (
    assert_paired,
    finish,
    git,
    journal_records,
    kill_processes_with,
    make_repo,
    make_spool,
    of_kind,
    poll_for,
    processes_with,
    reply,
    scripted_task,
    start_worker,
    text,
    tool_use,
    unique_sleep,
)
from worker.config import load_config
from worker.events import read_events
from worker.protocol import ExitCode
from worker.spool import TaskDir
from worker.state import fold
from worker.store.files import FileStore

#: A folder a sandboxed server sees as the host has it (unlike /tmp, which is its own).
OUTSIDE_TMP = "/var/tmp"
DONE = reply(text("Done."))


class McpTask:
    """A scripted task on a config with ``servers``, run by worker processes."""

    def __init__(
        self,
        tmp_path: Path,
        servers: dict[str, dict[str, Any]],
        responses: list[dict[str, Any]],
        *,
        tools: list[str],
        workspace: Path | None = None,
        **tables: Any,
    ) -> None:
        self.config_path = write_config(tmp_path / "agentd.toml", servers, **tables)
        self.spool = make_spool(tmp_path)
        self.task: TaskDir = scripted_task(
            self.spool,
            responses,
            config=load_config(self.config_path),
            tools=tools,
            workspace=workspace,
        )
        self.workspace = self.task.workspace_for(self.task.load_spec())

    def start(self, env: dict[str, str] | None = None) -> Any:
        return start_worker(self.task, env=env, args=["--config", str(self.config_path)])

    def run(self, timeout: float = 90.0, env: dict[str, str] | None = None) -> tuple[int, str]:
        return finish(self.start(env), timeout)

    def records(self) -> list[dict[str, Any]]:
        return journal_records(self.task)

    def events(self) -> list[str]:
        return [e["event"] for e in read_events(self.task.events)]

    def transcript(self) -> list[dict[str, Any]]:
        return fold(self.task.load_spec().prompt, self.records()).messages

    def results(self) -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = {}
        for record in of_kind(self.records(), "result"):
            found.setdefault(record["call_id"], []).append(record)
        return found

    def intent_of(self, call_id: str) -> dict[str, Any] | None:
        return next((r for r in of_kind(self.records(), "intent") if r["call_id"] == call_id), None)


def kill9(proc: Any) -> None:
    """kill -9 of the worker alone (not its group): what its servers do then is theirs."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def slow_git(repo: Path, marker: str) -> dict[str, str]:
    """``git`` for mcp-server-git (GitPython's ``GIT_PYTHON_GIT_EXECUTABLE``), slowed by a
    ``sleep`` holding ``marker``: ``git status`` while ``.git/slow-status`` exists, ``git
    log`` and ``rev-list`` while ``.git/slow-log`` does."""
    wrapper = repo / ".git" / "slow-git"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for arg in "$@"; do case "$arg" in\n'
        f"  status) [ -e {repo}/.git/slow-status ] && sleep {marker}; break;;\n"
        f"  log|rev-list) [ -e {repo}/.git/slow-log ] && sleep {marker}; break;;\n"
        "esac; done\n"
        'exec git "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return {"GIT_PYTHON_GIT_EXECUTABLE": str(wrapper)}


def killed_in(made: McpTask, marker: str, call: str) -> None:
    """Run a worker until ``call`` is in its slowed git, kill -9 it, and see that nothing
    it started is left running."""
    proc = made.start()
    try:
        poll_for(lambda: processes_with(marker), timeout=90, what=f"{call} in git")
        assert made.intent_of(call) is not None
    finally:
        kill9(proc)
    poll_for(lambda: not processes_with(marker), timeout=30, what="nothing left running")


# -- the recorded list --------------------------------------------------------------------


def test_the_first_start_records_the_list_and_calls_go_through_it(tmp_path: Path) -> None:
    responses = [
        reply(tool_use("mcp__f__echo", "c1", text="hi"), tool_use("read_file", "c2", path="x")),
        reply(tool_use("mcp__f__image", "c3"), tool_use("mcp__f__fail", "c4")),
        DONE,
    ]
    made = McpTask(
        tmp_path,
        {"f": {"command": fault_server(), "trust": True}, "other": {"command": ["false"]}},
        responses,
        tools=["read_file", "mcp__f__*"],
    )
    code, err = made.run()
    assert code == ExitCode.DONE, err
    assert "mcp f: fault server: up" in err  # its stderr, in the worker's (worker.log)
    (record,) = of_kind(made.records(), "tools")
    assert record["local"] == ["read_file"]
    assert "other" not in record["listed"]  # no pattern reaches it: never started
    mapped = {t["name"]: t for t in record["mcp"]}
    assert mapped["mcp__f__echo"]["effect"] == "read_only"
    assert mapped["mcp__f__echo"]["effect_from"] == "annotation"
    assert mapped["mcp__f__count"]["effect"] == "unsafe"
    assert mapped["mcp__f__settle"]["effect"] == "idempotent"
    assert "vanishing" in record["listed"]["f"]
    results = made.results()
    assert json.loads(results["c1"][0]["content"])["meta"]["agentd/idempotency_key"].startswith(
        "agentd-"
    )
    image = results["c3"][0]["content"]
    assert [b["type"] for b in image] == ["text", "image"]
    assert results["c4"][0]["is_error"] is True
    assert_paired(made.transcript())


def test_a_server_that_cannot_list_its_tools_at_the_first_start_waits(tmp_path: Path) -> None:
    made = McpTask(
        tmp_path,
        {"f": {"command": fault_server("--no-list")}},
        [reply(tool_use("mcp__f__echo", "c1", text="hi")), DONE],
        tools=["mcp__f__*"],
    )
    code, _ = made.run()
    assert code == ExitCode.TOOLS
    reason = FileStore(made.spool.root).read_exit(made.task.id)
    assert reason is not None
    assert reason["reason"].startswith("mcp: f: cannot list its tools")
    assert not of_kind(made.records(), "turn") and not of_kind(made.records(), "tools")
    assert "mcp_server_failed" in made.events()
    write_config(made.config_path, {"f": {"command": fault_server()}})  # the server mended
    code, err = made.run()
    assert code == ExitCode.DONE, err


def test_a_resumed_task_starts_a_server_only_at_its_first_call(tmp_path: Path) -> None:
    made = McpTask(
        tmp_path,
        {"f": {"command": fault_server("--log-start", "starts")}},
        [reply(tool_use("mcp__f__echo", "c1", text="hi")), reply(text("Done."), delay=60)],
        tools=["mcp__f__*"],
    )
    proc = made.start()
    poll_for(lambda: made.results().get("c1"), timeout=60, what="the call's result")
    kill9(proc)
    assert len((made.workspace / "starts").read_text().splitlines()) == 1
    first = reply(tool_use("mcp__f__echo", "c1", text="hi"))
    made.task.script.write_text(json.dumps({"responses": [first, DONE]}))  # no more delay
    code, err = made.run()
    assert code == ExitCode.DONE, err
    assert len((made.workspace / "starts").read_text().splitlines()) == 1  # never started


# -- mcp-server-git, trusted ----------------------------------------------------------------


def test_git_status_and_git_log_rerun_by_themselves_after_kill_9(tmp_path: Path) -> None:
    marker = unique_sleep()
    repo = make_repo(tmp_path / "repo")
    responses = [
        reply(tool_use("mcp__git__git_status", "s1", repo_path=str(repo))),
        reply(tool_use("mcp__git__git_log", "l1", repo_path=str(repo))),
        DONE,
    ]
    made = McpTask(
        tmp_path,
        {"git": {"command": git_server(str(repo)), "trust": True, "env": slow_git(repo, marker)}},
        responses,
        tools=["mcp__git__*"],
        workspace=repo,
    )
    slow = repo / ".git"
    try:
        (slow / "slow-status").write_text("")
        killed_in(made, marker, "s1")
        (slow / "slow-status").unlink()
        (slow / "slow-log").write_text("")
        killed_in(made, marker, "l1")  # (s1 re-run first, at once: read-only)
        (slow / "slow-log").unlink()
        code, err = made.run()
    finally:
        kill_processes_with(marker)
    assert code == ExitCode.DONE, err
    results = made.results()
    assert results["s1"][0]["outcome"] == "rerun" and "On branch" in results["s1"][0]["content"]
    assert results["l1"][-1]["outcome"] == "rerun" and "init" in results["l1"][-1]["content"]
    assert not of_kind(made.records(), "hold")
    assert made.events().count("dangling_rerun") >= 2
    assert_paired(made.transcript())


def test_a_kill_inside_git_commit_holds_and_one_rerun_commits_once(tmp_path: Path) -> None:
    marker = unique_sleep()
    repo = make_repo(tmp_path / "repo")
    (repo / "b.txt").write_text("new")
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text(f"#!/bin/sh\n[ -e {repo}/.git/slow ] && sleep {marker}\nexit 0\n")
    hook.chmod(0o755)
    (repo / ".git" / "slow").write_text("")
    responses = [
        reply(tool_use("mcp__git__git_add", "a1", repo_path=str(repo), files=["b.txt"])),
        reply(tool_use("mcp__git__git_commit", "c1", repo_path=str(repo), message="add b")),
        DONE,
    ]
    made = McpTask(
        tmp_path,
        {"git": {"command": git_server(str(repo)), "trust": True}},
        responses,
        tools=["mcp__git__*"],
        workspace=repo,
    )
    before = int(git(repo, "rev-list", "--count", "HEAD"))
    try:
        proc = made.start()
        poll_for(lambda: processes_with(marker), timeout=90, what="the pre-commit hook")
        kill9(proc)
        poll_for(lambda: not processes_with(marker), timeout=30, what="the hook killed")
        (repo / ".git" / "slow").unlink()
        code, _ = made.run()
        assert code == ExitCode.HELD  # git_commit is unsafe: its outcome is unknown
        assert int(git(repo, "rev-list", "--count", "HEAD")) == before
        (intent,) = [r for r in of_kind(made.records(), "intent") if r["call_id"] == "c1"]
        assert intent["effect"] == "unsafe"
        decide(made.task, "c1", action="rerun")
        code, err = made.run()
        assert code == ExitCode.DONE, err
    finally:
        kill_processes_with(marker)
    assert int(git(repo, "rev-list", "--count", "HEAD")) == before + 1
    assert git(repo, "log", "-1", "--format=%s").strip() == "add b"
    assert made.results()["c1"][0]["outcome"] == "rerun"
    assert_paired(made.transcript())


def test_the_servers_own_death_mid_call_is_absorbed_for_a_read_only_call(tmp_path: Path) -> None:
    marker = unique_sleep()
    repo = make_repo(tmp_path / "repo")
    made = McpTask(
        tmp_path,
        {"git": {"command": git_server(str(repo)), "trust": True, "env": slow_git(repo, marker)}},
        [reply(tool_use("mcp__git__git_status", "s1", repo_path=str(repo))), DONE],
        tools=["mcp__git__*"],
        workspace=repo,
    )
    (repo / ".git" / "slow-status").write_text("")
    try:
        proc = made.start()
        poll_for(lambda: processes_with(marker), timeout=90, what="git_status in git")
        (repo / ".git" / "slow-status").unlink()  # the re-run is quick
        for server in processes_with("mcp-server-git"):
            if server.name() != "bwrap" and str(repo) in " ".join(server.cmdline()):
                server.kill()
        code, err = finish(proc, 90)
    finally:
        kill_processes_with(marker)
    assert code == ExitCode.DONE, err
    assert not of_kind(made.records(), "hold")
    (result,) = made.results()["s1"]
    assert result["outcome"] == "rerun" and "On branch" in result["content"]
    assert "mcp_server_failed" in made.events() and "dangling_rerun" in made.events()


# -- unsafe calls, decisions, secrets ----------------------------------------------------------


def test_an_operators_result_for_a_held_mcp_call(tmp_path: Path) -> None:
    made = McpTask(
        tmp_path,
        {"f": {"command": fault_server()}},  # untrusted: every tool unsafe
        [reply(tool_use("mcp__f__count", "c1", file="ledger", seconds=60)), DONE],
        tools=["mcp__f__count"],
    )
    proc = made.start()
    ledger = made.workspace / "ledger"
    # the count's line, not its file: the file is there from the server's open, and the
    # server dies with the worker (bwrap's --die-with-parent), perhaps before it writes
    poll_for(lambda: ledger.exists() and ledger.read_text().endswith("\n"), timeout=60,
             what="the count made")  # fmt: skip
    kill9(proc)
    code, _ = made.run()
    assert code == ExitCode.HELD
    decide(made.task, "c1", action="result", result="counted once, checked by hand")
    code, err = made.run()
    assert code == ExitCode.DONE, err
    (result,) = made.results()["c1"]
    assert (result["outcome"], result["content"]) == ("operator", "counted once, checked by hand")
    assert len(ledger.read_text().splitlines()) == 1  # never run again
    assert_paired(made.transcript())


def test_a_credential_a_server_hands_back_is_redacted(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("cred-value-0123456789abcdef\n")
    made = McpTask(
        tmp_path,
        {"f": {"command": fault_server(), "env": {"TOKEN": "${cred:api_token}"}}},
        [reply(tool_use("mcp__f__env", "c1", variable="TOKEN")), DONE],
        tools=["mcp__f__env"],
    )
    code, err = made.run(env={"AGENTD_CRED_API_TOKEN_FILE": str(secret)})
    assert code == ExitCode.DONE, err
    assert made.results()["c1"][0]["content"] == "[redacted]"
    assert "cred-value-0123456789abcdef" not in made.task.journal.read_bytes().decode(
        errors="replace"
    )


# -- containment ---------------------------------------------------------------------------------


def test_a_filesystem_server_allowed_root_reaches_nothing_it_must_not() -> None:
    """``@modelcontextprotocol/server-filesystem`` allowed ``/`` (and the fault server's
    ``read``, which checks nothing) ask for the spool, the config, the API key's file, the
    systemd credentials and another task's workspace: every answer is a refusal, and no
    canary reaches the journal; a file of the task's own workspace is read (the control)."""
    canary = "canary-" + os.urandom(8).hex()
    # (outside /tmp: a sandboxed server has a /tmp of its own, which would hide it all)
    root = Path(tempfile.mkdtemp(prefix="agentd-mcp-", dir=OUTSIDE_TMP))
    try:
        attack(root, canary)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def attack(tmp_path: Path, canary: str) -> None:
    """The attack of ``test_a_filesystem_server_allowed_root_reaches_nothing_it_must_not``
    in ``tmp_path``."""
    from tests.mcp.servers import npm_server

    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "anthropic").write_text(f"sk-ant-{canary}\n")
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "tracker_token").write_text(f"{canary}-token\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text(f"{canary} of another task\n")
    made = McpTask(
        tmp_path,
        {
            "fs": {"command": npm_server("filesystem", "/")},
            "f": {"command": fault_server()},
        },
        [DONE],
        tools=["mcp__fs__*", "mcp__f__read"],
    )
    other = scripted_task(made.spool, [DONE], workspace=elsewhere, prompt=f"{canary} prompt")
    (made.task.path / "config.note").write_text(canary)
    with made.config_path.open("a") as config:
        config.write(f"# {canary}\n")
    (made.workspace).mkdir(parents=True, exist_ok=True)
    (made.workspace / "mine.txt").write_text("the task's own file")
    targets = [
        str(other.path / "spec.json"),
        str(made.task.path / "config.note"),
        str(made.spool.root / "tasks" / other.id / "script.json"),
        str(made.config_path),
        str(keys / "anthropic"),
        str(creds / "tracker_token"),
        str(elsewhere / "notes.txt"),
    ]
    calls = []
    for i, path in enumerate(targets):
        calls += [
            tool_use("mcp__fs__read_text_file", f"fs{i}", path=path),
            tool_use("mcp__f__read", f"f{i}", path=path),
        ]
    mine = str(made.workspace / "mine.txt")
    calls += [
        tool_use("mcp__fs__read_text_file", "fs-own", path=mine),
        tool_use("mcp__f__read", "f-own", path=mine),
    ]
    made.task.script.write_text(json.dumps({"responses": [reply(*calls), DONE]}))
    code, err = made.run(
        env={"ANTHROPIC_API_KEY_FILE": str(keys / "anthropic"), "CREDENTIALS_DIRECTORY": str(creds)}
    )
    assert code == ExitCode.DONE, err
    results = made.results()
    assert results["fs-own"][0]["content"] == "the task's own file"
    assert results["f-own"][0]["content"] == "the task's own file"
    for i, path in enumerate(targets):
        for call in (f"fs{i}", f"f{i}"):
            (result,) = results[call]
            assert canary not in result["content"] and "[redacted]" not in result["content"], (
                call,
                path,
                result,
            )
    journal = made.task.journal.read_bytes().decode(errors="replace")
    assert journal.count(canary) == 0


def test_a_task_made_while_a_server_runs_is_not_readable_through_it() -> None:
    """A server started before another task was made, and running on (its worker waits in
    a command), is asked for that task's file by path: ``server-filesystem`` allowed
    ``/`` and the fault server's ``read`` both fail, though the file is there; the same
    read of the server's own workspace works, before and after (the control). The
    sandbox shows a server its workspace and its installation, nothing else: a list of
    what to hide, fixed when it started, would have missed the later task."""
    from tests.mcp.servers import npm_server

    canary = "canary-" + os.urandom(8).hex()
    # (outside /tmp: a sandboxed server has a /tmp of its own, which would hide it anyway)
    # (and a folder of its own: not in the config's, which the sandbox hides whole)
    root = Path(tempfile.mkdtemp(prefix="agentd-mcp-", dir=OUTSIDE_TMP))
    later = Path(tempfile.mkdtemp(prefix="agentd-mcp-later-", dir=OUTSIDE_TMP))
    try:
        (later / "secret.txt").write_text(canary)
        secret = str(later / "secret.txt")
        made = McpTask(
            root,
            {"fs": {"command": npm_server("filesystem", "/")}, "f": {"command": fault_server()}},
            [DONE],
            tools=["mcp__fs__*", "mcp__f__read", "run_command"],
        )
        made.workspace.mkdir(parents=True, exist_ok=True)
        (made.workspace / "mine.txt").write_text("the task's own file")
        mine = str(made.workspace / "mine.txt")

        def reads(tag: str, path: str) -> list[dict[str, Any]]:
            return [
                tool_use("mcp__fs__read_text_file", f"fs-{tag}", path=path),
                tool_use("mcp__f__read", f"f-{tag}", path=path),
            ]

        wait = "i=0; while [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
        responses = [
            reply(*reads("own-before", mine)),  # (both servers start here)
            reply(tool_use("run_command", "wait", command=wait, timeout=90)),
            reply(*reads("later", secret), *reads("own-after", mine)),
            DONE,
        ]
        made.task.script.write_text(json.dumps({"responses": responses}))
        proc = made.start()
        poll_for(lambda: made.intent_of("wait"), timeout=90, what="the servers to run")
        other = scripted_task(made.spool, [DONE], workspace=later)  # while they run
        assert other.load_spec().workspace == str(later)
        (made.workspace / "go").touch()
        code, err = finish(proc, 90)
        assert code == ExitCode.DONE, err
        results = made.results()
        for call in ("fs-own-before", "f-own-before", "fs-own-after", "f-own-after"):
            assert results[call][0]["content"] == "the task's own file", results[call]
        for call in ("fs-later", "f-later"):
            (result,) = results[call]
            assert canary not in result["content"], result
        assert made.task.journal.read_bytes().count(canary.encode()) == 0
        assert (later / "secret.txt").read_text() == canary  # (it was there all along)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(later, ignore_errors=True)


def test_rewind_and_fork_offer_the_recorded_list(tmp_path: Path) -> None:
    """After a rewind, and in a fork, the task is offered the list its first start
    recorded: a server that lists other tools since is not asked again, and a call of a
    tool it dropped gets an error result."""
    from supervisor.history import fork, rewind

    responses = [
        reply(tool_use("mcp__f__echo", "c1", text="one")),
        reply(tool_use("mcp__f__change_tools", "c2")),
        reply(tool_use("mcp__f__vanishing", "c3")),
        DONE,
    ]
    made = McpTask(
        tmp_path, {"f": {"command": fault_server(), "trust": True}}, responses, tools=["mcp__f__*"]
    )
    code, err = made.run()
    assert code == ExitCode.DONE, err
    (recorded,) = of_kind(made.records(), "tools")
    assert "mcp__f__vanishing" in {t["name"] for t in recorded["mcp"]}
    vanished = made.results()["c3"][0]
    assert vanished["is_error"] and "no longer offers the tool 'vanishing'" in vanished["content"]
    config = load_config(made.config_path)
    forked = fork(made.spool, config, made.task.id, at=1, name="forked")
    child = made.spool.task(forked.task)
    code, err = finish(start_worker(child, args=["--config", str(made.config_path)]), 90)
    assert code == ExitCode.DONE, err
    child_records = journal_records(child)
    assert not of_kind(child_records, "tools")  # the parent's list, carried by its base scene
    assert fold(child.load_spec().prompt, child_records).tools == {
        k: v for k, v in recorded.items() if k not in ("k", "at")
    }
    rewind(made.spool, config, made.task.id, 0, yes=True)
    code, err = made.run()
    assert code == ExitCode.DONE, err
    assert len(of_kind(made.records(), "tools")) == 1  # never recorded again
    assert_paired(made.transcript())


def test_a_task_offered_no_mcp_tool_starts_no_server(tmp_path: Path) -> None:
    from tests.mcp.servers import mcp_config
    from tests.support import make_loop

    config = mcp_config(tmp_path, {"f": {"command": fault_server()}})
    spool = make_spool(tmp_path)
    task = scripted_task(
        spool, [reply(tool_use("list_dir", "c1")), DONE], config=config, tools=["list_dir"]
    )
    loop = make_loop(task, config=config)
    try:
        assert loop.run().state == "done"
    finally:
        loop.close()
    assert loop.servers is not None and not loop.servers.started  # no thread, no SDK
    (record,) = of_kind(journal_records(task), "tools")
    assert (record["local"], record["mcp"], record["listed"]) == (["list_dir"], [], {})
