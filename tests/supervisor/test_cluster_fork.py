"""A fork on a shared store gets a workspace of its own beside its parent's, on the same
mount (docs/design.md section 10): a copy of the parent's files, or a work tree at the
fork's turn when the workspace is under git, at ``WORKSPACE.fork-ID``, never the parent's
folder shared; and where that folder cannot be made, the fork is refused in one line with
nothing written. Real daemon, real workers, a real PostgreSQL, a real read-only mount."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.daemon import subreaper
from tests.mounts import read_only, small_disk
from tests.supervisor.test_cluster import Node
from tests.support import poll_for, reply, text, tool_use


def _submit(node: Node, task_id: str, workspace: Path) -> None:
    """A task of two calls that each add a line to ``log.txt`` in ``workspace``."""
    script = node.daemon.root / f"{task_id}.json"
    responses = [
        reply(tool_use("run_command", "c1", command="echo one >> log.txt")),
        reply(tool_use("run_command", "c2", command="echo two >> log.txt")),
        reply(text("done")),
    ]
    script.write_text(json.dumps({"responses": responses}))
    done = node.agentd(
        "submit", "--name", task_id, "--prompt", "go", "--script", str(script),
        "--workspace", str(workspace),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def _done(node: Node, task_id: str) -> None:
    poll_for(lambda: node.row(task_id)["state"] == "done", 60, interval=0.2, what=f"{task_id} done")


def test_a_fork_on_a_shared_store_gets_its_own_workspace_beside_its_parent_s(
    tmp_path: Path, postgres_schema: str
) -> None:
    with subreaper(), small_disk(tmp_path / "mount", size_mb=16) as mount:
        a = Node(tmp_path, "a", postgres_schema)
        try:
            a.start()
            (mount / "ws").mkdir()
            _submit(a, "t1", mount / "ws")
            repo = mount / "repo"
            repo.mkdir()
            subprocess.run(["git", "init", "-q", str(repo)], check=True)
            _submit(a, "t2", repo)
            _done(a, "t1")
            _done(a, "t2")

            forked = a.agentd("fork", "t1", "--at", "1", "--name", "f1")
            assert forked.returncode == 0, forked.stderr
            own = mount / "ws.fork-f1"
            assert f"in {own}" in forked.stderr
            assert a.row("f1")["workspace"] == str(own)
            _done(a, "f1")
            assert (mount / "ws" / "log.txt").read_text() == "one\ntwo\n"  # the parent's, as it was
            assert (own / "log.txt").read_text() == "one\ntwo\ntwo\n"  # a copy, then its own call

            forked = a.agentd("fork", "t2", "--at", "1", "--name", "f2")
            assert forked.returncode == 0, forked.stderr
            tree = mount / "repo.fork-f2"
            assert "own work tree" in forked.stderr and f"at {tree}" in forked.stderr
            assert a.row("f2")["workspace"] == str(tree)
            _done(a, "f2")
            assert (tree / "log.txt").read_text() == "one\ntwo\n"  # the files after turn 1
            assert (repo / "log.txt").read_text() == "one\ntwo\n"  # the parent's untouched

            (mount / "ws.fork-f1x").mkdir()  # (as if a folder of that name were left there)
            taken = a.agentd("fork", "t1", "--at", "1", "--name", "f1x")
            assert taken.returncode == 3 and len(taken.stderr.splitlines()) == 1, taken.stderr
            assert "exists already" in taken.stderr
            with read_only(mount):
                refused = a.agentd("fork", "t1", "--at", "1", "--name", "f3")
            assert refused.returncode == 1, refused
            assert len(refused.stderr.splitlines()) == 1 and "not writable" in refused.stderr
            assert not (mount / "ws.fork-f3").exists()
            ids = [t["id"] for t in a.status()["tasks"]]
            assert "f3" not in ids and "f1x" not in ids  # nothing written
        finally:
            a.daemon.cleanup()
