"""Trace spans as a worker records them (docs/design.md section 14), with no OpenTelemetry
import and no exporter secret: the daemon exports them (``supervisor/traces.py``).

One task is one trace, whichever worker runs it, on whichever node: the trace id is a
hash of the task's identity (``trace_id``: its id and when it was made), so every run adds
to the same trace; a fork's is its own, with a link to its parent's. Each worker run is an
``invoke_agent`` span whose id is a hash of the task and the run (``RunSpans``: the node,
the pid, the start), and each model call a ``chat {model}`` span and each tool call an
``execute_tool {tool}`` span under it, with the GenAI semantic conventions' attributes
(version ``SEMCONV_VERSION``).

A span is written once it has ended, as one line of the task's events (``SPAN_EVENT``,
``{"span": SPAN}``), like any event: a kill -9 loses no span that ended. The run's span is
written twice: open when the run starts (no ``end``), closed when it ends; a worker killed
before it closes it leaves the open one, which the daemon closes at the worker's exit
(status ERROR). Lifecycle events of the run (``task_resumed``, holds, decisions,
compactions) become its span events on the daemon's side, from the same file.

``SPAN``: ``{"trace_id": 32 hex, "span_id": 16 hex, "parent": 16 hex or null, "name",
"kind": "internal" | "client", "start": ns, "end": ns or null, "attributes": {...},
"status": "ok" | "error" | "unset", "description"?, "links": [{"trace_id", "span_id"}],
"pid", "run": the run's span id}``. Prompt and tool text is in the attributes only with
``[telemetry] capture_content`` (what an event may carry is redacted all the same).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from worker.errors import StorageError
from worker.events import Event, EventSink, event_line
from worker.models.base import JSON, ModelReply, Usage
from worker.records import CallOutcome

#: The event name of a span line in a task's events (never logged by the relay).
SPAN_EVENT = Event.SPAN
#: The GenAI semantic conventions the attribute names follow: the last release of the
#: semantic conventions that held them (``gen_ai.provider.name`` since 1.37).
SEMCONV_VERSION = "1.41.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
#: ``gen_ai.provider.name`` of the Messages API, and of the embedded scripted model.
PROVIDER = "anthropic"
SCRIPTED_PROVIDER = "agentd.scripted"
#: The most of one text a captured attribute keeps (``capture_content``).
CAPTURE_LIMIT = 64 * 1024

#: The environment that turns traces on or off (docs/design.md section 14).
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
DISABLED_ENV = "OTEL_SDK_DISABLED"


def telemetry_on(endpoint: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether traces are on: an endpoint from ``[telemetry] otlp_endpoint`` or the
    environment, and ``OTEL_SDK_DISABLED`` not ``true``."""
    if environ.get(DISABLED_ENV, "").strip().lower() == "true":
        return False
    return bool(environ.get(TRACES_ENDPOINT_ENV) or environ.get(ENDPOINT_ENV) or endpoint)


def _digest(*parts: str, size: int) -> str:
    """``size`` bytes of a hash of ``parts``, as hex: never all zeros (an invalid id)."""
    data = hashlib.sha256("\0".join(parts).encode()).digest()[:size]
    return data.hex() if any(data) else "01" + data.hex()[2:]


def identity(task_id: str, created_at: str) -> str:
    """What names a task across every node and restart: its id and when it was made (two
    tasks of one id in two spools, or one made again, are two traces)."""
    return f"{task_id}\0{created_at}"


def trace_id(task_identity: str) -> str:
    """The task's trace id (32 hex digits)."""
    return _digest("agentd trace", task_identity, size=16)


def task_span_id(task_identity: str) -> str:
    """The span id a fork's link names in its parent's trace (16 hex digits)."""
    return _digest("agentd task", task_identity, size=8)


def span_line(span: JSON) -> JSON:
    """A span as a line of the task's events."""
    return event_line(SPAN_EVENT, "debug", span=span)


def _clip(text: str) -> str:
    return text if len(text) <= CAPTURE_LIMIT else text[:CAPTURE_LIMIT] + "…"


def _json(value: Any) -> str:
    return _clip(json.dumps(value, ensure_ascii=False, default=str))


def usage_attributes(usage: Usage) -> JSON:
    """``gen_ai.usage.*``: input tokens count the cache's too, as the conventions ask."""
    prompt = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    return {
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_creation_input_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cache_read_input_tokens,
    }


@dataclass
class RunSpans:
    """The spans of one worker run of one task, written to its events through ``sink``.

    ``parent_trace``: a fork's parent's identity, for the link. ``capture``: prompt and
    tool text in the attributes (``[telemetry] capture_content``)."""

    sink: EventSink
    task_id: str
    task_identity: str
    node: str
    capture: bool = False
    parent_identity: str | None = None
    provider: str = PROVIDER
    pid: int = field(default_factory=os.getpid)
    start: int = field(default_factory=time.time_ns)
    _calls: int = 0
    _attributes: JSON = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.trace = trace_id(self.task_identity)
        self.run = _digest(
            "agentd run", self.task_identity, self.node, str(self.pid), str(self.start), size=8
        )

    # -- the run --------------------------------------------------------------------------

    def run_started(self, model: str) -> None:
        """The run's ``invoke_agent`` span, open: what the daemon closes if the run dies."""
        self._attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.provider.name": self.provider,
            "gen_ai.agent.name": "agentd",
            "gen_ai.agent.id": self.task_id,
            "gen_ai.conversation.id": self.task_id,
            "gen_ai.request.model": model,
            "agentd.node": self.node,
            "process.pid": self.pid,
        }
        self._write(self._run_span(None, "unset"))

    def run_ended(self, state: str, reason: str, *, error: bool) -> None:
        """The run's span closed, with how it ended (``agentd.outcome``, the reason)."""
        self._attributes |= {"agentd.outcome": state, "agentd.reason": reason[:500]}
        span = self._run_span(time.time_ns(), "error" if error else "ok")
        if error:
            span["description"] = reason[:500]
        self._write(span)

    def _run_span(self, end: int | None, status: str) -> JSON:
        links = []
        if self.parent_identity is not None:
            parent = self.parent_identity
            links.append({"trace_id": trace_id(parent), "span_id": task_span_id(parent)})
        return self._span(
            f"invoke_agent {self.task_id}",
            span_id=self.run,
            parent=None,
            kind="internal",
            start=self.start,
            end=end,
            attributes=dict(self._attributes),
            status=status,
            links=links,
        )

    # -- model calls ----------------------------------------------------------------------

    @contextmanager
    def chat(self, model: str, purpose: str, new_input: Any) -> Iterator[ChatSpan]:
        """A ``chat {model}`` span around one model call (its retries within it): written
        when the call returns or fails, lost if the worker dies in it (it never ended)."""
        call = ChatSpan(model, purpose, time.time_ns())
        self._calls += 1
        try:
            yield call
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise  # a stop (SIGTERM) or an interruption: the call did not end
            call.error = type(exc).__name__
            raise
        finally:
            if call.reply is not None or call.error is not None:
                self._write(self._chat_span(call, new_input))

    def _chat_span(self, call: ChatSpan, new_input: Any) -> JSON:
        attributes: JSON = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": self.provider,
            "gen_ai.request.model": call.model,
            "agentd.call": call.purpose,  # "turn" or "compaction"
        }
        reply = call.reply
        if reply is not None:
            attributes |= {
                "gen_ai.response.model": reply.model,
                "gen_ai.response.finish_reasons": [reply.stop_reason],
                **usage_attributes(reply.usage),
            }
            if reply.id:
                attributes["gen_ai.response.id"] = reply.id
        if call.error is not None:
            attributes["error.type"] = call.error
        if self.capture:
            attributes["gen_ai.input.messages"] = _json(new_input)
            if reply is not None:
                attributes["gen_ai.output.messages"] = _json(
                    [{"role": "assistant", "parts": reply.content}]
                )
        return self._span(
            f"chat {call.model}",
            span_id=_digest(self.run, "chat", str(self._calls), size=8),
            parent=self.run,
            kind="client",
            start=call.start,
            end=time.time_ns(),
            attributes=attributes,
            status="error" if call.error else "unset",
        )

    # -- tool calls -----------------------------------------------------------------------

    def tool(
        self,
        name: str,
        call_id: str,
        *,
        start: int,
        effect: str | None,
        outcome: CallOutcome,
        error_type: str | None,
        arguments: Any = None,
        result: Any = None,
        attempt: int = 1,
    ) -> None:
        """An ``execute_tool {tool}`` span of a call that ended (ran, re-ran, reconciled,
        or refused before it ran: an unknown tool, an input it does not take)."""
        attributes: JSON = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "function",
            "agentd.effect": effect or "unknown",
            "agentd.outcome": outcome,
            "agentd.attempt": attempt,
        }
        if error_type is not None:
            attributes["error.type"] = error_type
        if self.capture:
            attributes["gen_ai.tool.call.arguments"] = _json(arguments)
            attributes["gen_ai.tool.call.result"] = _clip(str(result))
        self._write(
            self._span(
                f"execute_tool {name}",
                span_id=_digest(self.run, "tool", call_id, str(attempt), size=8),
                parent=self.run,
                kind="internal",
                start=start,
                end=time.time_ns(),
                attributes=attributes,
                status="error" if error_type else "unset",
            )
        )

    # -- writing --------------------------------------------------------------------------

    def _span(
        self,
        name: str,
        *,
        span_id: str,
        parent: str | None,
        kind: str,
        start: int,
        end: int | None,
        attributes: JSON,
        status: str,
        links: list[JSON] | None = None,
    ) -> JSON:
        return {
            "trace_id": self.trace,
            "span_id": span_id,
            "parent": parent,
            "name": name,
            "kind": kind,
            "start": start,
            "end": end,
            "attributes": attributes,
            "status": status,
            "links": links or [],
            "pid": self.pid,
            "run": self.run,
        }

    def _write(self, span: JSON) -> None:
        """One line of the task's events; a span that cannot be written (a full disk, the
        database away) is lost, as an event is: traces never stop a task."""
        with contextlib.suppress(OSError, StorageError):
            self.sink.append_event(self.task_id, span_line(span))


@dataclass
class ChatSpan:
    """One model call being made: its reply, or the error it ended with."""

    model: str
    purpose: str
    start: int
    reply: ModelReply | None = None
    error: str | None = None
