"""Finding tasks among many (docs/design.md section 20): filters, orders and pages that
neither skip nor repeat a row, as ``agentd status`` and ``GET /api/tasks`` give them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.selection import SORTS, Selection
from tests.support import reply, text, worker_env
from worker.errors import UsageError
from worker.protocol import TaskStatus

REPO = Path(__file__).resolve().parents[2]
STATES = [str(s) for s in TaskStatus]

rows_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "state": st.sampled_from(STATES),
            "created_at": st.sampled_from(
                ["2026-12-01T10:00:00.000Z", "2026-12-02T10:00:00.000Z", "", None]
            ),
            "reason": st.sampled_from([None, "end_turn", "crash_loop", "budget: $1 of $1"]),
        }
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    rows=rows_strategy,
    sort=st.sampled_from(sorted(SORTS)),
    limit=st.integers(1, 7),
    states=st.sets(st.sampled_from(STATES), max_size=3),
)
def test_pages_cover_the_selection_once_in_order(
    rows: list[dict[str, Any]], sort: str, limit: int, states: set[str]
) -> None:
    rows = [{**r, "id": f"t{i:03d}"} for i, r in enumerate(rows)]
    whole = Selection.parse(states=",".join(states), sort=sort)
    expected, none = whole.apply(rows)
    assert none is None
    assert all(not states or r["state"] in states for r in expected)
    seen: list[Any] = []
    after = None
    for _ in range(len(rows) + 2):
        page, after = Selection.parse(
            states=",".join(states), sort=sort, limit=limit, after=after
        ).apply(rows)
        assert len(page) <= limit
        seen += page
        if after is None:
            break
    assert [r["id"] for r in seen] == [r["id"] for r in expected]  # no gap, no repeat


def test_state_order_puts_held_first_and_the_latest_change_first_within() -> None:
    rows = [
        {"id": "a", "state": "done", "created_at": "2026-12-03T00:00:00Z"},
        {
            "id": "b",
            "state": "held",
            "created_at": "2026-12-01T00:00:00Z",
            "updated_at": "2026-12-05T00:00:00Z",
        },
        {
            "id": "c",
            "state": "held",
            "created_at": "2026-12-02T00:00:00Z",
            "updated_at": "2026-12-06T00:00:00Z",
        },
        {"id": "d", "state": "running", "created_at": "2026-12-04T00:00:00Z"},
        {
            "id": "e",
            "state": "failed",
            "created_at": "2026-12-04T00:00:00Z",
            "reason": "crash_loop",
        },
    ]
    ordered, _ = Selection.parse(sort="state").apply(rows)
    assert [r["id"] for r in ordered] == ["c", "b", "e", "d", "a"]  # the latest change first
    found, _ = Selection.parse(text="CRASH").apply(rows)
    assert [r["id"] for r in found] == ["e"]
    newest, _ = Selection.parse(sort="age").apply(rows)
    assert [r["id"] for r in newest][:2] == ["d", "e"]


@pytest.mark.parametrize(
    "asked",
    [
        {"states": "sleeping"},
        {"sort": "size"},
        {"limit": "0"},
        {"limit": "many"},
        {"after": "not-a-cursor!"},
    ],
)
def test_what_cannot_be_a_selection_is_a_usage_error(asked: dict[str, str]) -> None:
    with pytest.raises(UsageError):
        Selection.parse(**asked)


def agentd(spool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "--spool", str(spool), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=worker_env({"AGENTD_CONFIG": ""}),
        timeout=60,
        check=False,
    )


@pytest.mark.process
def test_status_filters_sorts_and_pages_on_the_command_line(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"responses": [reply(text("Done."))]}))
    for name in ("q1", "q2", "c1"):
        assert (
            agentd(
                spool, "submit", "--name", name, "--prompt", "x", "--script", str(script)
            ).returncode
            == 0
        )
    assert agentd(spool, "cancel", "c1").returncode == 0
    assert (
        agentd(spool, "run", "--name", "d1", "--prompt", "x", "--script", str(script)).returncode
        == 0
    )
    done = agentd(spool, "status", "--json", "--state", "queued,cancelled", "--sort", "state")
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in json.loads(done.stdout)["tasks"]]
    assert ids[-1] == "c1" and sorted(ids[:2]) == ["q1", "q2"]
    seen, after = [], None
    while True:
        page = agentd(
            spool, "status", "--json", "--limit", "1", *(("--after", after) if after else ())
        )
        doc = json.loads(page.stdout)
        seen += [r["id"] for r in doc["tasks"]]
        after = doc["next"]
        if after is None:
            break
    assert seen == ["c1", "d1", "q1", "q2"]
    table = agentd(spool, "status", "--state", "done")
    assert "d1" in table.stdout and "q1" not in table.stdout
    assert agentd(spool, "status", "--sort", "size").returncode == 2
