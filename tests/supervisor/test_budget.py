"""Budgets under a real daemon (docs/design.md section 13): a task with a $1.00 budget at
$0.45 a turn, its worker killed with kill -9 on the way, is held at turn 3 ($1.35) with
the hook, the event, the status and the metrics saying so; ``approve-dangling`` points at
``agentd budget``, a budget below the spend is refused, and a raise resumes the task,
whose ``cost_usd`` is exact at the end (every call counted once across the kill), and
whose trace, in a real OTLP receiver, is one across the kill, the hold and the raise
(section 14)."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from supervisor.budgets import change_budget
from supervisor.history import fork, rewind
from supervisor.status import status_row
from tests.daemon import Daemon, config_text
from tests.otlp import OTLPReceiver, Received
from tests.supervisor.test_metrics import free_port
from tests.support import (
    journal_records,
    make_loop,
    make_spool,
    of_kind,
    poll_for,
    reply,
    scripted_task,
    text,
    tool_use,
)
from worker.budget import Budget, cost
from worker.config import Config, load_config
from worker.spans import identity, trace_id
from worker.spool import TaskDir
from worker.state import fold

pytestmark = pytest.mark.usefixtures("subreaper")

#: $3 in, $15 out per million (the Sonnet 4 family): 100,000 in and 10,000 out is $0.45.
MODEL = "claude-sonnet-4-6"
TURN_USAGE = {"input_tokens": 100_000, "output_tokens": 10_000}
#: The receiver is on this machine: never through a proxy the environment names.
LOCAL = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
RECORD_HOOK = "import json, sys; json.dump(json.load(sys.stdin), open(sys.argv[1], 'w'))"


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as collector:
        yield collector


@pytest.fixture
def daemon(tmp_path: Path, receiver: OTLPReceiver) -> Iterator[Daemon]:
    port = free_port()
    hook = json.dumps([sys.executable, "-c", RECORD_HOOK, str(tmp_path / "held.json")])
    extra = (
        f'[model]\nname = "{MODEL}"\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
        f"[hooks]\non_held = {hook}\n"
        f'[telemetry]\notlp_endpoint = "{receiver.endpoint}"\n'
    )
    made = Daemon(tmp_path / "d", config_text(extra=extra))
    try:
        yield made
    finally:
        made.cleanup()


def turns() -> list[dict[str, Any]]:
    """Five turns of $0.45: the second one's tool stalls (once), so a kill -9 finds it."""
    calls = [reply(text(f"step {n}"), tool_use("list_dir"), usage=TURN_USAGE) for n in range(1, 5)]
    calls[1] = reply(tool_use("stall", seconds=60, once="stalled"), usage=TURN_USAGE)
    return [*calls, reply(text("Done."), usage=TURN_USAGE)]


def metrics(daemon: Daemon) -> str:
    address = daemon.config.metrics.address
    assert address is not None
    port = address[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_a_dollar_budget_holds_at_turn_3_across_a_kill_and_a_raise_resumes_it(
    daemon: Daemon, receiver: OTLPReceiver, tmp_path: Path
) -> None:
    daemon.start(LOCAL)
    daemon.submit(turns(), name="paid", budget=Budget(usd=1.0))
    row = daemon.wait_row("paid", lambda r: r["phase"] == "tool:stall", what="the stall")
    os.kill(row["pid"], signal.SIGKILL)  # turn 2 recorded, its (idempotent) call dangling
    held = daemon.wait_state("paid", "held", timeout=120)
    assert held["reason"] == "budget: $1.35 of $1.00"
    assert held["dangling"] == [] and held["turn"] == 3
    assert held["cost_usd"] == 1.35 and held["budget"] == {"usd": 1.0, "tokens": None}
    assert held["restarts"] >= 1

    hook = poll_for(lambda: _read_json(tmp_path / "held.json"), 20, what="the on_held hook")
    assert hook["reason"] == "budget: $1.35 of $1.00" and hook["dangling"] == []
    # told apart from a held call without reading the reason
    assert (hook["kind"], hook["event"]) == ("budget", "budget_exhausted")
    exhausted = poll_for(
        lambda: [e for e in daemon.log_events() if e.get("event") == "budget_exhausted"],
        20,
        what="budget_exhausted in the daemon's log",
    )
    assert exhausted[0]["level"] == "warning" and exhausted[0]["task"] == "paid"
    scrape = metrics(daemon)
    assert 'agentd_tasks{state="held"} 1.0' in scrape
    assert "agentd_dangling_held 0.0" in scrape

    code, out, _ = daemon.cli("dangling", "paid", "--json")
    assert code == 0 and json.loads(out) == []
    code, _, err = daemon.cli("approve-dangling", "paid", "--all")
    assert code == 3 and "agentd budget paid" in err and len(err.splitlines()) == 1
    code, _, err = daemon.cli("budget", "paid", "--usd", "1.30")
    assert code == 3 and "below the $1.35 spent" in err
    code, _, err = daemon.cli("budget", "paid")
    assert code == 2 and "--usd" in err
    assert daemon.row("paid")["state"] == "held"  # refused: nothing changed

    code, out, err = daemon.cli("budget", "paid", "--usd", "3")
    assert code == 0, err
    assert "budget $3.00" in out and "spent $1.350000" in out and "resumed" in out
    done = daemon.wait_state("paid", "done", timeout=120)
    assert done["budget"] == {"usd": 3.0, "tokens": None}
    # every call counted once across the kill: five calls of $0.45, exactly
    assert done["cost_usd"] == 2.25
    state = fold("", journal_records(daemon.task("paid")))
    assert cost(state.spend_total, load_config(daemon.config_path).price_table) == Decimal("2.25")
    assert len(of_kind(journal_records(daemon.task("paid")), "turn")) == 5
    (changed,) = daemon.events("paid", "budget_changed")
    assert changed["via"] == "cli" and changed["by"] and changed["budget"]["usd"] == 3.0
    code, out, _ = daemon.cli("history", "paid", "--json")
    assert sum(row["cost_usd"] for row in json.loads(out)) == pytest.approx(2.25)
    code, out, _ = daemon.cli("show", "paid", "--json")
    shown = [json.loads(line) for line in out.splitlines()]
    assert sum(line.get("cost_usd") or 0 for line in shown) == pytest.approx(2.25)
    assert [line["budget"] for line in shown if line["kind"] == "hold"] == [
        "budget: $1.35 of $1.00"
    ]
    code, out, _ = daemon.cli("status", "paid")
    assert "$2.25" in out

    # one trace across the kill, the hold and the raise: a run killed in turn 2's tool
    # (ended in error), the run that held at turn 3, the run the raise resumed; five calls
    spec = daemon.task("paid").load_spec()
    trace = trace_id(identity("paid", spec.created_at))

    def whole() -> list[Received] | None:
        spans = [s for s in receiver.received() if s.trace_id == trace]
        chats = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
        runs = [s for s in spans if s.name == "invoke_agent paid"]
        return spans if len(chats) >= 5 and len(runs) >= 3 else None

    spans = poll_for(whole, 60, what="the task's spans in the receiver")
    runs = sorted((s for s in spans if s.name == "invoke_agent paid"), key=lambda s: s.start)
    assert len(runs) == 3 and runs[0].status == 2 and "SIGKILL" in runs[0].description
    assert runs[0].end <= runs[1].start and runs[1].end <= runs[2].start
    assert runs[2].attributes["agentd.outcome"] == "done"
    chats = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(chats) == 5 and {c.parent for c in chats} <= {r.span_id for r in runs}


def test_budget_options_at_submit_and_their_refusals(daemon: Daemon) -> None:
    """``submit --budget-usd/--budget-tokens`` (``none`` overrides ``[budget]``), and a USD
    budget for a model without a price: exit 78, nothing made."""
    script = daemon.root / "script.json"
    script.write_text(json.dumps({"responses": [reply(text("Done."))]}))
    code, _, err = daemon.cli(
        "submit", "--prompt", "p", "--script", str(script), "--name", "b1",
        "--budget-usd", "2.5", "--budget-tokens", "none",
    )  # fmt: skip
    assert code == 0, err
    assert daemon.row("b1")["budget"] == {"usd": 2.5, "tokens": None}
    code, _, err = daemon.cli(
        "submit", "--prompt", "p", "--model", "my-proxy-model", "--budget-usd", "1"
    )
    assert code == 78 and '[prices."my-proxy-model"]' in err
    code, _, err = daemon.cli("submit", "--prompt", "p", "--budget-tokens", "many")
    assert code == 2 and "--budget-tokens" in err
    code, _, err = daemon.cli("budget", "b1", "--tokens", "1000")
    assert code == 0, err
    assert daemon.row("b1")["budget"] == {"usd": 2.5, "tokens": 1000}
    code, _, err = daemon.cli("budget", "b1", "--usd", "none")
    assert code == 0 and daemon.row("b1")["budget"] == {"usd": None, "tokens": 1000}
    code, _, err = daemon.cli("budget", "nope", "--usd", "1")
    assert code == 3


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_rewind_keeps_the_spend_and_a_fork_starts_with_its_parents_to_the_fork_point(
    tmp_path: Path,
) -> None:
    """Spend is the whole life: a rewind gives nothing back; a fork's cost_usd is its
    parent's branch up to the fork point, and its budget its parent's at the fork."""
    spool = make_spool(tmp_path)
    config = load_config(_config_file(tmp_path))
    paid = [reply(text(f"step {n}"), tool_use("list_dir"), usage=TURN_USAGE) for n in (1, 2)]
    task = scripted_task(
        spool, [*paid, reply(text("Done."), usage=TURN_USAGE)], config=config,
        budget=Budget(usd=5.0), name="p1",
    )  # fmt: skip
    _run(task, config)
    assert status_row(task, config.price_table)["cost_usd"] == 1.35
    change_budget(spool, config, task.id, usd=7.5)
    child = fork(spool, config, task.id, 2, name="c1")
    row = status_row(spool.task(child.task), config.price_table)
    assert row["cost_usd"] == 0.9  # the parent's two calls up to the fork point
    assert row["budget"] == {"usd": 7.5, "tokens": None}
    rewind(spool, config, task.id, 1, yes=True)
    assert status_row(task, config.price_table)["cost_usd"] == 1.35  # nothing given back


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "agentd.toml"
    path.write_text(f'[model]\nname = "{MODEL}"\n')
    return path


def _run(task: TaskDir, config: Config) -> None:
    loop = make_loop(task, config=config)
    try:
        assert loop.run().state == "done"
    finally:
        loop.close()
