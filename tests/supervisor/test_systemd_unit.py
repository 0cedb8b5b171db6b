"""The systemd unit: what DESIGN.md section 7 promises, checked by systemd-analyze itself."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from worker.config import RestartConfig

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "agentd.service"
INSTALLED_AGENTD = "/opt/agentd/venv/bin/agentd"  # where the unit expects agentd
MAX_EXPOSURE = 2.0

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)


def _directives(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of the unit, by key, in order (keys may repeat)."""
    found: dict[str, list[str]] = defaultdict(list)
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found[key.strip()].append(value.strip())
    return found


def _seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert match and match[2] in units, f"cannot read {value!r} as a duration"
    return float(match[1]) * units[match[2]]


def test_unit_keeps_the_service_contract() -> None:
    unit = _directives(UNIT.read_text())

    def one(key: str) -> str:
        assert len(unit[key]) == 1, f"{key}= should appear once, found {unit[key]}"
        return unit[key][0]

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert one("WatchdogSec") == "30"
    assert one("Restart") == "on-failure"
    assert "78" in one("RestartPreventExitStatus").split()
    assert one("KillMode") == "mixed"
    assert one("StateDirectory") == "agentd"
    assert one("StateDirectoryMode") == "0700"
    assert one("UMask") == "0077"
    assert one("User") == "agentd"
    assert one("Environment") == "AGENTD_CONFIG=/etc/agentd/agentd.toml"
    assert one("EnvironmentFile") == "-/etc/agentd/env"
    # The key is a credential (worker/credentials.py reads it), in no environment.
    assert one("LoadCredential") == "anthropic_api_key:/etc/agentd/anthropic_api_key"
    assert one("ExecStart").split() == [INSTALLED_AGENTD, "start", "--log-format", "json"]
    # systemd must not SIGKILL the supervisor while it gives workers their grace period.
    assert _seconds(one("TimeoutStopSec")) >= RestartConfig().stop_grace + 15
    # Workers talk to the API: the network stays reachable.
    assert set(one("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert "PrivateNetwork" not in unit
    assert "IPAddressDeny" not in unit


@needs_systemd_analyze
def test_unit_verifies_clean(tmp_path: Path) -> None:
    """`systemd-analyze verify` finds nothing to say about the unit.

    verify insists that ExecStart's binary exists, and /opt/agentd/venv is an install
    location, not this checkout. So the test verifies a copy in which only that path is
    swapped for an executable that exists (this venv's agentd when installed).
    """
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_AGENTD} " in text
    stand_in = Path(sys.executable).with_name("agentd")
    if not stand_in.exists():
        stand_in = Path(sys.executable)
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(f"ExecStart={INSTALLED_AGENTD} ", f"ExecStart={stand_in} "))

    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # verify exits 0 even for unknown keys and unparsable values: any output is a finding.
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).strip() == ""


@needs_systemd_analyze
def test_unit_exposure_is_low(capsys: pytest.CaptureFixture[str]) -> None:
    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for agentd\.service: (\d+(?:\.\d+)?)", result.stdout)
    assert match, f"no exposure figure in systemd-analyze output:\n{result.stdout}"
    exposure = float(match[1])
    with capsys.disabled():
        print(
            f"\nsystemd-analyze security agentd.service: exposure {exposure} (max {MAX_EXPOSURE})"
        )
    failed = [line for line in result.stdout.splitlines() if line.startswith("✗")]
    assert exposure <= MAX_EXPOSURE, "\n".join(failed)
