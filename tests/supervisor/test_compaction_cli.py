"""Compaction as an operator sees it, on a real daemon and the real CLI: history rows,
status --json, logs, and rewind and fork across a compaction."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.daemon import Daemon, config_text
from tests.supervisor.test_metrics import Scraper, free_port
from tests.support import assert_paired, journal_records, of_kind, poll_for
from tests.worker.test_compaction import compacting_script
from worker.state import fold

pytestmark = pytest.mark.usefixtures("subreaper")

CONTEXT = "[model]\nmax_tokens = 50\n[context]\nwindow = 200\ncompact_at = 0.5\nkeep_turns = 1\n"
PORT = free_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    metrics = f'[metrics]\nlisten = "127.0.0.1:{PORT}"\n'
    daemon = Daemon(tmp_path_factory.mktemp("compaction"), config_text(extra=CONTEXT + metrics))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def finished(daemon: Daemon, name: str) -> None:
    daemon.submit(compacting_script()["responses"], name=name)
    daemon.wait_state(name, "done")


def status(daemon: Daemon, name: str) -> dict[str, object]:
    code, out, err = daemon.cli("status", name, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["tasks"]
    assert isinstance(row, dict)
    return row


def test_history_status_and_logs_show_the_compactions(daemon: Daemon) -> None:
    finished(daemon, "shown")

    code, out, _ = daemon.cli("history", "shown")
    assert code == 0
    rows = [line for line in out.splitlines() if "compacted" in line]
    assert len(rows) == 2
    assert rows[0].split()[0] == "4" and "120>" in rows[0]
    assert "compacted turns 1-3: Compaction 1: a summary of turns 1 to 3" in rows[0]
    assert rows[1].split()[0] == "8" and "compacted turns 4-7: Compaction 2" in rows[1]
    code, out, _ = daemon.cli("history", "shown", "--json")
    made = [r for r in json.loads(out) if r["kind"] == "compaction"]
    assert [(r["turn"], r["first"], r["last"], r["tokens_before"]) for r in made] == [
        (4, 1, 3, 120),
        (8, 4, 7, 110),
    ]

    doc = status(daemon, "shown")
    assert doc["compactions"] == 2
    # the last turn's usage: without a scripted one, the request's size over 4, and 5 out
    last = of_kind(journal_records(daemon.task("shown")), "turn")[-1]["usage"]
    assert doc["tokens_used"] == last["input_tokens"] + last["output_tokens"]
    assert last["output_tokens"] == 5 and last["input_tokens"] > 100

    code, out, _ = daemon.cli("logs", "shown")
    compactions = [line for line in out.splitlines() if " compaction " in line]
    assert len(compactions) == 2 and "tokens_before=120" in compactions[0]

    scraper = Scraper(daemon, PORT)
    scraper.wait("agentd_compactions_total", lambda n: n >= 2, "the relayed compactions")


def test_rewind_before_a_compaction_restores_the_full_transcript_and_compacts_again(
    daemon: Daemon,
) -> None:
    finished(daemon, "back")
    code, _, err = daemon.cli("rewind", "back", "--to", "2", "--yes")
    assert code == 0, err
    # the daemon requeues the task: it was done before the rewind, and is once more after
    poll_for(
        lambda: len(of_kind(journal_records(daemon.task("back")), "end")) == 2,
        timeout=20,
        what="the new branch's end",
    )
    daemon.wait_state("back", "done")

    records = journal_records(daemon.task("back"))
    at = next(i for i, r in enumerate(records) if r["k"] == "rewind")
    prompt = daemon.task("back").load_spec().prompt
    rewound = fold(prompt, records[: at + 1])
    third = next(i for i, r in enumerate(records) if r["k"] == "turn" and r["turn"] == 3)
    assert rewound.messages == fold(prompt, records[:third]).messages  # as it was then
    assert len(rewound.messages) == 5  # prompt and two whole turns: nothing compacted
    assert_paired(rewound.messages)
    assert status(daemon, "back")["compactions"] == 2  # the new branch compacted again
    assert len(of_kind(records, "compaction")) == 4  # and the journal kept all of them
    code, out, _ = daemon.cli("history", "back")
    assert sum(" x " in line and "compacted" in line for line in out.splitlines()) == 2


def test_fork_before_a_compaction_starts_from_the_full_transcript(daemon: Daemon) -> None:
    finished(daemon, "parent")
    code, _, err = daemon.cli("fork", "parent", "--at", "3", "--name", "child")
    assert code == 0, err
    daemon.wait_state("child", "done")

    (base, *_) = journal_records(daemon.task("child"))[1:]
    assert base["k"] == "base"
    assert len(base["scene"]["messages"]) == 7  # prompt and three whole turns
    assert all(c["rewound"] for c in base["scene"]["compactions"])
    assert status(daemon, "child")["compactions"] == 2
