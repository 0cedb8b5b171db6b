"""``.ci/system-tools``, what ``make test`` and ``.ci/run`` check first: run for real with a
``PATH`` that lacks the tools (a folder holding only ``bash``, and ``apt-get`` where a
test says so), as root and as a user who is not (uid 65534 in a user namespace, through
bwrap, with a ``/dev`` of its own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO

SCRIPT = REPO / ".ci" / "system-tools"
BASH = shutil.which("bash") or "/bin/bash"


def bare_path(folder: Path, *tools: str) -> str:
    """A ``PATH`` of one folder holding ``bash`` and ``tools`` (links to the real ones)."""
    folder.mkdir()
    for tool in ("bash", *tools):
        real = shutil.which(tool)
        assert real is not None, f"{tool} is not installed"
        (folder / tool).symlink_to(real)
    return str(folder)


def run_script(
    path: str, *, not_root: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    command = [BASH, str(SCRIPT)]
    if not_root and os.geteuid() == 0:
        bwrap = shutil.which("bwrap")
        assert bwrap is not None, "bwrap is not installed"
        command = [bwrap, "--bind", "/", "/", "--dev", "/dev", "--unshare-user"]
        command += ["--uid", "65534", "--gid", "65534", BASH, str(SCRIPT)]
    return subprocess.run(
        command, check=False, env={"PATH": path, **env}, capture_output=True, text=True, timeout=60
    )


def test_nothing_missing_is_silent() -> None:
    done = run_script(os.environ["PATH"])
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "")


def test_without_apt_get_it_stops_at_once_with_one_line_naming_the_packages(
    tmp_path: Path,
) -> None:
    done = run_script(bare_path(tmp_path / "bin"))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "the tests need git strace systemd bubblewrap" in lines[0]
    assert "`sudo apt-get install -y git strace systemd bubblewrap" in lines[0]
    assert "AGENTD_TEST_SYSTEM=skip make test" in lines[0]


def test_a_user_who_is_not_root_is_told_the_line_instead_of_apt_get_running(
    tmp_path: Path,
) -> None:
    done = run_script(bare_path(tmp_path / "bin", "apt-get"), not_root=True)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "`sudo apt-get install -y git strace" in lines[0]
    assert "installing" not in lines[0]


def test_skip_mode_says_what_the_run_goes_without_and_lets_it_run(tmp_path: Path) -> None:
    done = run_script(bare_path(tmp_path / "bin"), AGENTD_TEST_SYSTEM="skip")
    assert done.returncode == 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "running without git strace" in lines[0]
    assert "the tests that need them skip" in lines[0]


@pytest.mark.parametrize("not_root", [False, True])
def test_under_ci_nothing_is_skipped(tmp_path: Path, not_root: bool) -> None:
    path = bare_path(tmp_path / "bin")
    done = run_script(path, not_root=not_root, AGENTD_TEST_SYSTEM="skip", CI="true")
    assert done.returncode == 1
    assert "CI=true runs every test, so install them first" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
