"""Prometheus metrics of the daemon (docs/design.md section 9), served on ``[metrics] listen``.

Two sources, one exposition:

* the daemon's own decisions, counted where it makes them (``Metrics.restarts``,
  ``crash_loops``, ``storage_faults``) and its view of the tasks (states, holds), read at
  each scrape;
* what only a worker measures (``worker.metrics``: checkpoint, model and tool call
  durations, tokens), which reaches the daemon through the spool: each heartbeat carries
  the worker's running histograms, and ``Metrics.fold`` adds what grew since the beat it
  last saw of that worker. Counts are per worker process, so a new pid (a restart) starts
  from nothing, and so does a beat whose counts went down (a reused pid). A worker's last
  beat, written as it ends, is folded when its exit is settled, so its last interval is
  not lost; a worker killed with ``-9`` loses at most the interval since its last beat.

The server is ``prometheus_client``'s WSGI application with a registry of its own holding
one collector, served by a bounded server (``_BoundedServer``): one thread accepts, a pool
of ``HANDLER_THREADS`` answers, at most ``MAX_CONNECTIONS`` connections are open at once
(more are closed as they come), and a connection that says nothing for
``CONNECTION_TIMEOUT`` seconds is dropped. Idle connections by the hundred cost a few
threads, never one each. A scrape asks the daemon's event loop for a ``Sample`` (every
value is read on the loop, which alone changes them: one consistent picture, no locks on
the daemon's side) and renders it; so a daemon that nobody scrapes reads no heartbeat for
metrics at all. ``prometheus_client`` is imported only when metrics are served: the
daemon of a spool without them never pays for it, and workers never import it.

Cost (``agentd_cost_usd_total{model}``, docs/design.md section 13) comes the same way:
each heartbeat carries the tokens of every reply its worker received, by model
(``worker.metrics``: calls actually made, never a replay of the journal), and the growth
is priced when it is folded, at the daemon's price table then, so the counter only grows
(a reload of ``[prices]`` prices what comes after it). A model without a price adds
nothing; the label set is bounded (``MAX_MODELS``), and never names a task.

Nothing here reads a secret or a prompt: the labels are state names, tool names, model
names and token types, and the values are counts, durations and dollars.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import math
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from supervisor.status import held_calls
from worker.budget import BUILTIN_PRICES, Price, cost, spend_from_json
from worker.errors import AddressInUseError, AgentdError, ConfigError
from worker.metrics import (
    CALL_BOUNDS,
    CHECKPOINT_BOUNDS,
    METRICS_VERSION,
    TOKEN_BOUNDS,
    TOKEN_TYPES,
)
from worker.models.base import Usage
from worker.protocol import TaskStatus
from worker.spool import TaskDir

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

#: Seconds a scrape waits for the daemon's loop to take its sample; past that (the loop is
#: busy stopping, say) the last sample is served again.
SAMPLE_PATIENCE = 2.0
#: At most this many tool labels: a worker's heartbeat is spool content, never trusted to
#: bound a label set (tool names come from the registry, a few dozen at most).
MAX_TOOLS = 256
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: At most this many model labels of ``agentd_cost_usd_total``, and what a model name is.
MAX_MODELS = 64
_MODEL_NAME = re.compile(r"[a-zA-Z0-9._:@/-]{1,128}")
#: The metrics server's bounds: threads that answer, connections open at once (the rest
#: are closed at once), and seconds a connection may stay silent.
HANDLER_THREADS = 2
MAX_CONNECTIONS = 16
CONNECTION_TIMEOUT = 5.0


@dataclass
class Histogram:
    """Counts per bucket (the last one +Inf) and a sum, folded from workers."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def add(self, counts: list[int], total: float) -> None:
        for i, n in enumerate(counts):
            self.counts[i] += n
        self.sum += total

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.sum)

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus's cumulative ``le`` buckets."""
        running, out = 0, []
        for bound, n in zip([*self.bounds, math.inf], self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(bound), float(running)))
        return out


def _shaped(data: Any, bounds: tuple[float, ...]) -> tuple[list[int], float] | None:
    """A worker's histogram (``{"b": counts, "s": sum}``) when it has the shape of one."""
    if not isinstance(data, dict):
        return None
    counts, total = data.get("b"), data.get("s")
    if not isinstance(counts, list) or len(counts) != len(bounds) + 1:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None
    if not isinstance(total, int | float) or isinstance(total, bool) or not math.isfinite(total):
        return None
    return counts, float(total)


def _usage_growth(now: Usage, before: Usage | None) -> Usage:
    """What a worker's usage of one model grew by since ``before``; all of it when a
    count went down (another process)."""
    fields = (
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "cache_creation_1h_input_tokens",
    )
    if before is None or any(getattr(now, f) < getattr(before, f) for f in fields):
        return now
    return Usage(*(getattr(now, f) - getattr(before, f) for f in fields))


def _table(data: Any) -> dict[str, Any]:
    """``data`` when it is a JSON object, else an empty one (a heartbeat is spool content)."""
    return data if isinstance(data, dict) else {}


def _growth(
    now: tuple[list[int], float], before: tuple[list[int], float] | None
) -> tuple[list[int], float]:
    """What a worker's histogram grew by since ``before``; all of it when it shrank."""
    if before is None or any(a < b for a, b in zip(now[0], before[0], strict=True)):
        return now
    return [a - b for a, b in zip(now[0], before[0], strict=True)], now[1] - before[1]


@dataclass(frozen=True)
class Sample:
    """Every value of one scrape, taken on the daemon's loop."""

    tasks: Mapping[str, int]
    dangling_held: int
    oldest_hold_seconds: float
    restarts: int
    crash_loops: int
    storage_faults: int
    compactions: int
    checkpoint: Histogram
    model_call: Histogram
    tool_call: Mapping[str, Histogram]
    tokens: Mapping[str, Histogram]
    #: USD spent by model (``agentd_cost_usd_total``)
    cost_usd: Mapping[str, float]
    #: with a shared store: the tasks other nodes took over from this one, and the nodes
    #: alive (None on the spool's files: the two are not exposed)
    lease_lost: int | None = None
    nodes: int | None = None
    #: run_command runs under bwrap (the daemon's probe at start)
    sandbox_available: bool = False
    #: tasks removed by retention or a prune the daemon saw, and the spool's size in bytes
    #: as last measured (None: not yet, or a shared store)
    tasks_removed: int = 0
    spool_bytes: int | None = None


class Metrics:
    """The daemon's counters and the histograms folded from its workers' heartbeats;
    ``prices`` gives the price table the spend is reckoned at (the daemon's config's)."""

    def __init__(self, prices: Callable[[], Mapping[str, Price]] = lambda: BUILTIN_PRICES) -> None:
        self.prices = prices
        self.restarts = 0  # restarts the daemon decided (policy.decide: Restart)
        self.crash_loops = 0  # tasks it gave up on (GiveUp: crash_loop)
        self.storage_faults = 0  # storage-fault episodes, the daemon's and its workers'
        self.lease_lost = 0  # tasks a shared store's other nodes took over from this one
        self.compactions = 0  # context compactions, counted as their events are relayed
        self.sandbox_available = False  # the daemon's probe at start found bwrap working
        self.tasks_removed = 0  # tasks removed ([retention], or a prune the daemon let go of)
        self.spool_bytes: int | None = None  # the spool's size, measured now and then
        self.checkpoint = Histogram(CHECKPOINT_BOUNDS)
        self.model_call = Histogram(CALL_BOUNDS)
        self.tool_call: dict[str, Histogram] = {}
        self.tokens = {kind: Histogram(TOKEN_BOUNDS) for kind in TOKEN_TYPES}
        self.cost: dict[str, Decimal] = {}  # USD by model, exact until it is exposed
        self._seen: dict[str, tuple[int, dict[str, Any]]] = {}  # task: (pid, last metrics)
        self._held: dict[str, tuple[str, int]] = {}  # task: (record updated_at, held calls)

    def removed(self) -> None:
        """A task was removed from the spool (``agentd_tasks_removed_total``)."""
        self.tasks_removed += 1

    # -- folding workers' heartbeats ------------------------------------------------------

    def fold(self, task: str, beat: Mapping[str, Any]) -> None:
        """Add what the histograms in ``beat`` (a ``read_heartbeat`` of the task's
        current worker) grew by since the last beat of the same worker."""
        data, pid = beat.get("metrics"), beat.get("pid")
        if (
            not isinstance(data, dict)
            or data.get("v") != METRICS_VERSION
            or not isinstance(pid, int)
        ):
            return
        seen_pid, seen = self._seen.get(task, (None, {}))
        before = seen if seen_pid == pid else {}
        self._add(self.checkpoint, data.get("checkpoint"), before.get("checkpoint"))
        self._add(self.model_call, data.get("model_call"), before.get("model_call"))
        tools, tools_before = _table(data.get("tool_call")), _table(before.get("tool_call"))
        for name, hist in tools.items():
            if not _TOOL_NAME.fullmatch(str(name)):
                continue
            target = self.tool_call.get(name)
            if target is None:
                if len(self.tool_call) >= MAX_TOOLS:
                    continue
                target = self.tool_call[name] = Histogram(CALL_BOUNDS)
            self._add(target, hist, tools_before.get(name))
        tokens, tokens_before = _table(data.get("tokens")), _table(before.get("tokens"))
        for kind in TOKEN_TYPES:
            self._add(self.tokens[kind], tokens.get(kind), tokens_before.get(kind))
        self._spent(spend_from_json(data.get("spend")), spend_from_json(before.get("spend")))
        self._seen[task] = (pid, data)

    def _spent(self, now: Mapping[str, Usage], before: Mapping[str, Usage]) -> None:
        """Price what a worker's replies grew by, per model (all of it: a new worker)."""
        prices = self.prices()
        for model, usage in now.items():
            if not _MODEL_NAME.fullmatch(model):
                continue
            if model not in self.cost and len(self.cost) >= MAX_MODELS:
                continue
            grown = _usage_growth(usage, before.get(model))
            amount = cost({model: grown}, prices)
            if amount:  # (None: no price; nothing to add)
                self.cost[model] = self.cost.get(model, Decimal(0)) + amount

    @staticmethod
    def _add(target: Histogram, now: Any, before: Any) -> None:
        current = _shaped(now, target.bounds)
        if current is not None:
            target.add(*_growth(current, _shaped(before, target.bounds)))

    def forget(self, task: str) -> None:
        """The task's worker has ended and its last beat is folded."""
        self._seen.pop(task, None)

    # -- sampling -------------------------------------------------------------------------

    def held_calls(self, task: TaskDir, updated_at: str) -> int:
        """The held calls of a held task, read again only when its record changed (a hold
        is written once: replaying the journal at every scrape would cost the most)."""
        cached = self._held.get(task.id)
        if cached is None or cached[0] != updated_at:
            try:
                count = len(held_calls(task))
            except Exception:  # any spool content: the scrape goes on
                count = 0
            cached = self._held[task.id] = (updated_at, count)
        return cached[1]

    def sample(
        self,
        states: Mapping[str, int],
        held: list[tuple[TaskDir, str]],
        *,
        nodes: int | None = None,
    ) -> Sample:
        """The values of a scrape; ``held``: each held task and its record's updated_at;
        ``nodes``: the live nodes of a shared store (None: the spool's files)."""
        now = datetime.now().astimezone()
        oldest = 0.0
        for _, updated_at in held:
            with contextlib.suppress(ValueError):
                oldest = max(oldest, (now - datetime.fromisoformat(updated_at)).total_seconds())
        held_ids = {task.id for task, _ in held}
        for gone in [t for t in self._held if t not in held_ids]:
            del self._held[gone]
        return Sample(
            tasks={state: states.get(state, 0) for state in TaskStatus},
            dangling_held=sum(self.held_calls(task, updated) for task, updated in held),
            oldest_hold_seconds=oldest,
            restarts=self.restarts,
            crash_loops=self.crash_loops,
            storage_faults=self.storage_faults,
            compactions=self.compactions,
            checkpoint=self.checkpoint.copy(),
            model_call=self.model_call.copy(),
            tool_call={name: h.copy() for name, h in self.tool_call.items()},
            tokens={kind: h.copy() for kind, h in self.tokens.items()},
            cost_usd={model: float(amount) for model, amount in self.cost.items()},
            lease_lost=self.lease_lost if nodes is not None else None,
            nodes=nodes,
            sandbox_available=self.sandbox_available,
            tasks_removed=self.tasks_removed,
            spool_bytes=self.spool_bytes,
        )


def families(sample: Sample) -> Iterator[Metric]:
    """The exposition of one sample."""
    from prometheus_client.core import (  # noqa: PLC0415  (only a daemon with [metrics] loads it)
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    states = GaugeMetricFamily("agentd_tasks", "Tasks by state.", labels=["state"])
    for state, count in sample.tasks.items():
        states.add_metric([state], count)
    yield states
    yield GaugeMetricFamily(
        "agentd_dangling_held",
        "Dangling calls of held tasks that wait for an operator's decision.",
        value=sample.dangling_held,
    )
    yield GaugeMetricFamily(
        "agentd_oldest_hold_seconds",
        "Seconds the longest-held task has waited for a decision (0: none is held).",
        value=sample.oldest_hold_seconds,
    )
    yield GaugeMetricFamily(
        "agentd_sandbox_available",
        "1 when run_command runs under bubblewrap (probed at start), 0 when it runs bare.",
        value=int(sample.sandbox_available),
    )
    counters = (
        ("agentd_worker_restarts", "Worker restarts the daemon scheduled.", sample.restarts),
        ("agentd_crash_loops", "Tasks failed with reason crash_loop.", sample.crash_loops),
        ("agentd_storage_faults", "Storage-fault episodes met.", sample.storage_faults),
        ("agentd_compactions", "Context compactions.", sample.compactions),
        ("agentd_tasks_removed", "Ended tasks removed (retention, prune).", sample.tasks_removed),
    )
    for name, documentation, value in counters:
        yield CounterMetricFamily(name, documentation, value=value)
    yield GaugeMetricFamily(
        "agentd_spool_bytes",
        "Bytes the spool's files take (measured every few minutes; NaN before the first).",
        value=math.nan if sample.spool_bytes is None else sample.spool_bytes,
    )
    if sample.lease_lost is not None:
        yield CounterMetricFamily(
            "agentd_lease_lost",
            "Tasks another node took over from this one (their lease moved).",
            value=sample.lease_lost,
        )
    if sample.nodes is not None:
        yield GaugeMetricFamily(
            "agentd_nodes", "Nodes alive on the shared store.", value=sample.nodes
        )

    def histogram(name: str, documentation: str, hist: Histogram) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            name, documentation, buckets=hist.buckets(), sum_value=hist.sum, unit="seconds"
        )

    yield histogram(
        "agentd_checkpoint_seconds", "Cost of each durable journal write.", sample.checkpoint
    )
    yield histogram(
        "agentd_model_call_seconds", "Model calls, retries included.", sample.model_call
    )
    tools = HistogramMetricFamily(
        "agentd_tool_call_seconds", "Tool calls, by tool.", labels=["tool"], unit="seconds"
    )
    for name, hist in sorted(sample.tool_call.items()):
        tools.add_metric([name], hist.buckets(), hist.sum)
    yield tools
    tokens = HistogramMetricFamily(
        "gen_ai_client_token_usage",
        "Tokens of each model call (OpenTelemetry gen_ai.client.token.usage).",
        labels=["gen_ai_operation_name", "gen_ai_token_type"],
    )
    for kind, hist in sample.tokens.items():
        tokens.add_metric(["chat", kind], hist.buckets(), hist.sum)
    yield tokens
    spent = CounterMetricFamily(
        "agentd_cost_usd",
        "US dollars of the model calls made, by model, at the price table.",
        labels=["model"],
    )
    for model, amount in sorted(sample.cost_usd.items()):
        spent.add_metric([model], amount)
    yield spent


def listen_error(key: str, listen: str, exc: OSError) -> AgentdError:
    """The one line of a listener (``key = listen``) that could not bind: its address is
    in use (``AddressInUseError``, exit 1), or it is not an address of this machine, or
    not one this user may bind (``ConfigError``, exit 78)."""
    why = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        return AddressInUseError(
            f"{key} = {listen!r}: another process listens there ({why}); stop it or pick "
            "another port, then start again."
        )
    return ConfigError(
        f"{key} = {listen!r} cannot be listened on ({why}); give an address of this "
        'machine, such as "127.0.0.1:9464", and a port this user may bind, then start again.'
    )


class MetricsServer:
    """``/metrics`` on ``(host, port)``, served by ``prometheus_client`` in a thread; each
    scrape takes its sample with ``take`` on ``loop`` (the daemon's)."""

    def __init__(
        self,
        address: tuple[str, int],
        loop: asyncio.AbstractEventLoop,
        take: Callable[[], Sample],
    ) -> None:
        self.address = address
        self._loop = loop
        self._take = take
        self._last: Sample | None = None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve; an OSError (the port is taken, the address is not this host's)
        is the caller's to report."""
        if "ssl" in sys.modules and sys.modules["ssl"] is None:
            del sys.modules["ssl"]  # kept out by `agentd start`; prometheus_client needs it
        from prometheus_client import CollectorRegistry, make_wsgi_app  # noqa: PLC0415  (after `ssl`)
        from prometheus_client.registry import Collector  # noqa: PLC0415  (the same)

        server = self

        class SpoolCollector(Collector):
            def collect(self) -> Iterator[Metric]:
                sample = server.sample()
                return families(sample) if sample is not None else iter(())

        registry = CollectorRegistry(auto_describe=False)
        registry.register(SpoolCollector())
        host, port = self.address
        self._server = _bounded_server(host, port, make_wsgi_app(registry))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    def sample(self) -> Sample | None:
        """A fresh sample from the loop (from the server's thread), or the last one when
        the loop does not answer in ``SAMPLE_PATIENCE``."""
        future: concurrent.futures.Future[Sample] = concurrent.futures.Future()

        def take() -> None:
            try:
                future.set_result(self._take())
            except Exception as exc:  # the scrape gets the last sample
                future.set_exception(exc)

        # the loop is closed (RuntimeError), busy (TimeoutError), or the sample failed
        with contextlib.suppress(Exception):
            self._loop.call_soon_threadsafe(take)
            self._last = future.result(timeout=SAMPLE_PATIENCE)
        return self._last

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=1)
            self._thread = None


def _bounded_server(host: str, port: int, app: Any) -> WSGIServer:
    """A WSGI server on ``(host, port)`` within the bounds above (the module docstring)."""
    import socket  # noqa: PLC0415  (only a daemon with [metrics] serves)
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer  # noqa: PLC0415  (the same)

    class Handler(WSGIRequestHandler):
        timeout = CONNECTION_TIMEOUT  # each read and write of the connection

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape is no event of the daemon's

    class Server(WSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def __init__(self) -> None:
            self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                HANDLER_THREADS, thread_name_prefix="metrics"
            )
            super().__init__((host, port), Handler)  # (a failed bind calls server_close)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self._slots.acquire(blocking=False):
                self.shutdown_request(request)  # past the limit: closed at once
                return
            self._pool.submit(self._answer, request, client_address)

        def _answer(self, request: Any, client_address: Any) -> None:
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: S110  (a client gone, a timeout: its own business)
                pass
            finally:
                self.shutdown_request(request)
                self._slots.release()

        def server_close(self) -> None:
            super().server_close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    server = Server()
    server.set_app(app)
    return server
