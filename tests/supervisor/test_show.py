"""``agentd show``: what the model said and what each tool returned, from the journal
(supervisor/transcript.py; docs/design.md sections 2 and 16)."""

from __future__ import annotations

import io
import json
import os
import pwd
import re
from typing import Any

import pytest

from supervisor.cli import main
from supervisor.history import fork, rewind
from supervisor.status import held_calls, load_state
from supervisor.transcript import Renderer, lines, use_colour
from tests.support import (
    charge_crashing_once,
    journal_records,
    reply,
    run_to_end,
    scripted_task,
    text,
    tool_use,
)
from worker.config import Config
from worker.spool import Spool

CONFIG = Config()


def show(spool: Spool, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["--spool", str(spool.root), "show", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def three_turns() -> list[dict[str, Any]]:
    return [
        reply(text("Writing."), tool_use("write_file", path="a.txt", content="alpha")),
        reply(tool_use("read_file", path="a.txt")),
        reply(text("Done.")),
    ]


def test_show_json_gives_every_part_of_the_live_branch_in_order(
    spool: Spool, capsys: pytest.CaptureFixture[str]
) -> None:
    task = scripted_task(spool, three_turns(), name="s1", prompt="Write a.")
    assert run_to_end(task) == "done"
    code, out, _ = show(spool, "s1", "--json", capsys=capsys)
    assert code == 0
    got = [json.loads(line) for line in out.splitlines()]
    assert [(g["turn"], g["kind"]) for g in got] == [
        (0, "text"), (1, "text"), (1, "tool_use"), (1, "tool_result"),
        (2, "tool_use"), (2, "tool_result"), (3, "text"),
    ]  # fmt: skip
    assert got[0] == {"turn": 0, "kind": "text", "role": "user", "text": "Write a."}
    use, result = got[2], got[3]
    assert use["tool"] == "write_file" and use["input"] == {"path": "a.txt", "content": "alpha"}
    assert result["call_id"] == use["call_id"]
    assert (result["effect"], result["outcome"], result["is_error"]) == ("idempotent", "ran", False)
    assert got[5]["content"] == "alpha"  # what read_file returned, as recorded


def test_show_text_and_one_turn(spool: Spool, capsys: pytest.CaptureFixture[str]) -> None:
    task = scripted_task(spool, three_turns(), name="s2")
    assert run_to_end(task) == "done"
    code, out, _ = show(spool, "s2", capsys=capsys)
    assert code == 0
    # each turn's header carries its model call's cost (docs/design.md section 13)
    assert re.search(r"── turn 1  \$0\.\d{6}\nWriting\.\n→ write_file ", out), out
    assert "← read_file (read_only, ran)\n    alpha\n" in out
    assert "\033[" not in out  # not a terminal: no colour
    code, out, _ = show(spool, "s2", "--turn", "2", capsys=capsys)
    assert code == 0 and "turn 2" in out and "turn 1" not in out and "Writing." not in out
    code, out, err = show(spool, "s2", "--turn", "9", capsys=capsys)
    assert code == 3 and out == "" and "no turn 9" in err and len(err.splitlines()) == 1
    code, out, err = show(spool, "s2", "--turn", "-1", capsys=capsys)
    assert code == 2 and out == "" and "--turn -1" in err and len(err.splitlines()) == 1
    code, _, err = show(spool, "nope", capsys=capsys)
    assert code == 3 and len(err.splitlines()) == 1


def test_a_rewound_turn_is_not_shown(spool: Spool, capsys: pytest.CaptureFixture[str]) -> None:
    task = scripted_task(spool, three_turns(), name="s3")
    assert run_to_end(task) == "done"
    rewind(spool, CONFIG, task.id, 1, yes=True)
    _, out, _ = show(spool, "s3", "--json", capsys=capsys)
    assert {json.loads(line)["turn"] for line in out.splitlines()} == {0, 1}
    assert run_to_end(task) == "done"  # the new branch: turns 2 and 3 again, shown once each
    _, out, _ = show(spool, "s3", "--json", capsys=capsys)
    turns = [json.loads(line)["turn"] for line in out.splitlines()]
    assert turns == [0, 1, 1, 1, 2, 2, 3]
    assert len([r for r in journal_records(task) if r["k"] == "turn"]) == 5  # all kept


def test_a_hold_and_its_decision_are_shown_with_the_result(
    spool: Spool, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = charge_crashing_once()
    task = scripted_task(
        spool, [reply(tool_use("charge", amount=5)), reply(text("Ok."))], name="s4"
    )
    with pytest.raises(KeyboardInterrupt):
        run_to_end(task, tools=tools)
    assert run_to_end(task, tools=tools) == "held"
    _, out, _ = show(spool, "s4", "--json", capsys=capsys)
    hold = json.loads(out.splitlines()[-1])
    assert hold["kind"] == "hold" and hold["calls"][0]["tool"] == "charge"
    call_id = hold["calls"][0]["call_id"]
    assert main(["--spool", str(spool.root), "approve-dangling", "s4", call_id,
                 "--result", "charged once, checked"]) == 0  # fmt: skip
    capsys.readouterr()
    assert run_to_end(task, tools=tools) == "done"
    _, out, _ = show(spool, "s4", "--json", capsys=capsys)
    got = [json.loads(line) for line in out.splitlines()]
    kinds = [g["kind"] for g in got]
    assert kinds[-4:] == ["hold", "decision", "tool_result", "text"]
    decision, result = got[-3], got[-2]
    assert decision["action"] == "result" and decision["result"] == "charged once, checked"
    assert (result["outcome"], result["content"]) == ("operator", "charged once, checked")
    _, out, _ = show(spool, "s4", capsys=capsys)
    assert f"‖ held: charge call {call_id}" in out
    who = f"(by {pwd.getpwuid(os.getuid()).pw_name} via cli)"  # docs/design.md section 15
    assert f"✓ decided: charge call {call_id} result recorded {who}: charged once, checked" in out


def test_a_fork_shows_its_inherited_scene_then_its_own_turns(
    spool: Spool, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = scripted_task(spool, three_turns(), name="p1", prompt="Write a.")
    assert run_to_end(parent) == "done"
    fork(spool, CONFIG, "p1", 2, name="f1")
    _, out, _ = show(spool, "f1", "--json", capsys=capsys)
    got = [json.loads(line) for line in out.splitlines()]
    assert got[0] == {"turn": 0, "kind": "text", "role": "user", "text": "Write a."}
    assert [g["turn"] for g in got] == [0, 1, 1, 1, 2, 2]  # the scene after turn 2
    assert got[3]["content"].startswith("wrote")  # the inherited result, as recorded


def test_lines_of_a_compaction_and_a_cut_on_a_terminal() -> None:
    records = [
        {"k": "header", "v": 2, "task": "t"},
        {"k": "turn", "turn": 1, "message": {"content": [{"type": "text", "text": "x" * 5000}]}},
        {"k": "compaction", "keep": 0, "first": 1, "last": 1, "summary": "Goal: x.\nNext: y.",
         "tokens_before": 900, "tokens_after": 40},
    ]  # fmt: skip
    got = lines(records, prompt="p")
    assert got[-1] == {
        "turn": 1, "kind": "compaction", "first": 1, "last": 1,
        "tokens_before": 900, "tokens_after": 40, "summary": "Goal: x.\nNext: y.",
    }  # fmt: skip
    out = io.StringIO()
    renderer = Renderer(out)
    for line in got:
        renderer.line(line)
    shown = out.getvalue()
    assert "x" * 2000 + "\n… (3000 more characters: --json shows everything)" in shown
    assert "⋯ compacted turns 1 to 1 (900 → 40 tokens)\n    Goal: x.\n    Next: y." in shown
    painted = io.StringIO()
    Renderer(painted, colour=True).line(got[0])
    assert painted.getvalue().startswith("\033[1m── prompt\033[0m")


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            monkeypatch.delenv("NO_COLOR", raising=False)
            assert use_colour(tty)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not use_colour(tty)
        assert not use_colour(io.StringIO())
    finally:
        os.close(leader)
        os.close(follower)


def test_held_calls_of_a_long_task_read_from_its_snapshot_match_the_full_fold(
    spool: Spool,
) -> None:
    """``held_calls`` starts from the snapshot (it costs the records after it, not the
    task's history) and finds what a fold of the whole journal finds."""
    script = [reply(tool_use("read_file", path=f"{n}.txt")) for n in range(30)]
    script += [reply(tool_use("charge", amount=5)), reply(text("Ok."))]
    task = scripted_task(spool, script, name="long")
    tools = charge_crashing_once()
    with pytest.raises(KeyboardInterrupt):
        run_to_end(task, tools=tools, snapshot_every=10)
    assert run_to_end(task, tools=tools, snapshot_every=10) == "held"
    assert task.snapshot.exists()
    snapshot, _ = load_state(task, full=False), load_state(task)
    assert snapshot.boundaries is None  # it did start from the snapshot
    held = held_calls(task)
    assert [row["tool"] for row in held] == ["charge"]
    assert held == held_calls(task, load_state(task))


def test_show_redacts_what_looks_like_a_secret(
    spool: Spool, capsys: pytest.CaptureFixture[str]
) -> None:
    """The journal keeps what the model wrote; ``show`` (and the console, on the same
    lines) never prints a secret of it: a key-shaped string, a secret-named field."""
    key = "sk-ant-api03-written-by-the-model-0123456789"
    task = scripted_task(
        spool,
        [
            reply(text(f"My key is {key}."), tool_use("write_file", path="k.txt", content=key)),
            reply(text("Basic idea: done.")),
        ],
        name="leaky",
    )
    assert run_to_end(task) == "done"
    code, out, _ = show(spool, "leaky", "--json", capsys=capsys)
    assert code == 0 and key not in out and "[redacted]" in out
    assert "Basic idea: done." in out  # prose stays prose
    code, out, _ = show(spool, "leaky", capsys=capsys)
    assert key not in out
