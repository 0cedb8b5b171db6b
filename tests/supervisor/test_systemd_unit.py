"""The systemd units: what docs/design.md section 7 promises, checked by systemd-analyze itself.

Two sources: the checked-in ``systemd/agentd.service`` and what ``agentd unit [--user]``
prints for this installation (``supervisor/unit.py``). The printed system unit keeps
every directive of the checked-in one, and both pass the same checks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.unit import Installation, agentd_folders, home_warnings, render
from tests.supervisor.test_cli import AGENTD, run_agentd
from worker.config import RestartConfig

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "agentd.service"
INSTALLED_AGENTD = "/opt/agentd/venv/bin/agentd"  # where the unit expects agentd
MAX_EXPOSURE = 2.5

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


def agentd_unit(
    *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> str:
    """What the installed ``agentd OPTIONS unit ARGS`` prints (and nothing on stderr)."""
    done = run_agentd(*options, "unit", *args, env=env)
    assert (done.returncode, done.stderr) == (0, ""), done
    return done.stdout


def _checked_in() -> str:
    return UNIT.read_text()


def _generated() -> str:
    return agentd_unit()


SYSTEM_UNITS = [
    pytest.param(_checked_in, INSTALLED_AGENTD, id="systemd/agentd.service"),
    pytest.param(_generated, str(AGENTD), id="agentd unit"),
]


@pytest.mark.parametrize(("source", "agentd"), SYSTEM_UNITS)
def test_unit_keeps_the_service_contract(source: Callable[[], str], agentd: str) -> None:
    unit = _directives(source())

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
    assert one("ExecStart").split() == [agentd, "start", "--log-format", "json"]
    # systemd must not SIGKILL the supervisor while it gives workers their grace period.
    assert _seconds(one("TimeoutStopSec")) >= RestartConfig().stop_grace + 15
    # Workers talk to the API: the network stays reachable (netlink: bwrap's loopback).
    families = set(one("RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert "PrivateNetwork" not in unit
    assert "IPAddressDeny" not in unit


#: What bubblewrap needs of the unit to sandbox run_command (issue: the unit turned it off).
BWRAP_NEEDS = {
    "RestrictNamespaces": ["user mnt pid ipc net"],
    "ProtectKernelTunables": ["no"],
    "ProtectKernelLogs": ["no"],
    "ProtectControlGroups": ["no"],
    "Delegate": ["pids memory"],
}
BWRAP_CALLS = "mount umount2 pivot_root setgroups setresuid capset"


@pytest.mark.parametrize(("source", "agentd"), SYSTEM_UNITS)
def test_unit_leaves_bwrap_what_it_needs_each_with_its_reason(
    source: Callable[[], str], agentd: str
) -> None:
    text = source()
    unit = _directives(text)
    for key, values in BWRAP_NEEDS.items():
        assert unit[key] == values, (key, unit[key])
    filters = unit["SystemCallFilter"]
    assert filters[:2] == ["@system-service", "~@privileged"]
    assert BWRAP_CALLS in filters[filters.index("~@privileged") :]
    assert unit["MemoryDenyWriteExecute"] == ["yes"]
    assert unit["NoNewPrivileges"] == ["yes"]
    lines = text.splitlines()
    for key, value in [
        *((k, v[0]) for k, v in BWRAP_NEEDS.items()),
        ("SystemCallFilter", BWRAP_CALLS),
    ]:
        at = lines.index(f"{key}={value}")
        above = next(
            line for line in reversed(lines[:at]) if not line.startswith(("Protect", "Delegate"))
        )
        assert above.startswith("#"), f"{key}={value} has no comment saying why"


def test_allow_jit_turns_memory_deny_write_execute_off_and_the_header_says_which() -> None:
    default, jit = agentd_unit(), agentd_unit("--allow-jit")
    assert _directives(default)["MemoryDenyWriteExecute"] == ["yes"]
    assert _directives(jit)["MemoryDenyWriteExecute"] == ["no"]
    assert "--allow-jit" in default.split("[Unit]")[0]
    assert "--allow-jit" in jit.split("[Unit]")[0]
    assert {k: v for k, v in _directives(jit).items() if k != "MemoryDenyWriteExecute"} == {
        k: v for k, v in _directives(default).items() if k != "MemoryDenyWriteExecute"
    }


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


def _exposure(unit: Path) -> float:
    """``systemd-analyze security --offline=true``'s overall exposure of ``unit``."""
    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for agentd\.service: (\d+(?:\.\d+)?)", result.stdout)
    assert match, f"no exposure figure in systemd-analyze output:\n{result.stdout}"
    failed = [line for line in result.stdout.splitlines() if line.startswith("✗")]
    assert float(match[1]) <= MAX_EXPOSURE, "\n".join(failed)
    return float(match[1])


@needs_systemd_analyze
def test_unit_exposure_is_low(capsys: pytest.CaptureFixture[str]) -> None:
    exposure = _exposure(UNIT)
    with capsys.disabled():
        print(
            f"\nsystemd-analyze security agentd.service: exposure {exposure} (max {MAX_EXPOSURE})"
        )


# -- agentd unit ---------------------------------------------------------------------------


def _verify(unit: Path, *, user: bool = False, runtime: Path | None = None) -> str:
    """``systemd-analyze verify``'s findings (a user unit needs a runtime folder)."""
    env = dict(os.environ)
    if runtime is not None:
        runtime.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(runtime)
    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), *(["--user"] if user else []), "verify", str(unit)],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return (result.stdout + result.stderr).strip()


def test_the_printed_system_unit_keeps_every_directive_of_the_checked_in_one() -> None:
    """``agentd unit`` and ``systemd/agentd.service`` are one unit: the printed one names
    this installation's ``agentd`` and may add directives, never drop or change one."""
    checked_in = _directives(UNIT.read_text())
    printed = _directives(agentd_unit().replace(str(AGENTD), INSTALLED_AGENTD))
    for key, values in checked_in.items():
        assert printed.get(key) == values, (key, values, printed.get(key))
    assert printed["LoadCredential"] == ["anthropic_api_key:/etc/agentd/anthropic_api_key"]
    assert printed["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


@needs_systemd_analyze
def test_the_printed_system_unit_verifies_with_this_venvs_real_path(tmp_path: Path) -> None:
    text = agentd_unit()
    assert f"ExecStart={AGENTD} start" in text  # the real path, no stand-in
    unit = tmp_path / "agentd.service"
    unit.write_text(text)
    assert _verify(unit) == ""


@needs_systemd_analyze
def test_the_printed_system_unit_exposure_is_low(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unit = tmp_path / "agentd.service"
    unit.write_text(agentd_unit())
    exposure = _exposure(unit)
    with capsys.disabled():
        print(f"\nsystemd-analyze security of `agentd unit`: exposure {exposure}")
    assert exposure <= MAX_EXPOSURE


@needs_systemd_analyze
def test_a_named_spool_and_config_go_into_the_system_unit(tmp_path: Path) -> None:
    spool, config = tmp_path / "my spool", tmp_path / "agentd.toml"
    config.write_text("max_workers = 2\n")
    done = run_agentd(f"--spool={spool}", f"--config={config}", "unit")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    if tmp_path.is_relative_to("/tmp"):  # (PrivateTmp= would hide both: said, one line each)
        lines = done.stderr.splitlines()
        assert [line.split()[2] for line in lines] == ["config", "spool"], lines
        assert all("PrivateTmp=yes gives the service a fresh, empty copy" in x for x in lines)
    unit = _directives(text)
    assert unit["ExecStart"] == [f'{AGENTD} start --log-format json --spool "{spool}"']
    assert unit["ReadWritePaths"] == [f'"{spool}"']
    assert unit["Environment"] == [f"AGENTD_CONFIG={config}"]
    path = tmp_path / "agentd.service"
    path.write_text(text)
    assert _verify(path) == ""


@needs_systemd_analyze
def test_the_user_unit_uses_the_users_paths_and_verifies(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".config" / "agentd").mkdir(parents=True)
    (home / ".config" / "agentd" / "agentd.toml").write_text("max_workers = 2\n")
    env = {"HOME": str(home), "XDG_CONFIG_HOME": "", "XDG_STATE_HOME": ""}
    text = agentd_unit("--user", env=env)
    unit = _directives(text)
    assert unit["ExecStart"] == [f"{AGENTD} start --log-format json --spool %h/.local/state/agentd"]
    assert unit["Environment"] == ["AGENTD_CONFIG=%h/.config/agentd/agentd.toml"]
    assert unit["WantedBy"] == ["default.target"]
    assert unit["LoadCredential"] == ["anthropic_api_key:%E/agentd/anthropic_api_key"]
    # what a user manager cannot do, or what would hide the user's own spool
    for key in ("User", "Group", "ProtectHome", "ProtectSystem", "StateDirectory"):
        assert key not in unit, key
    for key in ("Type", "WatchdogSec", "RestartPreventExitStatus", "KillMode", "TimeoutStopSec"):
        assert unit[key] == _directives(UNIT.read_text())[key], key
    assert "SystemCallFilter" in unit and "NoNewPrivileges" in unit
    # bwrap runs in the user unit too: the same seccomp allowances as the system unit
    for key in ("RestrictNamespaces", "RestrictAddressFamilies", "SystemCallFilter", "Delegate"):
        assert unit[key] == _directives(UNIT.read_text())[key], key
    path = tmp_path / "user" / "agentd.service"
    path.parent.mkdir()
    path.write_text(text)
    assert _verify(path, user=True, runtime=tmp_path / "run") == ""


@pytest.mark.parametrize("home", ["/home", "/root", "/run/user"])
def test_the_system_unit_warns_about_paths_protecthome_hides(home: str) -> None:
    agentd = str(Path(home) / "someone" / "venv" / "bin" / "agentd")
    install = Installation((agentd,), Path("/etc/agentd/agentd.toml"), None)
    (warning,) = home_warnings(install)
    assert agentd in warning and "ProtectHome=yes" in warning
    assert home_warnings(Installation(("/opt/agentd/venv/bin/agentd",), None, None)) == []


@needs_systemd_analyze
def test_an_installation_under_tmp_is_bound_back_read_only(tmp_path: Path) -> None:
    """agentd run from below /tmp (a clone tried under ``mktemp -d``): the system unit's
    PrivateTmp= would hide it, so the unit binds it back read-only, and still verifies;
    what lies elsewhere (/usr, /opt) is not named."""
    venv = Path("/tmp") / tmp_path.name / "venv"  # (the test's own folder may be elsewhere)
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    agentd = venv / "bin" / "agentd"
    agentd.write_text("#!/bin/sh\n")
    agentd.chmod(0o755)
    try:
        folders = (venv, Path("/usr"), Path("/opt/python"))
        install = Installation(
            (str(agentd),), Path("/etc/agentd/agentd.toml"), None, folders=folders
        )
        text = render(install, user=False)
        assert _directives(text)["BindReadOnlyPaths"] == [str(venv)]
        assert home_warnings(install) == []
        path = tmp_path / "agentd.service"
        path.write_text(text)
        assert _verify(path) == ""
    finally:
        shutil.rmtree(venv.parent, ignore_errors=True)


def test_the_printed_system_unit_binds_back_what_agentd_runs_from_below_tmp() -> None:
    """`agentd unit` names in BindReadOnlyPaths= each folder this agentd runs from below
    /tmp or /var/tmp (a clone there, as `make test-tmp-checkout` makes: its venv is in
    it), and none where it runs from elsewhere."""
    below = [
        str(f) for f in agentd_folders() if f.is_relative_to("/tmp") or f.is_relative_to("/var/tmp")
    ]
    assert _directives(agentd_unit()).get("BindReadOnlyPaths", []) == below
