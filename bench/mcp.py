"""MCP benchmark: what an MCP server costs a task (docs/design.md section 11).

* **A call's round trip** through ``mcp-server-time``'s ``get_current_time`` (PyPI, in the
  sandbox as a worker runs it, its server up), through the tool the loop calls
  (``McpTool.result``: the SDK's ``tools/call``, the idempotency key in ``_meta``, the
  result made a tool_result), against a built-in tool call (``read_file`` of a small file:
  the floor). Medians of alternating calls.
* **A server's start, paid at its first call**: a fresh ``ToolServers`` listing
  ``mcp-server-time`` (bwrap, the interpreter, the SDK's ``initialize``, ``tools/list``),
  and apart from it the SDK's import in a worker: cold, and after the fork server's
  preload of the ``anthropic`` SDK (what a forked worker pays when the fork server does
  not preload ``mcp`` too: it does where ``[mcp.servers]`` is configured).
* **Crash-to-resumed with a server in use**: a task whose first turn called the server
  is killed (kill -9) in its next model call; the figure is the time from the new
  worker's spawn to its next turn recorded, against the same task with no server
  configured (the floor). A resumed worker starts a server only at the first call of one
  of its tools, so the two should be the same: the next step does not wait for a server
  it does not need.

Figures only; no target is judged.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from bench.report import Row
from bench.supervision import bench_run
from supervisor.submit import submit
from worker.config import load_config
from worker.mcp.servers import Placement, ToolServers
from worker.mcp.tools import McpTool, _never_called
from worker.spool import Spool, TaskDir
from worker.store.journal import read_file as read_journal
from worker.tools.builtin import read_file
from worker.tools.registry import Effect, ToolContext
from worker.tools.sandbox import SandboxMode, sandbox_for

NAME = "mcp"
REPO = Path(__file__).resolve().parent.parent
#: ``mcp-server-time`` from PyPI (the dev extra), beside this interpreter.
TIME_SERVER = [str(Path(sys.executable).with_name("mcp-server-time")), "--local-timezone", "UTC"]


def write_config(path: Path, servers: dict[str, Any]) -> Path:
    path.write_text(tomli_w.dumps({"mcp": {"servers": servers}}))
    return path


def turns(task: TaskDir) -> list[str]:
    try:
        return [str(r.get("k")) for r, _ in read_journal(task.journal).records]
    except FileNotFoundError:
        return []


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTD_", "ANTHROPIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _servers(workdir: Path, workspace: Path) -> ToolServers:
    config = load_config(write_config(workdir / "agentd.toml", {"time": {"command": TIME_SERVER}}))
    sandbox = sandbox_for(SandboxMode.AUTO, True, spool=workdir / "spool", config=None)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workspace)}
    return ToolServers(config.mcp.servers, Placement(workspace, env, sandbox, grace=2.0))


def round_trip(workdir: Path, runs: int) -> list[Row]:
    workspace = workdir / "workspace"
    workspace.mkdir()
    (workspace / "a.txt").write_text("a small file")
    servers = _servers(workdir, workspace)
    try:
        servers.listing("time")
        tool = McpTool(
            name="mcp__time__get_current_time",
            description="",
            effect=Effect.READ_ONLY,
            input_schema={"type": "object"},
            func=_never_called,
            server="time",
            remote="get_current_time",
            servers=servers,
        )
        ctx = ToolContext(workspace, "t1", "toolu_1", "agentd-bench-key", 60.0)
        mcp_ms, builtin_ms = [], []
        for _ in range(runs + 3):
            t0 = time.perf_counter()
            result = tool.result(ctx, {"timezone": "UTC"})
            t1 = time.perf_counter()
            read_file.run(ctx, {"path": "a.txt"})
            t2 = time.perf_counter()
            if result.is_error:
                raise RuntimeError(f"get_current_time failed: {result.content!r}")
            mcp_ms.append((t1 - t0) * 1000)
            builtin_ms.append((t2 - t1) * 1000)
        mcp, floor = statistics.median(mcp_ms[3:]), statistics.median(builtin_ms[3:])
    finally:
        servers.close()
    return [
        Row(
            NAME,
            f"a call of mcp-server-time get_current_time, median of {runs} (floor: read_file)",
            "ms",
            mcp,
            floor=floor,
            note=f"an MCP call's round trip: {mcp:.2f} ms; a built-in tool call: {floor:.3f} ms",
        )
    ]


def start_cost(workdir: Path, runs: int) -> list[Row]:
    workspace = workdir / "start"
    workspace.mkdir()
    starts = []
    for _ in range(runs):
        servers = _servers(workdir, workspace)
        try:
            t0 = time.perf_counter()
            servers.listing("time")
            starts.append((time.perf_counter() - t0) * 1000)
        finally:
            servers.close()
    cold = _import_ms("", runs)
    warm = _import_ms("import anthropic, worker.__main__, worker.models.messages_api", runs)
    return [
        Row(
            NAME,
            f"a server's start at its first call (mcp-server-time started, listed), "
            f"median of {runs}",
            "ms",
            statistics.median(starts[1:] or starts),
            compare=False,
            note="a server's start (bwrap, its interpreter, initialize, tools/list) is paid "
            "once per worker, at the first call of one of its tools",
        ),
        Row(NAME, "the mcp SDK's import in a fresh worker (cold)", "ms", cold, compare=False),
        Row(
            NAME,
            "the mcp SDK's import after the fork server's anthropic preload",
            "ms",
            warm,
            compare=False,
            note="what the fork server saves each worker that starts a server, when "
            "[mcp.servers] is configured and it preloads mcp too",
        ),
    ]


def _import_ms(before: str, runs: int) -> float:
    """The median, over ``runs`` fresh interpreters, of ``import worker.mcp.session``
    after ``before`` (imports not timed)."""
    code = (
        f"{before}\nimport time\nt = time.perf_counter()\nimport worker.mcp.session\n"
        "print((time.perf_counter() - t) * 1000)"
    )
    times = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        )
        times.append(float(done.stdout.strip()))
    return statistics.median(times)


def crash_to_resumed(workdir: Path, runs: int) -> list[Row]:
    """Spawn to the next turn recorded after a kill -9 in a model call, with and without a
    server the task used (and its next step does not)."""
    figures: dict[bool, list[float]] = {True: [], False: []}
    for i in range(runs):
        for with_server in (True, False):
            figures[with_server].append(_resume_ms(workdir / f"r{i}-{with_server}", with_server))
    agentd, floor = statistics.median(figures[True]), statistics.median(figures[False])
    return [
        Row(
            NAME,
            f"crash-to-resumed with a server in use, median of {runs} (floor: no server)",
            "ms",
            agentd,
            floor=floor,
            note="a resumed worker starts a server only at the first call of one of its tools: "
            f"{agentd - floor:+.0f} ms against a task without one",
        )
    ]


def _resume_ms(root: Path, with_server: bool) -> float:
    root.mkdir(parents=True)
    servers = {"time": {"command": TIME_SERVER}} if with_server else {}
    config_path = write_config(root / "agentd.toml", servers)
    spool = Spool(root / "spool").ensure()
    first = (
        {
            "content": [
                {
                    "type": "tool_use",
                    "id": "c1",
                    "name": "mcp__time__get_current_time",
                    "input": {"timezone": "UTC"},
                }
            ]
        }
        if with_server
        else {"content": [{"type": "tool_use", "id": "c1", "name": "list_dir", "input": {}}]}
    )
    slow = {"content": [{"type": "text", "text": "done"}], "delay": 60}
    script = root / "script.json"
    script.write_text(json.dumps({"responses": [first, slow]}))
    tools = ["mcp__time__*", "list_dir"] if with_server else ["list_dir"]
    task = submit(spool, load_config(config_path), prompt="go", script=script, tools=tools)
    argv = [sys.executable, "-m", "worker", str(task.path), "--config", str(config_path)]

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            cwd=REPO,
            env=worker_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    proc = spawn()
    _until(lambda: "result" in turns(task), proc)
    time.sleep(0.3)  # in the model call of turn 2 (its reply takes 60 s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    task.script.write_text(json.dumps({"responses": [first, {**slow, "delay": 0}]}))
    started = time.perf_counter()
    proc = spawn()
    try:
        _until(lambda: turns(task).count("turn") >= 2, proc)
        return (time.perf_counter() - started) * 1000
    finally:
        proc.wait(timeout=60)


def _until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or (proc.poll() is not None and not ready()):
            raise RuntimeError("the worker did not get there")
        time.sleep(0.005)


def run(quick: bool) -> list[Row]:
    calls, starts, resumes = (20, 2, 1) if quick else (200, 10, 10)

    def measure(workdir: Path) -> list[Row]:
        return [
            *round_trip(workdir, calls),
            *start_cost(workdir, starts),
            *crash_to_resumed(workdir, resumes),
        ]

    return bench_run(NAME, quick, measure)
