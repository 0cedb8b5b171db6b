"""Output flood: a tool prints without end, and a process it leaves behind holds its pipe.

A task's ``run_command`` is ``sleep HOLD & head -c 1G /dev/zero;
echo flooded``: a gigabyte of output, and a background process that keeps the command's
output open long after its shell has exited. Before the defence the worker spooled each
command's output to a file in its temp folder (the host's ``/tmp``): 1 GiB written there
whatever the 64 KiB cap on the result. Now the output comes through a pipe into a
bounded head and tail in memory, and the call returns when the shell exits, not when
the pipe is closed.

The daemon's temp folder (``TMPDIR``, which its workers inherit) is a tmpfs of
``TEMP_MB`` MiB made for the attack, so its growth is measured exactly, with no noise
from other users of the machine's ``/tmp``: sampled every ``SAMPLE`` seconds through the
call. It runs under the host's sandbox and bare (``sandbox = "off"``, where the
background process really outlives the shell: under bwrap it dies with the call).

Figures, per setting and host: the temp folder's growth (at most ``GROWTH_MB``), the calls
held past the shell's exit or missing the output's end (a result that timed out, or lacks
the command's last line, which only the kept tail has: 0), and the task's seconds.
Control: the old spooling (``spooled``, the code as it was) runs the same flood in the
same temp folder, which must grow by ``CONTROL_MB`` or more.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.chaos.trust import FAULT, Host
from tests.chaos.trust.fork_flood import config_text
from tests.daemon import subreaper
from tests.faults.report import Figure
from tests.mounts import tmpfs
from tests.support import journal_records, of_kind, reply, text, tool_use

TEMP_MB = 64  # the temp folder's size: the old spooling fills it
GROWTH_MB = 4  # the most the temp folder may grow through an attack
CONTROL_MB = 32  # the least the old spooling must make it grow
HOLD = 300  # seconds the background process holds the pipe
CALL_TIMEOUT = 60  # seconds: a call that waited for the pipe's EOF times out
SAMPLE = 0.02
FINAL = ("done", "failed")
SETTINGS = {"sandbox": 'sandbox = "auto"', "bare": 'sandbox = "off"'}


def say(message: str) -> None:
    print(f"output_flood: {message}", file=sys.stderr, flush=True)


def flood_command(size: str) -> str:
    return f"sleep {HOLD} & head -c {size} /dev/zero; echo flooded"


def used(folder: Path) -> int:
    stat = os.statvfs(folder)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def growth_during(folder: Path, work: Callable[[], object]) -> int:
    """The most ``folder``'s filesystem grew, in bytes, while ``work`` ran."""
    base = used(folder)
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], used(folder))
            done.wait(SAMPLE)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], used(folder)) - base


def spooled(command: str, folder: Path) -> int:
    """The old ``run_command``'s reading of output: each stream spooled to a temp file
    in ``folder`` (then its first 64 KiB read). The control's defence removed. Returns
    how much ``folder`` grew, measured while the spool files are still open."""
    base = used(folder)
    with (
        tempfile.TemporaryFile(dir=folder) as out,
        tempfile.TemporaryFile(dir=folder) as err,
    ):
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=out, stderr=err
        )
        proc.wait(timeout=CALL_TIMEOUT)
        out.seek(0)
        out.read(64 * 1024)
        return used(folder) - base


def attack(root: Path, host: Host, setting: str, temp: Path) -> dict[str, float]:
    daemon = host.daemon(root, config_text(SETTINGS[setting]))
    try:
        daemon.start(env={"TMPDIR": str(temp)})
        call = tool_use("run_command", command=flood_command("1G"), timeout=CALL_TIMEOUT)
        script = [reply(call), reply(text("Flooded."))]
        times: list[float] = []

        def flood() -> None:
            started = time.monotonic()
            task_id = daemon.submit(script, name="flood")
            daemon.wait_state(task_id, *FINAL, timeout=CALL_TIMEOUT * 2)
            times.append(time.monotonic() - started)

        grown = growth_during(temp, flood)
        results = [
            str(r.get("content")) for r in of_kind(journal_records(daemon.task("flood")), "result")
        ]
        returned = [r for r in results if r.startswith("exit code 0") and "flooded" in r]
        if not returned:
            say(f"{setting}: the call did not return at the shell's exit: {results[:1]}"[:400])
        return {"growth": grown, "held": 0 if returned else 1, "seconds": times[0]}
    finally:
        daemon.cleanup()


def run(quick: bool, host: Host) -> list[Figure]:
    started = time.monotonic()
    figures: list[Figure] = []
    at = f"({host.name})"
    with subreaper(), tempfile.TemporaryDirectory(prefix="agentd-output-flood-") as folder:
        temp = Path(folder) / "tmp"
        with tmpfs(temp, TEMP_MB):
            os.chmod(temp, 0o1777)  # noqa: S103  (a temp folder, sticky, as /tmp is)
            for setting in SETTINGS:
                found = attack(Path(folder) / setting, host, setting, temp)
                mb = found["growth"] / 2**20
                figures += [
                    Figure(
                        FAULT,
                        f"output flood: temp folder growth MB, {setting} {at}",
                        mb,
                        mb > GROWTH_MB,
                    ),
                    Figure(
                        FAULT,
                        f"output flood: calls held or missing the output's end, {setting} {at}",
                        int(found["held"]),
                        found["held"] > 0,
                    ),
                    Figure(
                        FAULT,
                        f"output flood: task s (1 GiB printed), {setting} {at}",
                        found["seconds"],
                    ),
                ]
            size = "1G" if not quick else "256M"  # (the temp folder fills at TEMP_MB anyway)
            flood = f"head -c {size} /dev/zero"  # (no holder: the old code did not wait for it)
            grown = spooled(flood, temp) / 2**20
    figures += [
        Figure(
            FAULT,
            f"output flood: control, old spooling: temp folder growth MB {at}",
            grown,
            grown < CONTROL_MB,
        ),
        Figure(FAULT, f"output flood: runtime s {at}", time.monotonic() - started),
    ]
    return figures
