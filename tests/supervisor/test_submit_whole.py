"""Every CLI input is checked before it touches the spool, and a task folder appears whole
or not at all: ``agentd submit`` builds it in ``SPOOL/tmp/.submit-XXXX`` and moves it into
``SPOOL/tasks`` in one step (``worker.store.durable.move_exclusive``), so of two submits
of one name exactly one succeeds, and no reader ever sees a folder without its spec."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from supervisor.submit import submit
from tests.support import REPO, worker_env
from worker.config import Config
from worker.errors import StateConflictError
from worker.spool import Spool, TaskSpec
from worker.store.durable import move_exclusive
from worker.store.files import FileStore

SCRIPT = b'{"responses": [{"content": [{"type": "text", "text": "Done."}]}]}'


def agentd(spool: Path, *args: str | bytes) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", "--spool", str(spool), *args],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


def test_two_submits_of_one_name_never_both_succeed_and_no_folder_is_seen_half_made(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    script = tmp_path / "script.json"
    script.write_bytes(SCRIPT)
    half_made: set[str] = set()
    done = threading.Event()

    def watch() -> None:  # what `status` or a daemon would read meanwhile
        while not done.is_set():
            for task_id in spool.task_ids():
                if not spool.task(task_id).exists():
                    half_made.add(task_id)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for round_ in range(4):
            name = f"x{round_}"
            procs = [
                agentd(
                    spool.root, "submit", "--name", name, "--prompt", "p", "--script", str(script)
                )
                for _ in range(6)
            ]
            errors = [p.communicate(timeout=120)[1] for p in procs]
            results = [(p.returncode, err) for p, err in zip(procs, errors, strict=True)]
            won = [code for code, _ in results if code == 0]
            assert len(won) == 1, results
            for code, err in results:
                if code:
                    assert code == 3 and b"already exists" in err and err.count(b"\n") == 1
            assert spool.task(name).load_spec().id == name
    finally:
        done.set()
        watcher.join()
    assert half_made == set()
    assert os.listdir(spool.tmp_dir) == []  # no staging folder is left behind


@pytest.mark.parametrize("option", ["--prompt", "--system"])
def test_undecodable_text_gets_one_line_exit_2_and_leaves_nothing(
    tmp_path: Path, option: str
) -> None:
    spool = tmp_path / "spool"
    (tmp_path / "script.json").write_bytes(SCRIPT)
    args: list[str | bytes] = ["submit", "--name", "t1", "--script", str(tmp_path / "script.json")]
    args += ["--prompt", "p"] if option == "--system" else []
    proc = agentd(spool, *args, option, b"caf\xe9 \xff")  # latin-1 bytes, not UTF-8
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.count(b"\n") == 1 and b"Traceback" not in err
    assert f"{option} is not UTF-8 text".encode() in err
    assert not (spool / "tasks" / "t1").exists()
    assert not (spool / "tmp").exists() or os.listdir(spool / "tmp") == []


def test_a_failed_create_leaves_no_folder(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()

    def fail(folder: Path | None) -> None:
        assert folder is not None and (folder / "state.json").exists()
        raise OSError("no room for the workspace")

    with pytest.raises(OSError, match="no room"):
        FileStore(spool.root).create(TaskSpec("t1", "p"), {"state": "queued"}, prepare=fail)
    assert spool.task_ids() == [] and os.listdir(spool.tmp_dir) == []
    submit(spool, Config(), prompt="p", name="t1")  # the name is still free
    with pytest.raises(StateConflictError, match="already exists"):
        submit(spool, Config(), prompt="p", name="t1")


def test_an_empty_leftover_folder_gives_way_but_a_full_one_is_named(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    (spool.tasks_dir / "empty").mkdir()
    assert submit(spool, Config(), prompt="p", name="empty").exists()
    (spool.tasks_dir / "junk").mkdir()
    (spool.tasks_dir / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(StateConflictError, match="is no task"):
        submit(spool, Config(), prompt="p", name="junk")
    assert (spool.tasks_dir / "junk" / "notes.txt").read_text() == "mine"


def test_move_exclusive_never_replaces(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # empty: a plain rename would replace it
    assert not move_exclusive(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a").is_dir()
    assert move_exclusive(tmp_path / "a", tmp_path / "c")
    assert not (tmp_path / "a").exists() and (tmp_path / "c").is_dir()
