"""A real OTLP trace receiver for the tests: a collector on 127.0.0.1 that decodes every
``ExportTraceServiceRequest`` it is sent with ``opentelemetry-proto``, over HTTP
(``POST /v1/traces``, protobuf, gzip or not) or gRPC (``TraceService/Export``), and keeps
each span as plain data (``Received``) with the headers it came with.

``hang=True`` makes a collector that takes each request and never answers (the exporter's
timeout is all that ends the call): what a collector stuck behind a dead proxy does.
``unreachable_endpoint()`` names a port where nothing listens.
"""

from __future__ import annotations

import gzip
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

JSON = dict[str, Any]


@dataclass
class Received:
    """One span as the collector got it."""

    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    start: int
    end: int
    attributes: JSON
    events: list[tuple[str, int, JSON]]
    links: list[tuple[str, str]]
    status: int  # 0 unset, 1 ok, 2 error
    description: str
    resource: JSON
    scope: tuple[str, str, str]  # name, version, schema_url


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(data: bytes) -> list[Received]:
    """Every span of one ``ExportTraceServiceRequest``."""
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(data)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            where = (scope.name, scope.version, scope_spans.schema_url)
            for span in scope_spans.spans:
                spans.append(
                    Received(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        start=span.start_time_unix_nano,
                        end=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[
                            (
                                e.name,
                                e.time_unix_nano,
                                {a.key: _value(a.value) for a in e.attributes},
                            )
                            for e in span.events
                        ],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        status=span.status.code,
                        description=span.status.message,
                        resource=resource,
                        scope=where,
                    )
                )
    return spans


@dataclass
class OTLPReceiver:
    """The collector; use as a context manager. ``endpoint`` is its base URL."""

    protocol: str = "http/protobuf"
    hang: bool = False
    spans: list[Received] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    requests: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._release = threading.Event()  # set at close: a hanging collector lets go
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _got(self, spans: list[Received], headers: dict[str, str]) -> None:
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)
            self.headers.append(headers)

    def __enter__(self) -> OTLPReceiver:
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)

    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if receiver.hang:
                    receiver._release.wait(60)
                    return
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._got(decode(body), {k.lower(): v for k, v in self.headers.items()})
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._http = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def _start_grpc(self) -> None:
        import concurrent.futures

        import grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self, request: Any, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                if receiver.hang:
                    receiver._release.wait(60)
                headers = {k.lower(): v for k, v in context.invocation_metadata()}
                receiver._got(decode(request.SerializeToString()), headers)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        add = trace_service_pb2_grpc.add_TraceServiceServicer_to_server  # (generated: unannotated)
        add(Service(), server)  # type: ignore[no-untyped-call]
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._grpc = server

    def received(self) -> list[Received]:
        with self._lock:
            return list(self.spans)

    def named(self, prefix: str) -> list[Received]:
        return [s for s in self.received() if s.name.startswith(prefix)]


def unreachable_endpoint() -> str:
    """A base URL where nothing listens (a port bound and closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
