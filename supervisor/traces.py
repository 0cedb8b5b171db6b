"""Traces exported over OTLP (docs/design.md section 14): what workers record, the daemon
(or ``agentd run``) sends.

Workers write each span that ended as a line of their task's events (``worker.spans``);
the daemon's relay reads every line of those files once, in order (``supervisor.relay``),
and hands each to a ``TraceAssembler``:

* a span that ended (a ``chat``, an ``execute_tool``, a run's closed ``invoke_agent``) is
  exported as it is;
* a run's open ``invoke_agent`` is kept until the same span comes closed, or until its
  worker's exit is seen (``worker_exited``, whoever logged it): then it is exported ended
  at that exit, status ERROR, as is a run left open when a newer run of the task starts
  (its exit was never seen: the daemon was down), ended at the last time it was heard of;
* a lifecycle event of the task (restarts, holds, decisions, compactions: ``SPAN_EVENTS``)
  becomes an event of the span of the run it happened in (the one its ``pid`` names, else
  the task's open run); one that came between runs (a decision, a restart scheduled) is
  an event of the next run's span.

``TraceExporter`` is the one place the OpenTelemetry SDK is imported, and only when traces
are on (``export_settings``): a daemon without ``[telemetry]`` never loads it, and no worker
ever does. Spans go through the SDK's ``BatchSpanProcessor``: ``export`` only queues one
(a slow or absent collector never slows the loop), the queue is bounded and drops what
does not fit, and each export has a timeout. The exporter's headers, a secret, come from
the held credentials (``worker.credentials.OTLP_HEADERS``), never from a file or a worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from supervisor.relay import TaskEvents
from worker import __version__, credentials
from worker.config import OTLP_PROTOCOLS, TelemetryConfig
from worker.events import Event
from worker.spans import (
    ENDPOINT_ENV,
    SCHEMA_URL,
    SPAN_EVENT,
    TRACES_ENDPOINT_ENV,
    telemetry_on,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

JSON = dict[str, Any]

#: Lifecycle events that become events of the run's span.
SPAN_EVENTS = frozenset(
    {
        Event.TASK_RESUMED,
        Event.RESTART_SCHEDULED,
        Event.WORKER_EXITED,
        Event.WORKER_HUNG,
        Event.WORKER_STALLED,
        Event.WORKER_KILLED,
        Event.DANGLING_HELD,
        Event.DANGLING_DECIDED,
        Event.DANGLING_RERUN,
        Event.DANGLING_RECONCILED,
        Event.BUDGET_EXHAUSTED,
        Event.BUDGET_CHANGED,
        Event.COMPACTION,
        Event.MODEL_RETRY,
        Event.TASK_REWOUND,
        Event.TASK_RETRIED,
        Event.LEASE_LOST,
    }
)
#: Events kept for a task's next run while none runs (the latest ones).
BETWEEN_KEPT = 64
#: Fields of an event line that are not the span event's attributes.
_NOT_ATTRIBUTES = frozenset({"event", "timestamp", "level", "task", "origin"})
#: The protocol variables (the traces' own first), and the default of each.
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
#: The export queue's bound and batch, and the seconds one export may take.
QUEUE_SIZE = 4096
BATCH_SIZE = 512
EXPORT_TIMEOUT = 5.0


@dataclass
class Finished:
    """A span ready to export: a span line's fields, its events added."""

    trace_id: str
    span_id: str
    parent: str | None
    name: str
    kind: str
    start: int
    end: int
    attributes: JSON
    status: str
    description: str | None = None
    events: list[tuple[str, int, JSON]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)


def _ns(timestamp: Any) -> int | None:
    """An event's ISO 8601 ``timestamp`` in nanoseconds since the epoch."""
    try:
        when = datetime.fromisoformat(str(timestamp))
    except ValueError:
        return None
    return int(when.timestamp()) * 1_000_000_000 + when.microsecond * 1000


def _hex(value: Any, size: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == size
        and all(c in "0123456789abcdef" for c in value)
    )


def _span_of(data: Any) -> JSON | None:
    """A span line's span when it has the shape ``worker.spans`` writes (events are
    spool content: anything else is dropped)."""
    if not isinstance(data, dict):
        return None
    if not (_hex(data.get("trace_id"), 32) and _hex(data.get("span_id"), 16)):
        return None
    if data.get("parent") is not None and not _hex(data.get("parent"), 16):
        return None
    if not isinstance(data.get("start"), int) or not isinstance(data.get("attributes"), dict):
        return None
    if data.get("end") is not None and not isinstance(data.get("end"), int):
        return None
    return data


def _attributes(event: Mapping[str, Any]) -> JSON:
    """The scalar fields of an event line, as a span event's attributes."""
    return {
        f"agentd.{k}": v
        for k, v in event.items()
        if k not in _NOT_ATTRIBUTES and isinstance(v, str | int | float | bool)
    }


@dataclass
class _Run:
    span: JSON
    events: list[tuple[str, int, JSON]] = field(default_factory=list)
    heard: int = 0  # ns: the last time anything of it was seen


class TraceAssembler:
    """Turns the lines of tasks' events into finished spans, handed to ``export``."""

    def __init__(self, export: Callable[[Finished], None]) -> None:
        self._export = export
        self._open: dict[str, dict[str, _Run]] = {}  # task -> run span id -> the open run
        self._between: dict[str, list[tuple[str, int, JSON]]] = {}  # events between runs

    def take(self, task: str, event: Mapping[str, Any]) -> None:
        """One line of ``task``'s events, in the file's order."""
        name = event.get("event")
        if name == SPAN_EVENT:
            span = _span_of(event.get("span"))
            if span is not None:
                self._span(task, span)
            return
        if name not in SPAN_EVENTS:
            return
        at = _ns(event.get("timestamp"))
        if at is None:
            return
        item = (str(name), at, _attributes(event))
        run = self._run_of(task, event.get("pid"))
        if run is None:
            between = self._between.setdefault(task, [])
            between.append(item)
            del between[:-BETWEEN_KEPT]  # (a task that never runs again keeps a few)
            return
        run.events.append(item)
        run.heard = max(run.heard, at)
        if name == Event.WORKER_EXITED and event.get("pid") == run.span.get("pid"):
            why = event.get("signal") or f"exit code {event.get('code')}"
            self._close(task, run, at, f"the worker ended before it closed its run ({why})")

    def forget(self, task: str) -> None:
        """The task left this daemon's view: its open runs are another node's to close."""
        self._open.pop(task, None)
        self._between.pop(task, None)

    def _run_of(self, task: str, pid: Any) -> _Run | None:
        runs = list(self._open.get(task, {}).values())
        mine = [r for r in runs if r.span.get("pid") == pid] or runs
        return mine[-1] if mine else None

    def _span(self, task: str, span: JSON) -> None:
        runs = self._open.setdefault(task, {})
        if span.get("span_id") != span.get("run"):  # a call's span: ended, exported
            run = runs.get(str(span.get("run")))
            if run is not None:
                run.heard = max(run.heard, int(span.get("end") or 0))
            self._emit(span, [])
            return
        if span.get("end") is None:  # a run starts
            for older in list(runs.values()):  # its exit was never seen: it ended unheard
                self._close(task, older, older.heard, "the worker ended unseen (no exit seen)")
            run = _Run(span, self._between.pop(task, []), int(span["start"]))
            runs[str(span["span_id"])] = run
            return
        run = runs.pop(str(span["span_id"]), None)  # a run closed by its worker
        self._emit(span, run.events if run is not None else self._between.pop(task, []))

    def _close(self, task: str, run: _Run, end: int, why: str) -> None:
        self._open.get(task, {}).pop(str(run.span["span_id"]), None)
        ended = {**run.span, "end": max(end, int(run.span["start"])), "status": "error"}
        ended["description"] = why
        self._emit(ended, run.events)

    def _emit(self, span: JSON, events: list[tuple[str, int, JSON]]) -> None:
        links = [
            (str(link.get("trace_id")), str(link.get("span_id")))
            for link in span.get("links") or []
            if isinstance(link, dict)
            and _hex(link.get("trace_id"), 32)
            and _hex(link.get("span_id"), 16)
        ]
        self._export(
            Finished(
                trace_id=str(span["trace_id"]),
                span_id=str(span["span_id"]),
                parent=span.get("parent"),
                name=str(span.get("name", "")),
                kind=str(span.get("kind", "internal")),
                start=int(span["start"]),
                end=int(span.get("end") or span["start"]),
                attributes=dict(span["attributes"]),
                status=str(span.get("status", "unset")),
                description=span.get("description"),
                events=list(events),
                links=links,
            )
        )


# -- the exporter ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSettings:
    """Where and how spans go: the OTLP endpoint as the exporter takes it (a URL ending
    in ``/v1/traces`` for http/protobuf, the collector's address for gRPC), the headers
    (a secret: never shown), and what the content of spans may carry."""

    endpoint: str
    protocol: str
    headers: Mapping[str, str] = field(repr=False, default_factory=dict)

    def __repr__(self) -> str:
        return f"ExportSettings({self.protocol} {self.endpoint})"


def export_settings(
    telemetry: TelemetryConfig,
    environ: Mapping[str, str] = os.environ,
    held: credentials.Credentials | None = None,
) -> ExportSettings | None:
    """The export the config and the environment ask for, or None (traces off). The
    environment wins over ``[telemetry]``: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as
    it is), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL), the protocols likewise; the
    headers are held secrets (``credentials.take_over`` moved them out of the
    environment)."""
    if not telemetry_on(telemetry.otlp_endpoint, environ):
        return None
    protocol = next(
        (environ[name].strip() for name in PROTOCOL_ENVS if environ.get(name, "").strip()),
        telemetry.otlp_protocol,
    )
    if protocol not in OTLP_PROTOCOLS:
        from worker.errors import ConfigError  # noqa: PLC0415  (an error path)

        raise ConfigError(
            f"the OTLP protocol {protocol!r} (from $OTEL_EXPORTER_OTLP_PROTOCOL) is not one "
            f"agentd speaks; use {' or '.join(OTLP_PROTOCOLS)}."
        )
    held = held if held is not None else credentials.held()
    headers = credentials.otlp_headers(held.get(credentials.OTLP_HEADERS) or "")
    headers |= credentials.otlp_headers(held.get(credentials.OTLP_TRACES_HEADERS) or "")
    if full := environ.get(TRACES_ENDPOINT_ENV, "").strip():
        return ExportSettings(full, protocol, headers)
    base = (environ.get(ENDPOINT_ENV, "").strip() or telemetry.otlp_endpoint).rstrip("/")
    endpoint = base if protocol == "grpc" else f"{base}/v1/traces"
    return ExportSettings(endpoint, protocol, headers)


class TraceExporter:
    """Finished spans to an OTLP collector, batched by the SDK on its own thread."""

    def __init__(self, settings: ExportSettings, *, service: str = "agentd") -> None:
        # Imported here: only a daemon (or `agentd run`) with traces on loads the SDK.
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: PLC0415

        self.settings = settings
        timeout = EXPORT_TIMEOUT
        # The SDK logs every failed batch (a collector away: one line a second); the
        # daemon's stream is for its tasks, and a collector's state is the collector's.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        if settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as GrpcExporter,
            )

            exporter: Any = GrpcExporter(
                endpoint=settings.endpoint,
                insecure=settings.endpoint.startswith("http://"),
                headers=dict(settings.headers),
                timeout=timeout,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as HttpExporter,
            )

            exporter = HttpExporter(
                endpoint=settings.endpoint, headers=dict(settings.headers), timeout=timeout
            )
        self.processor: BatchSpanProcessor = BatchSpanProcessor(
            exporter,
            max_queue_size=QUEUE_SIZE,
            max_export_batch_size=BATCH_SIZE,
            schedule_delay_millis=500,
            export_timeout_millis=int(timeout * 1000),
        )
        self.resource = Resource.create({"service.name": service, "service.version": __version__})
        self.scope = InstrumentationScope("agentd", __version__, SCHEMA_URL)
        self.exported = 0  # spans handed to the processor

    def export(self, span: Finished) -> None:
        """Queue ``span`` (never blocks: a full queue drops it)."""
        from opentelemetry.sdk.trace import Event, ReadableSpan  # noqa: PLC0415
        from opentelemetry.trace import (  # noqa: PLC0415
            Link,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
        )

        def context(trace: str, span_id: str) -> SpanContext:
            return SpanContext(
                int(trace, 16), int(span_id, 16), False, TraceFlags(TraceFlags.SAMPLED)
            )

        status = {
            "ok": Status(StatusCode.OK),
            "error": Status(StatusCode.ERROR, span.description),
        }.get(span.status, Status(StatusCode.UNSET))
        readable = ReadableSpan(
            name=span.name,
            context=context(span.trace_id, span.span_id),
            parent=context(span.trace_id, span.parent) if span.parent else None,
            resource=self.resource,
            attributes=span.attributes,
            events=[Event(name, attrs, at) for name, at, attrs in span.events],
            links=[Link(context(trace, sid)) for trace, sid in span.links],
            kind=SpanKind.CLIENT if span.kind == "client" else SpanKind.INTERNAL,
            status=status,
            start_time=span.start,
            end_time=span.end,
            instrumentation_scope=self.scope,
        )
        self.processor.on_end(readable)
        self.exported += 1

    def close(self, timeout: float = 3.0) -> None:
        """Send what is queued, waiting ``timeout`` seconds at most (a collector that hangs
        holds up no stop), then let the processor go."""
        done = threading.Event()

        def shut() -> None:
            with contextlib.suppress(Exception):
                self.processor.force_flush(int(timeout * 1000))
                # (the SDK's shutdown is not annotated)
                self.processor.shutdown()  # type: ignore[no-untyped-call]
            done.set()

        threading.Thread(target=shut, name="traces-close", daemon=True).start()
        done.wait(timeout + 1.0)


class TraceTail:
    """One task's events, read from where the last read ended into an assembler whose
    spans ``exporter`` sends: how ``agentd run`` exports its task's trace without a daemon
    (one that runs on the spool exports every task's, this one's too, through its relay)."""

    def __init__(self, store: TaskEvents, task_id: str, exporter: TraceExporter) -> None:
        self.store = store
        self.task_id = task_id
        self.exporter = exporter
        self.assembler = TraceAssembler(exporter.export)
        self.cursor = store.events_end(task_id)  # this run's lines on

    def pull(self) -> None:
        with contextlib.suppress(Exception):  # traces never cost a task its run
            events, self.cursor = self.store.read_events(self.task_id, self.cursor)
            for event in events:
                self.assembler.take(self.task_id, event)

    def close(self) -> None:
        self.pull()
        self.exporter.close()


def exporter_for(
    telemetry: TelemetryConfig, environ: Mapping[str, str] = os.environ
) -> TraceExporter | None:
    """The exporter the config and the environment ask for, or None (traces off); a
    ConfigError (exit 78) when traces are asked for and the SDK is not installed."""
    settings = export_settings(telemetry, environ)
    if settings is None:
        return None
    try:
        return TraceExporter(settings)
    except ImportError as exc:
        from worker.errors import ConfigError  # noqa: PLC0415  (an error path)

        raise ConfigError(
            f"traces are on ({settings!r}) but the OpenTelemetry SDK cannot be imported "
            f"({exc}); install agentd's otel extra (pip install 'agentd[otel]') or unset "
            "[telemetry] otlp_endpoint and $OTEL_EXPORTER_OTLP_ENDPOINT."
        ) from None
