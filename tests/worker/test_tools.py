"""Tools: schemas, input validation, workspace confinement, the built-ins, user modules."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from tests.mounts import tmpfs
from tests.support import (
    journal_records,
    kill_processes_with,
    make_spool,
    of_kind,
    poll_for,
    processes_with,
    reply,
    run_worker,
    scripted_task,
    tool_use,
    unique_sleep,
)
from worker.errors import ConfigError, TaskSpecError
from worker.protocol import ExitCode
from worker.tool_calls import tool_environment
from worker.tools.builtin import (
    BUILTIN_TOOLS,
    MAX_OUTPUT,
    append_file,
    list_dir,
    outbox_send,
    read_file,
    run_command,
    write_file,
)
from worker.tools.registry import Effect, Tool, ToolContext, ToolError, ToolRegistry, tool
from worker.tools.sandbox import Sandbox, SandboxMode

CANARY = "sk-ant-canary-0123456789abcdef"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "task" / "workspace"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("secret")
    return path


@pytest.fixture(params=[SandboxMode.AUTO, SandboxMode.OFF], ids=lambda mode: f"sandbox-{mode}")
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    """run_command behaves the same under bwrap (auto, where it works) and bare."""
    return Sandbox(request.param)


def ctx_for(
    workspace: Path,
    *,
    key: str = "agentd-key-1",
    timeout: float = 30.0,
    sandbox: Sandbox | None = None,
) -> ToolContext:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "AGENTD_TASK": "t1"}
    return ToolContext(workspace, "t1", "toolu_1", key, timeout, env, sandbox or Sandbox())


def run(t: Tool, workspace: Path, sandbox: Sandbox | None = None, /, **data: object) -> str:
    """Run tool ``t`` with input ``data`` (any name, ``sandbox`` too: it is positional)."""
    return t.run(ctx_for(workspace, sandbox=sandbox), t.check_input(data))


def tree(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path``: file content, None for folders and links."""
    found: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = Path(root) / name
            rel = str(full.relative_to(path))
            found[rel] = full.read_bytes() if full.is_file() and not full.is_symlink() else None
    return found


# -- declaring tools --------------------------------------------------------------------


@tool(effect=Effect.READ_ONLY)
def sample(  # type: ignore[no-untyped-def]  # `loose` has no hint on purpose (its schema)
    ctx: ToolContext,
    name: str,
    count: int,
    ratio: float,
    flag: bool,
    tags: list[str],
    meta: dict[str, int],
    maybe: str | None = None,
    loose=None,  # no hint: any JSON value
) -> str:
    """A sample tool.

    With a longer description."""
    return f"{name}:{count}"


def test_schema_from_type_hints() -> None:
    assert sample.name == "sample"
    assert sample.effect is Effect.READ_ONLY
    assert sample.input_schema == {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": {"type": "object"},
            "maybe": {"type": "string"},
            "loose": {},
        },
        "required": ["name", "count", "ratio", "flag", "tags", "meta"],
    }
    definition = sample.api_definition()
    assert definition["name"] == "sample"
    assert definition["description"] == "A sample tool.\n\nWith a longer description."
    assert definition["input_schema"] is sample.input_schema


def test_builtin_schemas_match_the_contract() -> None:
    schemas = {t.name: (t.effect, t.input_schema) for t in BUILTIN_TOOLS}
    assert schemas["read_file"] == (
        Effect.READ_ONLY,
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    )
    assert schemas["list_dir"] == (
        Effect.READ_ONLY,
        {"type": "object", "properties": {"path": {"type": "string"}}},
    )
    for name in ("write_file", "append_file"):
        assert schemas[name][1]["required"] == ["path", "content"]
    assert schemas["write_file"][0] is Effect.IDEMPOTENT
    assert schemas["append_file"][0] is Effect.UNSAFE
    assert schemas["run_command"][0] is Effect.UNSAFE
    assert schemas["run_command"][1]["properties"] == {
        "command": {"type": "string"},
        "timeout": {"type": "number"},
    }
    assert any(effect is Effect.KEYED for effect, _ in schemas.values())


GOOD = {"name": "n", "count": 1, "ratio": 0.5, "flag": True, "tags": ["a"], "meta": {}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (["not", "an", "object"], "input must be a JSON object"),
        ("text", "input must be a JSON object"),
        ({k: v for k, v in GOOD.items() if k != "count"}, "missing required input 'count'"),
        ({**GOOD, "extra": 1}, "unknown input 'extra'"),
        ({**GOOD, "name": 5}, "input 'name' must be of type string"),
        ({**GOOD, "count": 1.5}, "input 'count' must be of type integer"),
        ({**GOOD, "count": True}, "input 'count' must be of type integer"),
        ({**GOOD, "ratio": "0.5"}, "input 'ratio' must be of type number"),
        ({**GOOD, "ratio": False}, "input 'ratio' must be of type number"),
        ({**GOOD, "flag": 1}, "input 'flag' must be of type boolean"),
        ({**GOOD, "tags": "a"}, "input 'tags' must be of type array"),
        ({**GOOD, "meta": []}, "input 'meta' must be of type object"),
    ],
)
def test_input_validation_errors(data: object, message: str) -> None:
    with pytest.raises(ToolError, match=message) as info:
        sample.check_input(data)
    assert str(info.value).startswith("sample: ")


def test_valid_input_passes() -> None:
    assert sample.check_input({**GOOD, "ratio": 2}) == {**GOOD, "ratio": 2}  # int is a number
    assert sample.check_input({**GOOD, "loose": [1, {"x": None}]})["loose"] == [1, {"x": None}]


# -- confinement ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["../outside/secret.txt", "a/../../outside/secret.txt", "..", "/etc/hostname", "a\0b"],
)
@pytest.mark.parametrize("t", [read_file, list_dir, write_file, append_file], ids=lambda t: t.name)
def test_paths_outside_are_refused(workspace: Path, outside: Path, path: str, t: Tool) -> None:
    before = tree(workspace.parent.parent)
    data: dict[str, object] = {"path": path}
    if t in (write_file, append_file):
        data["content"] = "pwned"
    with pytest.raises(ToolError, match=r"escapes the workspace|absolute|NUL"):
        run(t, workspace, **data)
    assert tree(workspace.parent.parent) == before


def test_dot_dot_that_stays_inside_is_fine(workspace: Path) -> None:
    run(write_file, workspace, path="a/../b.txt", content="x")
    assert (workspace / "b.txt").read_text() == "x"


@pytest.mark.parametrize("path", [".", "", "sub/.."])
@pytest.mark.parametrize("t", [write_file, append_file], ids=lambda t: t.name)
def test_writing_the_workspace_itself_is_refused(workspace: Path, path: str, t: Tool) -> None:
    parent = workspace.parent
    before = tree(parent)
    with pytest.raises(ToolError, match="workspace"):
        run(t, workspace, path=path, content="x")
    assert tree(parent) == before, "something was written next to the workspace"


@pytest.fixture
def planted(workspace: Path, outside: Path) -> Path:
    """Symlinks inside the workspace that point out of it."""
    (workspace / "to_file").symlink_to(outside / "secret.txt")
    (workspace / "to_dir").symlink_to(outside)
    (workspace / "to_missing").symlink_to(outside / "missing.txt")
    return outside


@pytest.mark.parametrize(
    ("t", "data"),
    [
        (read_file, {"path": "to_file"}),
        (read_file, {"path": "to_dir/secret.txt"}),
        (list_dir, {"path": "to_dir"}),
        (write_file, {"path": "to_file", "content": "pwned"}),
        (write_file, {"path": "to_dir/new.txt", "content": "pwned"}),
        (write_file, {"path": "to_dir/deep/new.txt", "content": "pwned"}),
        (write_file, {"path": "to_missing", "content": "pwned"}),
        (append_file, {"path": "to_file", "content": "pwned"}),
        (append_file, {"path": "to_missing", "content": "pwned"}),
        (append_file, {"path": "to_dir/new.txt", "content": "pwned"}),
    ],
)
def test_symlinks_out_of_the_workspace_are_refused(
    workspace: Path, planted: Path, t: Tool, data: dict[str, object]
) -> None:
    before = tree(planted)
    with pytest.raises(ToolError, match="escapes the workspace"):
        run(t, workspace, **data)
    assert tree(planted) == before
    assert (planted / "secret.txt").read_text() == "secret"


def test_an_outbox_that_is_a_symlink_out_is_refused(workspace: Path, planted: Path) -> None:
    (workspace / "outbox").symlink_to(planted)
    ctx = ctx_for(workspace, key="agentd-out")
    data = {"to": "ops@example.com", "body": "hi"}
    for call in (outbox_send.run, outbox_send.reconcile):
        assert call is not None
        with pytest.raises(ToolError, match="escapes the workspace"):
            call(ctx, data)
    assert sorted(os.listdir(planted)) == ["secret.txt"]


def test_symlinks_inside_the_workspace_are_followed(workspace: Path) -> None:
    (workspace / "real").mkdir()
    (workspace / "real" / "f.txt").write_text("inside")
    (workspace / "alias").symlink_to(workspace / "real")
    assert run(read_file, workspace, path="alias/f.txt") == "inside"


def test_writes_through_a_symlink_inside_reach_its_target(workspace: Path) -> None:
    (workspace / "real").mkdir()
    (workspace / "real" / "f.txt").write_text("old")
    (workspace / "alias.txt").symlink_to("real/f.txt")
    run(write_file, workspace, path="alias.txt", content="new")
    run(append_file, workspace, path="alias.txt", content="+")
    assert (workspace / "real" / "f.txt").read_text() == "new+"
    assert (workspace / "alias.txt").is_symlink()


@pytest.mark.parametrize("t", [write_file, append_file], ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["d", "d/", "d/e/..", "f.txt/x"])
def test_writing_a_folder_is_refused(workspace: Path, t: Tool, path: str) -> None:
    (workspace / "d" / "e").mkdir(parents=True)
    (workspace / "f.txt").write_text("")
    before = tree(workspace)
    with pytest.raises(ToolError, match="folder") as info:
        run(t, workspace, path=path, content="x")
    assert "\n" not in str(info.value)
    assert tree(workspace) == before


@pytest.mark.timeout(20)  # the check-then-open of old blocked in open() for ever
def test_reading_a_fifo_is_refused_at_once(workspace: Path) -> None:
    os.mkfifo(workspace / "pipe")
    with pytest.raises(ToolError, match="not a regular file"):
        run(read_file, workspace, path="pipe")


def test_the_workspace_is_the_folder_the_worker_opened(workspace: Path, outside: Path) -> None:
    """A context carries the workspace opened once: its name swapped for a symlink to
    elsewhere after that (by a tool of another task) takes no tool there."""
    ctx = ctx_for(workspace)
    write_file.run(ctx, {"path": "a.txt", "content": "mine"})
    workspace.rename(workspace.with_name("moved"))
    workspace.symlink_to(outside)
    assert read_file.run(ctx, {"path": "a.txt"}) == "mine"
    write_file.run(ctx, {"path": "secret.txt", "content": "pwned"})
    assert (outside / "secret.txt").read_text() == "secret"
    assert "secret.txt" in list_dir.run(ctx, {})


# -- the built-in tools -----------------------------------------------------------------


def test_read_file(workspace: Path) -> None:
    (workspace / "f.txt").write_text("héllo")
    assert run(read_file, workspace, path="f.txt") == "héllo"
    with pytest.raises(ToolError, match=r"no file 'nope\.txt'"):
        run(read_file, workspace, path="nope.txt")
    (workspace / "d").mkdir()
    with pytest.raises(ToolError, match="is a folder"):
        run(read_file, workspace, path="d")
    (workspace / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ToolError, match="not UTF-8"):
        run(read_file, workspace, path="bin")


def test_list_dir(workspace: Path, outside: Path) -> None:
    (workspace / "b.txt").write_text("")
    (workspace / "a").mkdir()
    (workspace / "a" / "inner.txt").write_text("")
    (workspace / "link").symlink_to(outside)  # listed, not followed
    assert run(list_dir, workspace) == "a/\nb.txt\nlink"
    assert run(list_dir, workspace, path="a") == "inner.txt"
    with pytest.raises(ToolError, match="no folder"):
        run(list_dir, workspace, path="nope")
    with pytest.raises(ToolError, match="is a file"):
        run(list_dir, workspace, path="b.txt")


def test_write_file_creates_parents_and_replaces(workspace: Path) -> None:
    out = run(write_file, workspace, path="x/y/z.txt", content="héllo")
    assert out == "wrote 6 bytes to x/y/z.txt"
    assert (workspace / "x" / "y" / "z.txt").read_text() == "héllo"
    run(write_file, workspace, path="x/y/z.txt", content="second")
    assert (workspace / "x" / "y" / "z.txt").read_text() == "second"
    assert sorted(os.listdir(workspace / "x" / "y")) == ["z.txt"]


def test_append_file(workspace: Path) -> None:
    assert run(append_file, workspace, path="d/log.txt", content="one\n") == (
        "appended 4 bytes to d/log.txt"
    )
    run(append_file, workspace, path="d/log.txt", content="two\n")
    assert (workspace / "d" / "log.txt").read_text() == "one\ntwo\n"


def test_run_command_output(workspace: Path, sandbox: Sandbox) -> None:
    out = run(run_command, workspace, sandbox, command="echo out; echo err >&2; pwd; exit 3")
    assert out.startswith("exit code 3\n")
    stdout, stderr = out.split("--- stderr ---\n")
    assert "out" in stdout
    assert os.path.realpath(workspace) in stdout
    assert stderr.strip() == "err"


def test_run_command_output_is_clipped(workspace: Path, sandbox: Sandbox) -> None:
    command = f"head -c {MAX_OUTPUT + 100} /dev/zero | tr '\\0' a"
    out = run(run_command, workspace, sandbox, command=command)
    assert "[... 100 more bytes]" in out
    assert out.count("a") >= MAX_OUTPUT


def test_run_command_keeps_the_head_and_the_tail(workspace: Path, sandbox: Sandbox) -> None:
    out = run(run_command, workspace, sandbox, command="seq 1 100000")
    stdout = out.split("--- stdout ---\n")[1].split("\n--- stderr ---")[0]
    assert stdout.startswith("1\n2\n3\n")
    assert stdout.endswith("99999\n100000\n")
    size = len("".join(f"{n}\n" for n in range(1, 100001)))
    assert f"\n[... {size - MAX_OUTPUT} more bytes]\n" in stdout


def test_run_command_output_touches_no_disk(
    tmp_path: Path, workspace: Path, sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a temp folder of 4 MiB: a spool of the output there would stop the command at 4 MiB
    small = tmp_path / "small-tmp"
    with tmpfs(small, 4):
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        out = run(run_command, workspace, sandbox, command="head -c 256M /dev/zero")
    assert out.startswith("exit code 0\n")
    assert f"[... {256 * 2**20 - MAX_OUTPUT} more bytes]" in out


def test_run_command_returns_when_the_shell_exits(workspace: Path, sandbox: Sandbox) -> None:
    # a background process holds both pipes open and writes on: the shell's exit ends it
    marker = unique_sleep()
    command = f"(while :; do echo more; sleep 0.01; done & sleep {marker}) & echo started"
    started = time.monotonic()
    try:
        out = run(run_command, workspace, sandbox, command=command, timeout=20)
        assert time.monotonic() - started < 10
        # (the background loop may print before the shell's echo)
        assert out.startswith("exit code 0\n--- stdout ---\n") and "\nstarted\n" in out
    finally:
        kill_processes_with(marker)


def test_run_command_timeout_kills_the_process_tree(workspace: Path, sandbox: Sandbox) -> None:
    marker = unique_sleep()
    command = f"sh -c 'sleep {marker} & wait' & wait"
    started = time.monotonic()
    try:
        with pytest.raises(ToolError, match=r"timed out after 0\.5 s and was killed"):
            run(run_command, workspace, sandbox, command=command, timeout=0.5)
        assert time.monotonic() - started < 10
        # killed before run_command returned; reaping the orphans is up to their new parent
        poll_for(
            lambda: not processes_with(marker), 5.0, what="the child and grandchild to be gone"
        )
    finally:
        kill_processes_with(marker)


def test_run_command_timeout_is_kept_when_a_background_process_escapes(
    workspace: Path, sandbox: Sandbox
) -> None:
    # the subshell's child leaves the command's process tree and holds its output open
    marker = unique_sleep()
    command = f"(sleep {marker} &); sleep 30"
    started = time.monotonic()
    try:
        with pytest.raises(ToolError, match=r"timed out after 0\.5 s"):
            run(run_command, workspace, sandbox, command=command, timeout=0.5)
        assert time.monotonic() - started < 3
    finally:
        kill_processes_with(marker)


def test_run_command_timeout_is_capped_by_the_tool_deadline(
    workspace: Path, sandbox: Sandbox
) -> None:
    ctx = ctx_for(workspace, timeout=0.3, sandbox=sandbox)
    started = time.monotonic()
    with pytest.raises(ToolError, match=r"timed out after 0\.3 s"):
        run_command.run(ctx, {"command": "sleep 20", "timeout": 600})
    assert time.monotonic() - started < 10


def test_run_command_sees_only_the_given_environment(workspace: Path, sandbox: Sandbox) -> None:
    out = run(run_command, workspace, sandbox, command="env")
    assert "AGENTD_TASK=t1" in out
    assert "PYTEST" not in out


def test_tool_environment_is_an_allowlist(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    task = scripted_task(spool, [reply({"type": "text", "text": "hi"})], name="env")
    environ = {
        "PATH": "/bin",
        "HOME": "/var/lib/agentd",
        "ANTHROPIC_API_KEY": CANARY,
        "ANTHROPIC_BASE_URL": "http://x",
        "AWS_SECRET_ACCESS_KEY": "aws",
        "LD_PRELOAD": "/evil.so",
    }
    env = tool_environment(environ, task.id, "/ws")
    assert env == {
        "PATH": "/bin",
        "HOME": "/var/lib/agentd",
        "AGENTD_TASK": "env",
        "AGENTD_WORKSPACE": "/ws",
    }


def test_worker_scrubs_the_api_key_from_commands(tmp_path: Path) -> None:
    """A canary key in the worker's environment is invisible to run_command."""
    spool = make_spool(tmp_path)
    task = scripted_task(
        spool,
        [
            reply(
                tool_use(
                    "run_command",
                    command="env > env.txt; echo key=[$ANTHROPIC_API_KEY]",
                    timeout=10,
                )
            ),
            reply({"type": "text", "text": "done"}),
        ],
        name="canary",
    )
    assert run_worker(task, env={"ANTHROPIC_API_KEY": CANARY}) == ExitCode.DONE
    (result,) = of_kind(journal_records(task), "result")
    assert "key=[]" in result["content"]
    workspace = task.path / "workspace"
    env_seen = (workspace / "env.txt").read_text()
    assert "ANTHROPIC" not in env_seen
    assert "AGENTD_TASK=canary" in env_seen
    for path in task.path.rglob("*"):
        if path.is_file():
            assert CANARY not in path.read_text(errors="replace"), path


def test_outbox_send_dedupes_by_key(workspace: Path) -> None:
    first = ctx_for(workspace, key="agentd-aaa")
    data = {"to": "ops@example.com", "body": "hello"}
    assert outbox_send.reconcile is not None
    assert outbox_send.reconcile(first, data) is None  # not delivered yet
    assert outbox_send.run(first, data) == "delivered to ops@example.com (key agentd-aaa)"
    again = outbox_send.run(first, data)
    assert again == "delivered to ops@example.com (key agentd-aaa, duplicate suppressed)"
    answer = outbox_send.reconcile(first, data)
    assert answer is not None
    assert "agentd-aaa" in answer
    assert "already recorded" in answer
    entries = sorted(os.listdir(workspace / "outbox"))
    assert entries == ["agentd-aaa.json"]
    assert json.loads((workspace / "outbox" / entries[0]).read_text()) == {
        **data,
        "key": "agentd-aaa",
    }
    second = ctx_for(workspace, key="agentd-bbb")
    assert outbox_send.reconcile(second, data) is None
    assert "duplicate" not in outbox_send.run(second, data)
    assert len(os.listdir(workspace / "outbox")) == 2


# -- the registry -----------------------------------------------------------------------


def test_user_tool_module_is_loaded() -> None:
    registry = ToolRegistry.standard(["tests.tools_fixture"])
    names = registry.names()
    assert {t.name for t in BUILTIN_TOOLS} <= set(names)
    assert {"shout", "explode", "fixture_refuse"} <= set(names)
    assert "NOT_A_TOOL" not in names
    shout = registry.get("shout")
    assert shout is not None
    assert shout.effect is Effect.IDEMPOTENT
    assert shout.run(ctx_for(Path()), shout.check_input({"text": "hi", "times": 2})) == "HI HI"
    narrowed = registry.narrowed(["shout", "read_file"])
    assert narrowed.names() == ["shout", "read_file"]
    assert registry.narrowed(None) is registry


def test_unknown_tool_names_are_refused() -> None:
    with pytest.raises(TaskSpecError, match="unknown tool"):
        ToolRegistry.standard().narrowed(["read_file", "teleport"])


def test_unknown_module_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"tools\.modules\[0\]: cannot import 'no_such_agentd_tools'"
    ):
        ToolRegistry.standard(["no_such_agentd_tools"])


def test_module_that_fails_to_import_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "agentd_broken_tools.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="RuntimeError: half-written") as info:
        ToolRegistry.standard(["agentd_broken_tools"])
    assert info.value.exit_code == 78
    assert "\n" not in str(info.value)
