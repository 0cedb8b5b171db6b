"""An installation without psycopg (a plain ``pip install agentd``): every command that
needs the PostgreSQL store says, in one line and exit 78, how to install it. Run as the
installed ``agentd``, on a Python where importing psycopg fails (a ``sitecustomize`` on
``PYTHONPATH`` refuses it, as a missing package would).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.stores import PSYCOPG_MISSING

AGENTD = Path(sys.executable).with_name("agentd")

BLOCK_PSYCOPG = """\
import sys


class _NoPsycopg:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "psycopg":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoPsycopg())
"""

URL = "postgresql://agentd@127.0.0.1:9/agentd"


def without_psycopg(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_PSYCOPG)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    environ |= {"PYTHONPATH": str(site), **env}
    return subprocess.run(
        [str(AGENTD), *args],
        check=False,
        capture_output=True,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--store", URL, "submit", "--prompt", "hi"],
        ["--store", URL, "start"],
        ["--store", URL, "start", "--detach"],
        ["--store", URL, "store", "init"],
        ["demo", "--cluster"],
    ],
    ids=lambda a: " ".join(a[2:] if a[0] == "--store" else a),
)
def test_a_command_that_needs_psycopg_says_how_to_install_it(
    tmp_path: Path, args: list[str]
) -> None:
    done = without_psycopg(tmp_path, "--spool", str(tmp_path / "spool"), *args)
    assert (done.returncode, done.stdout) == (78, ""), done
    assert done.stderr == f"agentd: {PSYCOPG_MISSING}\n"
    assert "pip install 'agentd[postgres]'" in done.stderr


def test_the_store_from_the_environment_says_the_same(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    assert (
        without_psycopg(tmp_path, "--spool", str(spool), "submit", "--prompt", "hi").returncode == 0
    )
    done = without_psycopg(tmp_path, "--spool", str(spool), "status", AGENTD_STORE=URL)
    assert (done.returncode, done.stderr) == (78, f"agentd: {PSYCOPG_MISSING}\n"), done


def test_a_spool_alone_needs_no_psycopg(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    done = without_psycopg(tmp_path, "--spool", str(spool), "submit", "--prompt", "hi")
    assert done.returncode == 0, done
    done = without_psycopg(tmp_path, "--spool", str(spool), "status")
    assert done.returncode == 0 and "queued" in done.stdout, done
