"""Prometheus metrics (docs/design.md section 9) from a real daemon: ``/metrics`` scraped over
HTTP and read with ``prometheus_client``'s own parser, while real workers finish tasks,
are killed with ``-9`` and hold on dangling calls. Every wait is a deadline poll.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from supervisor.coordination import running_pid
from supervisor.metrics import HANDLER_THREADS, Metrics, Sample, families
from tests.daemon import Daemon, subreaper
from tests.support import REPO, poll_for, reply, text, tool_use
from worker.budget import Price
from worker.config import Config, load_config
from worker.errors import ConfigError
from worker.metrics import CALL_BOUNDS, METRICS_VERSION, StepMetrics
from worker.models.base import Usage

#: Text that is in the prompt and in a tool's input and output: never in the exposition.
PROMPT = "Summarise the quarterly numbers for ACME-PROMPT-7731."
CHARGE = "if [ -e charged ]; then echo second run; else touch charged; exec sleep 30; fi"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Scraper:
    def __init__(self, daemon: Daemon, port: int) -> None:
        self.daemon = daemon
        self.url = f"http://127.0.0.1:{port}/metrics"

    def text(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as response:  # noqa: S310  (http, local)
            assert response.status == 200
            body: bytes = response.read()
            return body.decode()

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of a scrape, by name and labels."""
        out = {}
        for family in text_string_to_metric_families(self.text()):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.samples()[(name, frozenset(labels.items()))]

    def wait(self, name: str, predicate: Any, what: str, **labels: str) -> float:
        def check() -> tuple[float] | None:  # (a tuple: 0.0 is a value to wait for too)
            value = self.value(name, **labels)
            return (value,) if predicate(value) else None

        try:
            return poll_for(check, 15, interval=0.05, what=what)[0]
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {name}={self.value(name, **labels)}") from None


@pytest.fixture(scope="module")
def scraper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraper]:
    port = free_port()
    config = (
        "[heartbeat]\ninterval = 0.2\ntimeout = 2.0\n"
        "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.4\n"
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    )
    with subreaper():
        daemon = Daemon(tmp_path_factory.mktemp("metrics"), config)
        try:
            daemon.start()
            yield Scraper(daemon, port)
        finally:
            daemon.cleanup()


def readme_metrics(*, shared: bool = False) -> set[str]:
    """The metric names of the Metrics table (docs/reference/metrics.md, where the
    README's Metrics section points; counters without ``_total``, as the parser names
    their families): those a daemon on the spool serves, or with
    ``shared`` those only a node on a shared store serves ("with a shared store")."""
    section = (REPO / "docs" / "reference" / "metrics.md").read_text()
    rows = re.findall(
        r"^\| `([a-z_]+)(?:\{[a-z_]+\})?` \|[^|]*\|([^|]*)\|", section, flags=re.MULTILINE
    )
    return {
        name.removesuffix("_total")
        for name, what in rows
        if what.strip().startswith("with a shared store") == shared
    }


def test_every_metric_of_the_contract_is_served(scraper: Scraper) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scraper.text())}
    assert set(families) == readme_metrics()  # the README lists what is served, no more
    assert {
        "agentd_tasks",
        "agentd_worker_restarts",
        "agentd_dangling_held",
        "agentd_oldest_hold_seconds",
        "agentd_compactions",
        "agentd_crash_loops",
        "agentd_checkpoint_seconds",
        "agentd_model_call_seconds",
        "agentd_tool_call_seconds",
        "agentd_storage_faults",
        "gen_ai_client_token_usage",
    } <= set(families)
    assert families["agentd_worker_restarts"].type == "counter"
    assert families["agentd_checkpoint_seconds"].type == "histogram"
    assert families["agentd_tasks"].type == "gauge"
    states = {s.labels["state"] for s in families["agentd_tasks"].samples}
    assert states == {"queued", "running", "backoff", "held", "done", "failed", "cancelled"}
    assert scraper.value("agentd_compactions_total") == 0


def test_a_finished_task_moves_the_histograms_and_leaves_no_prompt_text(
    scraper: Scraper,
) -> None:
    daemon = scraper.daemon
    before = scraper.samples()

    def count(samples: dict[Any, float], name: str, **labels: str) -> float:
        return samples.get((name, frozenset(labels.items())), 0.0)

    turns = 4
    responses = [
        reply(text(f"Step {i}."), tool_use("write_file", path=f"f{i}.txt", content=PROMPT))
        for i in range(1, turns)
    ]
    responses.append(reply(text("Done."), usage={"input_tokens": 100, "output_tokens": 7}))
    task_id = daemon.submit(responses, name="histograms", prompt=PROMPT)
    daemon.wait_state(task_id, "done")
    # the worker's last beat, written as it ended, is folded when its exit is settled
    checkpoints = scraper.wait(
        "agentd_checkpoint_seconds_count",
        lambda v: v >= count(before, "agentd_checkpoint_seconds_count") + turns,
        "one checkpoint a turn at least",
    )
    after = scraper.samples()
    assert checkpoints == count(after, "agentd_checkpoint_seconds_bucket", le="+Inf")
    assert count(after, "agentd_checkpoint_seconds_sum") > 0
    assert (
        count(after, "agentd_model_call_seconds_count")
        - count(before, "agentd_model_call_seconds_count")
        == turns
    )
    tool = count(after, "agentd_tool_call_seconds_count", tool="write_file")
    assert tool - count(before, "agentd_tool_call_seconds_count", tool="write_file") == turns - 1
    for kind in ("input", "output"):
        name = "gen_ai_client_token_usage_count"
        labels = {"gen_ai_operation_name": "chat", "gen_ai_token_type": kind}
        assert count(after, name, **labels) - count(before, name, **labels) == turns
    grew = count(after, "gen_ai_client_token_usage_sum", **labels) - count(
        before, "gen_ai_client_token_usage_sum", **labels
    )
    assert grew == 7 + 5 * (turns - 1)  # the scripted model's usage: 5 output tokens a turn
    exposition = scraper.text()
    assert "ACME" not in exposition and "quarterly" not in exposition
    assert count(after, "agentd_tasks", state="done") >= 1


def test_a_kill_9_counts_a_restart_and_a_hold_shows_until_it_is_decided(
    scraper: Scraper,
) -> None:
    daemon = scraper.daemon
    restarts = scraper.value("agentd_worker_restarts_total")
    held = scraper.value("agentd_dangling_held")
    script = [
        reply(text("Charging."), tool_use("run_command", command=CHARGE, timeout=60)),
        reply(text("Charged.")),
    ]
    task_id = daemon.submit(script, name="charge")
    charged = daemon.task(task_id).path / "workspace" / "charged"
    row = daemon.wait_row(
        task_id,
        lambda r: r["phase"] == "tool:run_command" and charged.exists(),
        what="the charge to be under way",
    )
    os.kill(row["pid"], signal.SIGKILL)
    scraper.wait("agentd_worker_restarts_total", lambda v: v == restarts + 1, "the restart")
    daemon.wait_state(task_id, "held")
    assert scraper.wait("agentd_dangling_held", lambda v: v == held + 1, "the hold") == held + 1
    assert scraper.value("agentd_tasks", state="held") >= 1
    assert scraper.wait("agentd_oldest_hold_seconds", lambda v: v > 0, "the hold's age") < 60

    code, _, err = daemon.cli("approve-dangling", task_id, "--all", "--skip")
    assert code == 0, err
    daemon.wait_state(task_id, "done")
    scraper.wait("agentd_dangling_held", lambda v: v == held, "the hold to be decided")
    assert scraper.value("agentd_crash_loops_total") == 0


# -- the fold, without processes ------------------------------------------------------------


def beat(pid: int, metrics: StepMetrics) -> dict[str, Any]:
    return {"pid": pid, "at": 0.0, "metrics": json.loads(json.dumps(metrics.to_json()))}


def test_the_fold_adds_growth_per_worker_and_starts_over_for_a_new_pid() -> None:
    folded, worker = Metrics(), StepMetrics()
    worker.tool_called("read_file", 0.02)
    folded.fold("t", beat(10, worker))
    folded.fold("t", beat(10, worker))  # the same beat again: nothing grew
    worker.tool_called("read_file", 0.03)
    folded.fold("t", beat(10, worker))
    assert sum(folded.tool_call["read_file"].counts) == 2
    restarted = StepMetrics()  # a new worker: its counts start from 0
    restarted.tool_called("read_file", 0.5)
    folded.fold("t", beat(11, restarted))
    assert sum(folded.tool_call["read_file"].counts) == 3
    assert folded.tool_call["read_file"].sum == pytest.approx(0.55)
    reused = StepMetrics()  # the old pid again, counts lower than seen: a new process
    reused.model_called(1.0, "m", Usage(10, 2))
    folded.fold("t", beat(11, reused))
    assert sum(folded.tool_call["read_file"].counts) == 3
    assert sum(folded.model_call.counts) == 1


@pytest.mark.parametrize(
    "metrics",
    [
        "junk",
        {"v": METRICS_VERSION + 1, "model_call": {"b": [1] * (len(CALL_BOUNDS) + 1), "s": 1}},
        {"v": METRICS_VERSION, "model_call": {"b": [1, 2], "s": 1.0}},
        {"v": METRICS_VERSION, "model_call": {"b": [-1] * (len(CALL_BOUNDS) + 1), "s": 1}},
        {"v": METRICS_VERSION, "tool_call": {"../x": {"b": [1] * (len(CALL_BOUNDS) + 1), "s": 1}}},
        {"v": METRICS_VERSION, "tool_call": [1], "tokens": "x", "checkpoint": None},
    ],
)
def test_a_heartbeat_of_another_shape_folds_nothing(metrics: Any) -> None:
    folded = Metrics()
    folded.fold("t", {"pid": 1, "at": 0.0, "metrics": metrics})
    assert sum(folded.model_call.counts) == 0 and not folded.tool_call
    good = StepMetrics()  # the same worker's next beat, of the right shape: folded whole
    good.tool_called("read_file", 0.1)
    good.model_called(0.2, "m", Usage(10, 3))
    folded.fold("t", beat(1, good))
    assert sum(folded.tool_call["read_file"].counts) == 1
    assert folded.tokens["output"].sum == 3


def exposition_of(sample: Sample) -> str:
    """What a scrape of ``sample`` serves, as prometheus_client writes it."""
    registry = CollectorRegistry()

    class One(Collector):
        def collect(self) -> Iterator[Any]:
            return families(sample)

    registry.register(One())
    return generate_latest(registry).decode()


def test_cost_is_priced_from_the_replies_workers_received_once_each_by_model() -> None:
    """``agentd_cost_usd_total{model}``: what each worker's replies grew by, priced when
    folded; a restart's worker starts from nothing, the same beat twice adds nothing, a
    model without a price adds nothing, and no label names a task."""
    prices = {"m-": Price.of(1, 2, 3, 4, 5)}
    folded = Metrics(lambda: prices)
    worker = StepMetrics()
    worker.model_called(0.1, "m-1", Usage(1_000_000, 0))
    folded.fold("t", beat(10, worker))
    folded.fold("t", beat(10, worker))  # the same beat again
    worker.model_called(0.1, "m-1", Usage(0, 500_000, cache_read_input_tokens=1_000_000))
    worker.model_called(0.1, "unpriced", Usage(7, 7))
    folded.fold("t", beat(10, worker))
    again = StepMetrics()  # the task's next worker: its replies, not the journal's replay
    again.model_called(0.1, "m-2", Usage(0, 0, cache_creation_input_tokens=1_000_000,
                                        cache_creation_1h_input_tokens=250_000))  # fmt: skip
    folded.fold("t", beat(11, again))
    folded.fold("u", {"pid": 12, "at": 0.0, "metrics": {"v": METRICS_VERSION, "spend": "x"}})
    assert folded.cost == {"m-1": Decimal(7), "m-2": Decimal("3.25")}  # 1 + 1 + 5; .75*3 + .25*4
    exposition = exposition_of(folded.sample({}, []))
    assert 'agentd_cost_usd_total{model="m-1"} 7.0' in exposition
    assert 'agentd_cost_usd_total{model="m-2"} 3.25' in exposition
    assert "unpriced" not in exposition and 'task="' not in exposition


def test_a_compaction_the_server_made_counts_as_one_the_worker_made(tmp_path: Path) -> None:
    """``agentd_compactions_total`` counts each ``compaction`` event the daemon relays,
    whoever compacted (``strategy``: ``client`` or ``server``, docs/design.md section 4),
    read by prometheus_client's own parser; other events count nothing."""
    from supervisor.daemon import Supervisor
    from worker.spool import Spool

    daemon = Supervisor(Spool(tmp_path / "spool"), Config(), preload=False)
    for strategy in ("server", "client", "server"):
        daemon.announcer.relayed("t", {"event": "compaction", "strategy": strategy, "task": "t"})
    daemon.announcer.relayed("t", {"event": "turn_recorded", "task": "t"})
    exposition = exposition_of(daemon.metrics.sample({}, []))
    counted = {
        s.name: s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }
    assert counted["agentd_compactions_total"] == 3


# -- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        ("", None),
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:9464", ("0.0.0.0", 9464)),  # noqa: S104  (the operator wrote it)
        ("localhost:1", ("localhost", 1)),
        ("[::1]:9464", ("::1", 9464)),
    ],
)
def test_listen_is_host_and_port(tmp_path: Path, listen: str, address: Any) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text(f'[metrics]\nlisten = "{listen}"\n')
    assert load_config(path).metrics.address == address
    assert Config().metrics.address is None  # off by default


@pytest.mark.parametrize(
    "listen",
    ['":9464"', '"9464"', "9464", '"localhost"', '"127.0.0.1:0"', '"127.0.0.1:65536"',
     '"::1:9464"', '"127.0.0.1:http"', '" 127.0.0.1:9464"', "true"],
)  # fmt: skip
def test_listen_without_a_host_or_a_port_is_refused(tmp_path: Path, listen: str) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text(f"[metrics]\nlisten = {listen}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: metrics.listen must be")
    assert "\n" not in message


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detached"])
def test_a_listen_address_that_cannot_be_bound_stops_the_start_in_one_line(
    tmp_path: Path, detach: bool
) -> None:
    with socket.socket() as taken, subreaper():
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # in use: exit 1; not an address of this machine (TEST-NET-1): exit 78
        for listen, code, said in (
            (f"127.0.0.1:{port}", 1, "another process listens there"),
            ("192.0.2.1:9464", 78, "give an address of this machine"),
        ):
            daemon = Daemon(tmp_path / str(code), f'[metrics]\nlisten = "{listen}"\n')
            try:
                daemon.spool.ensure()
                done = daemon.run_cli("start", *(["--detach"] if detach else []))
                assert (done.returncode, done.stdout) == (code, ""), done
                # (in the foreground the daemon's log is its stderr: the line comes last)
                said_lines = [
                    line for line in done.stderr.splitlines() if line.startswith("agentd")
                ]
                assert said_lines == done.stderr.splitlines()[-1:], done.stderr
                (line,) = said_lines
                assert line.startswith(f"agentd: [metrics] listen = '{listen}'") and said in line
                assert running_pid(daemon.spool) is None  # nothing serves, the lock is free
            finally:
                daemon.cleanup()


def test_idle_connections_by_the_hundred_cost_a_few_threads_and_scrapes_go_on(
    scraper: Scraper,
) -> None:
    """The metrics server holds at most ``MAX_CONNECTIONS`` connections on a pool of
    ``HANDLER_THREADS`` threads: 300 connections that never send a request do not grow
    the daemon by a thread each, and once they are closed a scrape is answered."""
    assert scraper.daemon.proc is not None
    daemon = psutil.Process(scraper.daemon.proc.pid)
    scraper.text()
    before = daemon.num_threads()
    port = int(scraper.url.split(":")[2].split("/")[0])
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        peak = max(daemon.num_threads() for _ in range(20))
    finally:
        for conn in idle:
            conn.close()
    assert peak <= before + HANDLER_THREADS + 1, (before, peak)

    def answered() -> bool:
        try:
            return "agentd_tasks" in scraper.text()
        except OSError:  # refused while the closed connections are let go
            return False

    poll_for(answered, 30, what="a scrape after the flood")
