"""Where the key comes from and how it travels (worker/credentials.py), in real processes:
``/proc/PID/environ`` is read from outside, as a tool running as the same user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon import Daemon, subreaper
from tests.support import (
    REPO,
    journal_records,
    make_spool,
    of_kind,
    poll_for,
    reply,
    run_worker,
    scripted_task,
    text,
    tool_use,
    worker_env,
)
from worker import credentials
from worker.credentials import API_KEY, AUTH_TOKEN, HANDOVER, Credentials
from worker.errors import ConfigError
from worker.protocol import ExitCode
from worker.redactor import REDACTED, Redactor

CANARY = "canary-key-0123456789abcdef"

#: A process that takes over its secrets, then says what it holds and what it shows.
PROBE = """
import json, os, ctypes
from worker import credentials
held = credentials.take_over()
libc = ctypes.CDLL(None)
print(json.dumps({
    "pid": os.getpid(),
    "held": dict(held.values),
    "environ": open(f"/proc/{os.getpid()}/environ", "rb").read().decode(errors="replace"),
    "dumpable": libc.prctl(3, 0, 0, 0, 0),
    "handover_left": os.environ.get(credentials.HANDOVER),
}))
"""


def probe(env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=worker_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    found: dict[str, object] = json.loads(out)
    assert found["pid"] == proc.pid  # executed again in place: the same process
    return found


def test_a_key_in_the_environment_moves_out_of_it_into_memory() -> None:
    found = probe({API_KEY: CANARY, AUTH_TOKEN: "token-0123456789"})
    assert found["held"] == {API_KEY: CANARY, AUTH_TOKEN: "token-0123456789"}
    assert CANARY not in str(found["environ"])
    assert "token-0123456789" not in str(found["environ"])
    assert found["dumpable"] == 0
    assert found["handover_left"] is None


def test_a_key_file_is_read_and_its_name_leaves_the_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(CANARY + "\n")
    found = probe({f"{API_KEY}_FILE": str(key)})
    assert found["held"] == {API_KEY: CANARY}
    assert str(key) not in str(found["environ"])


def test_a_systemd_credential_is_read_and_its_folder_leaves_the_environment(
    tmp_path: Path,
) -> None:
    (tmp_path / "anthropic_api_key").write_text(CANARY)
    found = probe({"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert found["held"] == {API_KEY: CANARY}
    assert "CREDENTIALS_DIRECTORY" not in str(found["environ"])


def test_no_key_means_no_second_start() -> None:
    found = probe({})
    assert found["held"] == {}
    assert HANDOVER not in str(found["environ"])


def test_sources_in_order(tmp_path: Path) -> None:
    key_file, creds = tmp_path / "key", tmp_path / "creds"
    key_file.write_text("from-file-0123")
    creds.mkdir()
    (creds / "anthropic_api_key").write_text("from-credential")
    both = {f"{API_KEY}_FILE": str(key_file), "CREDENTIALS_DIRECTORY": str(creds)}
    assert credentials.gather({API_KEY: "from-env", **both}).get(API_KEY) == "from-env"
    assert credentials.gather(both).get(API_KEY) == "from-file-0123"
    assert credentials.gather({"CREDENTIALS_DIRECTORY": str(creds)}).get(API_KEY) == (
        "from-credential"
    )
    assert not credentials.gather({"CREDENTIALS_DIRECTORY": str(tmp_path / "none")})


def test_the_files_secrets_came_from_travel_with_them(tmp_path: Path) -> None:
    """The sandbox hides them (worker.tools.sandbox.sandbox_for), though no environment
    names them once the daemon has started."""
    key_file, creds = tmp_path / "key", tmp_path / "creds"
    key_file.write_text("from-file-0123")
    creds.mkdir()
    (creds / "anthropic_api_key").write_text("from-credential")
    assert credentials.gather({API_KEY: "from-env"}).files == ()
    assert credentials.gather({f"{API_KEY}_FILE": str(key_file)}).files == (str(key_file),)
    # a key file the variable took precedence over is hidden as well (it holds a key)
    shadowed = credentials.gather({API_KEY: "from-env", f"{API_KEY}_FILE": str(key_file)})
    assert shadowed.get(API_KEY) == "from-env" and shadowed.files == (str(key_file),)
    found = credentials.gather({"CREDENTIALS_DIRECTORY": str(creds)})
    assert found.files == (str(creds),)
    assert Credentials.decode(found.encode()) == found
    (creds / "anthropic_api_key").unlink()  # a credentials folder of other secrets only
    assert credentials.gather({"CREDENTIALS_DIRECTORY": str(creds)}).files == (str(creds),)


def test_with_a_store_every_file_and_socket_folder_libpq_could_log_in_with_is_named(
    tmp_path: Path,
) -> None:
    home = str(tmp_path / "op")
    env = {
        "HOME": home,
        "PGPASSFILE": "/etc/agentd/pgpass",
        "PGSERVICEFILE": "/srv/pg_service.conf",
        "PGSYSCONFDIR": "/opt/pg/etc",
        "PGSSLKEY": "/srv/client.key",
        "PGHOST": "/var/lib/pgsock,db.example",
    }
    paths = credentials.store_paths(env, "postgresql://agentd@/agentd?host=/srv/pgsock")
    for path in [
        f"{home}/.pgpass",
        f"{home}/.pg_service.conf",
        f"{home}/.postgresql",
        *(env[n] for n in ("PGPASSFILE", "PGSERVICEFILE", "PGSSLKEY")),
        "/opt/pg/etc/pg_service.conf",
        *credentials.SERVICE_FILES,
        *credentials.SOCKET_FOLDERS,
        "/var/lib/pgsock",
        "/srv/pgsock",
    ]:
        assert path in paths
    # a socket in the host's /tmp is out of reach already (the sandbox has its own /tmp)
    assert "/tmp/pg" not in credentials.store_paths({}, "postgresql://a@/b?host=/tmp/pg")
    assert credentials.without_libpq({**env, "PATH": "/bin"}) == {
        "HOME": home,
        "PATH": "/bin",
    }


@pytest.mark.parametrize("content", ["", "   \n", "x" * (credentials.MAX_SECRET + 1)])
def test_an_unusable_key_file_is_a_one_line_config_error(tmp_path: Path, content: str) -> None:
    key = tmp_path / "key"
    key.write_text(content)
    with pytest.raises(ConfigError, match=f"{API_KEY}_FILE=") as info:
        credentials.gather({f"{API_KEY}_FILE": str(key)})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read"):
        credentials.gather({f"{API_KEY}_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize("detach", [[], ["--detach"]])
def test_a_daemon_started_with_a_bad_key_file_exits_78(tmp_path: Path, detach: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "--spool", str(tmp_path / "spool"), "start", *detach],
        cwd=REPO,
        env=worker_env({f"{API_KEY}_FILE": str(tmp_path / "missing")}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 78
    assert done.stderr.count("\n") == 1 and "ANTHROPIC_API_KEY_FILE" in done.stderr


def test_the_repr_never_shows_a_secret() -> None:
    held = Credentials({API_KEY: CANARY})
    assert CANARY not in repr(held) and CANARY not in str(held)


def test_a_handover_pipe_reaches_a_child() -> None:
    child = "from worker import credentials; import os; print(credentials.take_over().get('X'))"
    with credentials.handing_over(Credentials({"X": CANARY}), worker_env()) as (env, fds):
        done = subprocess.run(
            [sys.executable, "-c", child],
            cwd=REPO,
            env=env,
            pass_fds=fds,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    assert done.stdout.strip() == CANARY


def test_without_credentials_removes_every_secret_and_pointer() -> None:
    environ = {
        API_KEY: "k",
        AUTH_TOKEN: "t",
        f"{API_KEY}_FILE": "/f",
        "CREDENTIALS_DIRECTORY": "/c",
        HANDOVER: "5",
        "ANTHROPIC_BASE_URL": "http://x",
    }
    assert credentials.without_credentials(environ) == {"ANTHROPIC_BASE_URL": "http://x"}


def test_the_redactor_replaces_given_and_held_secrets() -> None:
    assert Redactor({}, secrets={CANARY}).clean_secrets(f"a {CANARY} b") == f"a {REDACTED} b"
    credentials.hold(Credentials({API_KEY: CANARY}))
    assert Redactor({}).clean_secrets(f"key={CANARY}") == f"key={REDACTED}"
    assert Redactor({}).clean_mapping({"msg": CANARY}) == {"msg": REDACTED}
    # only known values: a tool's output keeps what merely looks like a secret
    assert Redactor({}).clean_secrets("Basic idea: sk-ant-example") == (
        "Basic idea: sk-ant-example"
    )


def test_a_tool_result_that_holds_the_key_is_redacted_before_it_is_recorded(
    tmp_path: Path,
) -> None:
    """A tool that finds the key (here: a file in its workspace) cannot hand it on: the
    recorded result, and so what the model is sent, holds [redacted] instead."""
    spool = make_spool(tmp_path)
    task = scripted_task(
        spool,
        [
            reply(tool_use("run_command", command="cat key.txt; echo; cat key.txt | rev")),
            reply(text("done")),
        ],
        name="planted",
    )
    workspace = task.path / "workspace"
    workspace.mkdir()
    (workspace / "key.txt").write_text(CANARY)
    assert run_worker(task, env={API_KEY: CANARY}) == ExitCode.DONE
    (result,) = of_kind(journal_records(task), "result")
    assert REDACTED in result["content"]
    assert CANARY[::-1] in result["content"]  # the tool did read it: redaction is literal
    assert CANARY.encode() not in task.journal.read_bytes()


def test_fresh_and_forked_workers_are_non_dumpable(tmp_path: Path) -> None:
    """Both ways a daemon starts a worker: fresh (queued before the fork server is ready)
    and forked from the fork server, which must hand its non-dumpable state down."""
    config = '[heartbeat]\ninterval = 0.2\n[tools]\nmodules = ["tests.faults.tools"]\n'
    daemon = Daemon(tmp_path, config)
    script = [reply(tool_use("dumpable")), reply(text("done"))]
    daemon.spool.ensure()
    with subreaper():
        try:
            daemon.submit(script, name="fresh")
            daemon.start()
            daemon.wait_row("fresh", lambda r: r["state"] == "done", 30)
            poll_for(
                lambda: any(e["event"] == "forkserver_ready" for e in daemon.log_events()),
                60,
                what="the fork server",
            )
            daemon.submit(script, name="forked")
            daemon.wait_state("forked", "done", timeout=30)
        finally:
            daemon.cleanup()
    for name in ("fresh", "forked"):
        (result,) = of_kind(journal_records(daemon.task(name)), "result")
        assert result["content"] == "0", name
