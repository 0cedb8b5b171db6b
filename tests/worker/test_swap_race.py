"""The file tools cannot be raced: a folder swapped for a symlink out, by a real process,
while read_file and write_file are called (the trust attack ``tests.chaos.trust.swap_race``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.trust import BWRAP
from tests.chaos.trust.swap_race import (
    CONFIG,
    CONTROL_BUDGET,
    old_read_file,
    old_write_file,
    race,
    reads,
    through_daemon,
    tools,
    writes,
)
from tests.daemon import subreaper

TRIES = 1000


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "walk"])
def test_the_swap_never_wins(tmp_path: Path, openat2: bool) -> None:
    read, write = tools(openat2=openat2)
    assert race(tmp_path / "read", read, TRIES).wins == 0, "read_file read the secret outside"
    assert race(tmp_path / "write", write, TRIES).wins == 0, "write_file replaced the file outside"


def test_the_swap_wins_against_check_then_use(tmp_path: Path) -> None:
    """The control: the old tools, the path checked by name and then opened by name."""
    assert race(tmp_path / "read", reads(old_read_file), TRIES, until_win=CONTROL_BUDGET).wins
    assert race(tmp_path / "write", writes(old_write_file), TRIES, until_win=CONTROL_BUDGET).wins


def test_the_swap_never_wins_through_a_daemon(tmp_path: Path) -> None:
    """End to end: the racer a run_command of another task, under bwrap; the victim's
    calls made by its worker; the reads aim at a .pgpass outside, the writes at the
    journal of a finished task in the spool."""
    with subreaper():
        daemon = BWRAP.daemon(tmp_path / "agentd", CONFIG)
        try:
            read, write = through_daemon(daemon, TRIES // 2)
        finally:
            daemon.cleanup()
    assert read.wins == 0, "read_file read the secret outside"
    assert write.wins == 0, "write_file replaced the finished task's journal"
    assert read.refused and read.served and write.refused and write.served, (read, write)
