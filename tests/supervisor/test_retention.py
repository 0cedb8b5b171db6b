"""Months of tasks (docs/design.md section 20): ``agentd prune``, ``archive``, ``restore``
and ``[retention]``, on real processes: what goes, what never does, archives that bring a
task back byte for byte, and a kill -9 of prune at each of its steps."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.console import free_port
from tests.daemon import Daemon, config_text
from tests.faults.common import require_strace
from tests.supervisor.test_metrics import Scraper
from tests.support import poll_for, reply, text, worker_env
from worker.spool import Spool

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]
DONE_SCRIPT = {"responses": [reply(text("Done."))]}


def agentd(
    spool: Path, *args: str, config: Path | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    argv = [*prefix, sys.executable, "-m", "supervisor", "--spool", str(spool)]
    argv += ["--config", str(config)] if config is not None else []
    return subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=worker_env({"AGENTD_CONFIG": ""} if config is None else None),
        timeout=120,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_task(root: Path, spool: Path, name: str, responses: Mapping[str, object]) -> None:
    """A task run to its end in the foreground (``agentd run``)."""
    script = root / f"{name}.json"
    script.write_text(json.dumps(responses))
    agentd(spool, "run", "--name", name, "--prompt", "Do it.", "--script", str(script))


def ended_ago(spool: Path, task: str, days: float) -> None:
    """Make the task look as if it ended ``days`` ago (its record's time)."""
    record = spool / "tasks" / task / "state.json"
    data = json.loads(record.read_text())
    stamp = datetime.now(UTC) - timedelta(days=days)
    data["updated_at"] = stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    record.write_text(json.dumps(data))


def states(spool: Path) -> dict[str, str]:
    rows = json.loads(ok(agentd(spool, "status", "--json")))["tasks"]
    return {row["id"]: row["state"] for row in rows}


@pytest.fixture
def spool(made: Path, tmp_path: Path) -> Path:
    """A copy of ``made`` for one test."""
    root = tmp_path / "spool"
    shutil.copytree(made, root, symlinks=True)
    return root


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """done d-old (40 days) and d-new (1 day), failed f-old (100 days), cancelled c-old
    (10 days), a queued q1 and a held h1."""
    tmp_path = tmp_path_factory.mktemp("made")
    root = tmp_path / "spool"
    run_task(tmp_path, root, "d-old", DONE_SCRIPT)
    run_task(tmp_path, root, "d-new", DONE_SCRIPT)
    run_task(tmp_path, root, "f-old", {"responses": []})  # runs out of script: failed
    script = tmp_path / "q.json"
    script.write_text(json.dumps(DONE_SCRIPT))
    for name in ("c-old", "q1"):
        ok(agentd(root, "submit", "--name", name, "--prompt", "x", "--script", str(script)))
    ok(agentd(root, "cancel", "c-old"))
    held = {"responses": [reply(tool_use_block("append_file", path="l.txt", content="x\n"))]}
    script.write_text(json.dumps(held))
    ok(agentd(root, "submit", "--name", "h1", "--prompt", "x", "--script", str(script)))
    data = json.loads((root / "tasks" / "h1" / "state.json").read_text() or "{}")
    (root / "tasks" / "h1" / "state.json").write_text(json.dumps({**data, "state": "held"}))
    for name, days in (("d-old", 40), ("d-new", 1), ("f-old", 100), ("c-old", 10)):
        ended_ago(root, name, days)
    ended_ago(root, "h1", 400)  # old, but held: never removed
    assert states(root) == {
        "d-old": "done",
        "d-new": "done",
        "f-old": "failed",
        "c-old": "cancelled",
        "q1": "queued",
        "h1": "held",
    }
    return root


def tool_use_block(name: str, **inputs: str) -> dict[str, object]:
    return {"type": "tool_use", "id": "toolu_1", "name": name, "input": inputs}


def test_retention_periods_remove_each_state_past_its_period_and_nothing_live(
    spool: Path, tmp_path: Path
) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text('[retention]\ndone = "30d"\nfailed = "90d"\ncancelled = "7d"\n')
    dry = ok(agentd(spool, "prune", "--dry-run", config=config))
    assert "would remove 3 tasks" in dry
    for name in ("d-old", "f-old", "c-old"):
        assert f"would remove {name} (" in dry
    assert set(states(spool)) == {"d-old", "d-new", "f-old", "c-old", "q1", "h1"}  # dry
    out = ok(agentd(spool, "prune", config=config))
    assert "removed d-old (done 40d ago; [retention] done = 30d)" in out
    assert "removed f-old (failed 100d ago; [retention] failed = 90d)" in out
    assert states(spool) == {"d-new": "done", "q1": "queued", "h1": "held"}
    assert not (spool / "tasks" / "d-old").exists() and os.listdir(spool / "removed") == []


def test_each_retention_state_alone(spool: Path, tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    for state, gone in (("cancelled", "c-old"), ("failed", "f-old"), ("done", "d-old")):
        config.write_text(f'[retention]\n{state} = "5d"\n')
        before = set(states(spool))
        ok(agentd(spool, "prune", config=config))
        assert before - set(states(spool)) == {gone}, state


def test_prune_never_means_everything_and_refuses_live_tasks(spool: Path) -> None:
    bare = agentd(spool, "prune")
    assert bare.returncode == 2 and "never means every task" in bare.stderr
    for name, state in (("q1", "queued"), ("h1", "held")):
        refused = agentd(spool, "prune", name)
        assert refused.returncode == 3 and f"task {name} is {state}" in refused.stderr
    wrong = agentd(spool, "prune", "--state", "held")
    assert wrong.returncode == 2 and "never removed" in wrong.stderr
    assert agentd(spool, "prune", "--older-than", "soon").returncode == 2
    assert len(states(spool)) == 6
    out = ok(agentd(spool, "prune", "--older-than", "20d"))
    assert "removed 2 tasks" in out  # d-old, f-old; not c-old (10 days), nor h1 (held)
    out = ok(agentd(spool, "prune", "--state", "cancelled"))
    assert "removed c-old" in out and set(states(spool)) == {"d-new", "q1", "h1"}


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.name not in ("lock", "operator.lock")
        and "workspace" not in p.relative_to(folder).parts
    }


def told(spool: Path, name: str) -> tuple[str, str]:
    """What ``history --json`` and ``show --json`` say of a task."""
    history = ok(agentd(spool, "history", name, "--json"))
    return history, ok(agentd(spool, "show", name, "--json"))


def test_archive_prune_restore_round_trip_byte_for_byte(spool: Path, tmp_path: Path) -> None:
    before = {name: digests(spool / "tasks" / name) for name in ("d-old", "f-old")}
    events = {n: (spool / "tasks" / n / "events.jsonl").read_bytes() for n in ("d-old", "f-old")}
    shown = {
        name: (
            ok(agentd(spool, "history", name, "--json")),
            ok(agentd(spool, "show", name, "--json")),
        )
        for name in ("d-old", "f-old")
    }
    archive = tmp_path / "out" / "old.tar.gz"
    tmp_path.chmod(0o755)  # a folder of the operator's: an archive never changes its mode
    out = ok(agentd(spool, "archive", "d-old", "f-old", "--to", str(archive)))
    assert oct(tmp_path.stat().st_mode & 0o777) == "0o755"
    assert oct(archive.parent.stat().st_mode & 0o777) == "0o700"  # made for it: private
    beside = tmp_path / "beside.tar.gz"
    ok(agentd(spool, "archive", "d-new", "--to", str(beside)))
    assert oct(tmp_path.stat().st_mode & 0o777) == "0o755"
    assert "archived d-old (done" in out and archive.exists()
    assert oct(archive.stat().st_mode & 0o777) == "0o600"
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile(names[0]).read())  # type: ignore[union-attr]
    assert names[0] == "manifest.json" and manifest["format"] == "agentd-archive"
    assert {t["id"] for t in manifest["tasks"]} == {"d-old", "f-old"}
    assert manifest["tasks"][0]["files"]["journal"]["sha256"] == before["d-old"]["journal"]
    assert agentd(spool, "archive", "q1", "--to", str(tmp_path / "q.tar.gz")).returncode == 3
    assert agentd(spool, "archive", "d-old", "--to", str(archive)).returncode == 3  # exists
    ok(agentd(spool, "prune", "d-old", "f-old"))
    assert set(states(spool)) == {"d-new", "c-old", "q1", "h1"}
    out = ok(agentd(spool, "restore", str(archive)))
    assert out.split() == ["restored", "d-old", "restored", "f-old"]
    for name in ("d-old", "f-old"):
        now = digests(spool / "tasks" / name)
        assert {k: v for k, v in now.items() if k != "events.jsonl"} == {
            k: v for k, v in before[name].items() if k != "events.jsonl"
        }
        # the events as archived, and one line more: the restore's own
        restored = (spool / "tasks" / name / "events.jsonl").read_bytes()
        assert restored.startswith(events[name])
        added = [json.loads(line) for line in restored[len(events[name]) :].splitlines()]
        assert [e["event"] for e in added] == ["task_restored"]
        assert added[0]["archive"] == str(archive) and added[0]["via"] == "cli"
        again = (
            ok(agentd(spool, "history", name, "--json")),
            ok(agentd(spool, "show", name, "--json")),
        )
        assert again == shown[name]
    assert states(spool)["d-old"] == "done"
    ok(agentd(spool, "fork", "d-old", "--at", "1", "--name", "d-fork", "--prompt", "more"))
    assert states(spool)["d-fork"] == "queued"
    # the same archive again: a name in use is refused, and nothing changes
    journal_of_f_old = (spool / "tasks" / "f-old" / "journal").read_bytes()
    in_use = agentd(spool, "restore", str(archive))
    assert in_use.returncode == 3 and "task d-old exists" in in_use.stderr
    assert (spool / "tasks" / "f-old" / "journal").read_bytes() == journal_of_f_old


def test_restore_refuses_a_tampered_archive_and_restores_nothing(
    spool: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "a.tar.gz"
    ok(agentd(spool, "archive", "d-old", "--to", str(archive)))
    ok(agentd(spool, "prune", "d-old"))
    tampered = tmp_path / "t.tar.gz"
    with tarfile.open(archive) as src, tarfile.open(tampered, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name.endswith("/journal"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.addfile(member, io.BytesIO(data))
    refused = agentd(spool, "restore", str(tampered))
    assert refused.returncode == 2 and "does not match its SHA-256" in refused.stderr
    assert "d-old" not in states(spool)
    assert list((spool / "tmp").iterdir()) == []  # its staging is gone


RENAMES = "rename,renameat,renameat2"
UNLINKS = "unlink,unlinkat"
#: Where prune is killed: the system calls watched, which of them, and whether the task's
#: folder was moved out of tasks/ by then.
KILL_POINTS = [
    (RENAMES, 1, False),  # the folder's move out of tasks/, killed as it starts
    (UNLINKS, 1, True),  # moved, its first file being deleted
    (UNLINKS, 4, True),  # moved, half deleted
]


@pytest.mark.parametrize(("calls", "when", "moved"), KILL_POINTS)
def test_a_kill_9_of_prune_at_each_step_leaves_the_task_whole_or_gone(
    spool: Path, tmp_path: Path, calls: str, when: int, moved: bool
) -> None:
    strace = require_strace()
    journal = (spool / "tasks" / "d-old" / "journal").read_bytes()
    prefix: tuple[str, ...] = (strace, "-qq", "-f", "-o", "/dev/null", "-e", f"trace={calls}")
    prefix += ("-e", f"inject={calls}:signal=KILL:when={when}")
    killed = agentd(spool, "prune", "d-old", prefix=prefix)
    assert killed.returncode != 0, killed.stdout
    left = states(spool)
    if moved:  # gone from tasks/ in one step; what is left waits in removed/
        assert "d-old" not in left and os.listdir(spool / "removed") != []
    else:  # whole, as it was
        assert left["d-old"] == "done"
        assert (spool / "tasks" / "d-old" / "journal").read_bytes() == journal
    # the next prune finishes what the kill left, whatever it was
    ok(agentd(spool, "prune", "--state", "done", "--older-than", "30d"))
    assert "d-old" not in states(spool)
    assert os.listdir(spool / "removed") == []


def test_the_daemon_applies_retention_at_start_and_finishes_a_cut_off_removal(
    spool: Path, tmp_path: Path
) -> None:
    port = free_port()
    retained = '[retention]\ndone = "30d"\ncancelled = "7d"\n'
    metrics = f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    daemon = Daemon(tmp_path / "d", config_text(extra=retained + metrics))
    daemon.spool = Spool(spool)
    # a removal killed after its rename: the folder waits in removed/
    half = spool / "removed" / "zz.1.2"
    half.mkdir(parents=True)
    (half / "journal").write_text("x")
    daemon.start()
    try:
        poll_for(lambda: "d-old" not in states(spool), 30, what="d-old to be removed")
        assert "c-old" not in states(spool) and not half.exists()
        assert set(states(spool)) >= {"d-new", "f-old", "q1", "h1"}
        removed = [
            json.loads(line)
            for line in daemon.log_path.read_text().splitlines()
            if '"task_removed"' in line
        ]
        assert {e.get("task") for e in removed} >= {"d-old", "c-old", "zz"}
        # a prune by the CLI while it runs: the daemon lets go of the task
        ok(agentd(spool, "prune", "d-new"))
        assert "d-new" not in states(spool)
        assert daemon.proc is not None and daemon.proc.poll() is None
        # its metrics count them, and measure the spool; status shows its size
        scraper = Scraper(daemon, port)
        scraper.wait("agentd_tasks_removed_total", lambda v: v >= 3, "the removals counted")
        assert scraper.value("agentd_spool_bytes") > 0
        sup = json.loads(ok(agentd(spool, "status", "--json")))["supervisor"]
        assert sup["spool_bytes"] > 0
        assert "; spool " in ok(agentd(spool, "status")).splitlines()[0]
    finally:
        daemon.stop()


def test_a_kill_9_of_the_daemon_mid_prune_leaves_each_task_whole_or_gone(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    run_task(tmp_path, spool, "seed", DONE_SCRIPT)
    seed = spool / "tasks" / "seed"
    names = [f"old-{n:03d}" for n in range(150)]
    for name in names:  # a hundred and fifty ended tasks, copies of one
        shutil.copytree(seed, spool / "tasks" / name)
        (spool / "tasks" / name / "spec.json").write_text(
            (seed / "spec.json").read_text().replace('"seed"', f'"{name}"')
        )
        ended_ago(spool, name, 40)
    whole = digests(seed)
    daemon = Daemon(tmp_path / "d", config_text(extra='[retention]\ndone = "30d"\n'))
    daemon.spool = Spool(spool)
    daemon.start()
    poll_for(
        lambda: not (spool / "tasks" / names[0]).exists(),
        30,
        interval=0.002,
        what="the first removal",
    )
    daemon.kill()
    left = [n for n in names if (spool / "tasks" / n).exists()]
    assert 0 < len(left) < len(names)  # killed mid-prune
    for name in left:  # each one left is whole
        assert digests(spool / "tasks" / name).keys() == whole.keys(), name
    daemon.start()
    try:
        poll_for(
            lambda: not any((spool / "tasks" / n).exists() for n in names),
            60,
            what="every old task removed",
        )
        poll_for(lambda: not any((spool / "removed").iterdir()), 30, what="removed/ emptied")
        assert (spool / "tasks" / "seed").exists()  # it ended just now: kept
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    "member",
    ["tasks/evil/../../escaped", "tasks/evil/workspace/planted", "/abs/path", "tasks/../evil/x"],
)
def test_restore_refuses_an_archive_that_names_a_path_outside_its_task(
    tmp_path: Path, member: str
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    body = b"x"
    manifest = {
        "format": "agentd-archive",
        "version": 1,
        "tasks": [
            {
                "id": "evil",
                "state": "done",
                "files": {
                    member.split("/", 2)[-1]: {
                        "sha256": hashlib.sha256(body).hexdigest(),
                        "size": 1,
                    }
                },
            }
        ],
    }
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("manifest.json", json.dumps(manifest).encode()), (member, body)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refused = agentd(spool, "restore", str(archive))
    assert refused.returncode == 2 and "not an agentd archive" in refused.stderr, refused.stderr
    assert not (tmp_path / "escaped").exists() and not (spool / "tasks" / "evil").exists()
