"""A worker's captured output is bounded by its writer (``worker.output``): however much
its tools print, ``worker.log`` and ``worker.log.1`` stay under ``OUTPUT_LIMIT`` each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import (
    REPO,
    finish,
    make_spool,
    reply,
    scripted_task,
    start_worker,
    text,
    tool_use,
    worker_env,
)
from worker.config import Config, load_config
from worker.output import OUTPUT_LIMIT
from worker.spool import TaskDir


def start_as_the_daemon_does(task: TaskDir, config: Path) -> subprocess.Popen[bytes]:
    """``python -m worker`` with its stdout and stderr on ``worker.log`` (``spawn``)."""
    out = os.open(task.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", str(task.path), "--config", str(config)],
            cwd=REPO,
            env=worker_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    finally:
        os.close(out)


def test_a_tool_that_prints_64_mib_leaves_at_most_two_capped_files(tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\nmodules = ["tests.tools_fixture"]\n')
    spool = make_spool(tmp_path)
    responses = [
        reply(text("Talk."), tool_use("chatter", megabytes=32)),
        reply(text("Done.")),
    ]
    task = scripted_task(spool, responses, config=load_config(config))
    proc = start_as_the_daemon_does(task, config)
    assert proc.wait(timeout=120) == 0
    rotated = task.output.with_name("worker.log.1")
    assert task.output.stat().st_size <= OUTPUT_LIMIT
    assert rotated.stat().st_size <= OUTPUT_LIMIT
    assert not task.output.with_name("worker.log.2").exists()
    # the worker's last words are there, after the flood: the pipe was drained first
    assert f"task {task.id} done" in task.output.read_text()


def test_a_worker_run_by_hand_keeps_its_own_output(tmp_path: Path) -> None:
    """Only a worker whose output is its worker.log is taken over: by hand (or from a
    test that reads a pipe) it prints where it was told to."""
    task = scripted_task(make_spool(tmp_path), [reply(text("Done."))], config=Config())
    code, err = finish(start_worker(task))
    assert code == 0
    assert f"task {task.id} done" in err
    assert not task.output.exists()
