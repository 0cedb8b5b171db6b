"""The model's half of the agent loop: a request, a call, a recorded turn, and compaction.

``ModelTurns.call`` builds the request from the transcript, asks the model (retried on
retryable faults, ``worker.models.retry``), and records the reply as one ``turn`` record
once it has fully arrived, so a retried or interrupted call records nothing and counts no
usage. Before every call the task's budget is checked (``BudgetReached``: nothing is
recorded for the call it would have made).

A transcript that outgrows ``[context] window`` is compacted at a turn boundary
(``compact``, the pure half in ``worker.compaction``): one summary call, then a
``compaction`` record, synced before the next model call reads the transcript it makes.
A crash before the record only means the summary call is made again. With ``[context]
strategy = "server"`` on a backend that offers it, the API compacts instead, in the
request itself: its compaction block comes back as a turn (``stop_reason``
``compaction``), recorded like any other, and the loop goes on from it.

``StopSignal`` is SIGTERM's (and SIGINT's) flag: a stop is immediate only while the worker
waits on the model (``StopRequested`` out of the call; nothing is recorded then); else
the loop reads it between steps.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from types import FrameType

from worker import compaction
from worker.budget import TaskBudget
from worker.config import Config
from worker.errors import ContextTooLongError, ModelError
from worker.events import Event
from worker.metrics import StepMetrics
from worker.models.base import (
    Model,
    ModelReply,
    ModelRequest,
    SummaryOf,
    offers_server_compaction,
)
from worker.models.retry import call_with_retries
from worker.recorder import Recorder
from worker.records import CallOutcome, CompactionRecord, RecordKind, ResultRecord, TurnRecord
from worker.spans import ChatSpan, RunSpans
from worker.spool import TaskSpec
from worker.tools.registry import ToolRegistry


class StopRequested(BaseException):
    """Raised out of a model call when SIGTERM asks the worker to stop."""


class StopSignal:
    """Whether SIGTERM (or SIGINT) asked the worker to stop (``requested``): at once
    while the worker waits on the model (``interruptible``), else at the loop's next safe
    point."""

    def __init__(self) -> None:
        self.requested = False
        self._interruptible = False

    def install(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            self.requested = True
            if self._interruptible:
                self._interruptible = False
                raise StopRequested

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block a stop ends at once (``StopRequested``), as one asked before it does."""
        self._interruptible = True
        try:
            if self.requested:
                raise StopRequested
            yield
        finally:
            self._interruptible = False


class ModelTurns:
    """Asks ``model`` for the next turn of ``spec``'s task and records it on ``recorder``;
    compacts the transcript when it is due (``compaction_due``) or when the model says it
    no longer fits."""

    def __init__(
        self,
        recorder: Recorder,
        spec: TaskSpec,
        config: Config,
        model: Model,
        budget: TaskBudget,
        stop: StopSignal,
        *,
        metrics: StepMetrics,
        spans: RunSpans | None,
        sleep: Callable[[float], None],
    ) -> None:
        self.recorder = recorder
        self.spec = spec
        self.config = config
        self.model = model
        self.budget = budget
        self.stop = stop
        self.metrics = metrics
        self.spans = spans
        self.sleep = sleep
        #: [context] strategy "server" on a backend that offers it: the API compacts
        self.server_compacts = config.context.strategy == "server" and (
            offers_server_compaction(model)
        )

    @property
    def model_name(self) -> str:
        return self.spec.model or self.config.model.name

    def request(self, tools: ToolRegistry) -> ModelRequest:
        name = self.model_name
        return ModelRequest(
            model=name,
            max_tokens=self.spec.max_tokens or self.config.model.max_tokens,
            messages=self.recorder.state.transcript(),
            system=self.spec.system,
            tools=[t.api_definition() for t in tools],
            compact_trigger=self.config.context.threshold_for(name)
            if self.server_compacts
            else None,
        )

    def ask(self, request: ModelRequest, phase: str) -> ModelReply:
        """One model call, retried on retryable faults, interruptible by SIGTERM; first,
        the budget (``BudgetReached``: nothing is recorded for this call)."""
        recorder = self.recorder
        self.budget.check(recorder.state.spend_total)
        recorder.phase(phase)
        heartbeat = recorder.heartbeat

        def on_retry(exc: Exception, attempt: int, delay: float) -> None:
            recorder.event(
                Event.MODEL_RETRY, level="warning", attempt=attempt, delay=delay, error=str(exc)
            )
            recorder.phase(phase)  # a retry is progress: the deadline covers one attempt
            if heartbeat:  # what status shows as the task's REASON meanwhile
                retry = {"error": str(exc), "attempt": attempt, "next_try": time.time() + delay}
                heartbeat.update(retry=retry)

        recorder.writer.sync_in_background()  # the last result becomes durable meanwhile
        started = time.perf_counter()
        try:
            with self.stop.interruptible(), self._chat_span(request, phase) as span:
                reply = call_with_retries(
                    self.model,
                    request,
                    turn_index=recorder.state.turn,
                    on_retry=on_retry,
                    sleep=self.sleep,
                )
                if span is not None:
                    span.reply = reply
        finally:
            if heartbeat:
                heartbeat.update(retry=None)
        self.metrics.model_called(time.perf_counter() - started, reply.model, reply.usage)
        recorder.phase("idle")
        return reply

    def _chat_span(
        self, request: ModelRequest, phase: str
    ) -> AbstractContextManager[ChatSpan | None]:
        """The model call's ``chat`` span (``worker.spans``), or nothing when traces are off;
        what it captures of the input is the message this call adds (the rest was sent
        before)."""
        if self.spans is None:
            return contextlib.nullcontext()
        purpose = "compaction" if phase == "compaction" else "turn"
        added = request.messages[-1:] if request.messages else []
        return self.spans.chat(request.model, purpose, added)

    def call(self, tools: ToolRegistry) -> None:
        """Ask for the next turn, offering ``tools``, and record it."""
        state = self.recorder.state
        try:
            reply = self.ask(self.request(tools), "model")
            if reply.stop_reason == "model_context_window_exceeded":
                # cut off by the window: not recorded (like an interrupted call), retried
                raise ContextTooLongError("the reply hit the model's context window")
        except ContextTooLongError as exc:
            if state.compacted_at(state.turn) or not self.compact("too_long", tools):
                raise ModelError(f"{exc}: {self._too_long_advice()}") from None
            return  # the loop asks again, on the compacted transcript
        message = {"role": "assistant", "content": reply.content}
        turn: TurnRecord = {
            "k": RecordKind.TURN,
            "turn": state.turn + 1,
            "message": message,
            "stop_reason": reply.stop_reason,
            "usage": reply.usage.to_json(),
            "model": reply.model,
        }
        if reply.context_tokens is not None:
            turn["tokens_used"] = reply.context_tokens
        if reply.id:
            turn["id"] = reply.id
        records: list[TurnRecord | ResultRecord] = [turn]
        if reply.stop_reason == "max_tokens":  # tool input may be cut: never run it
            records += [
                {
                    "k": RecordKind.RESULT,
                    "call_id": b["id"],
                    "content": "not executed: the reply was cut off at max_tokens",
                    "is_error": True,
                    "outcome": CallOutcome.NOT_RUN,
                }
                for b in reply.content
                if b.get("type") == "tool_use"
            ]
        # A tool_use reply is followed at once by its first call's intent: the turn is
        # written and made durable with it, before any tool acts, which is what matters
        # (a kill before that only means the model is asked again).
        if reply.stop_reason == "tool_use":
            self.recorder.record(*records, hold=True)
        else:
            self.recorder.record(*records)
        if any(block.get("type") == "compaction" for block in reply.content):
            # the API compacted the transcript as it answered: counted as the client's are
            # (status, ``agentd_compactions_total`` from this event)
            self.recorder.event(
                Event.COMPACTION, strategy="server", tokens_after=reply.context_tokens
            )

    # -- compaction --------------------------------------------------------------------

    def compaction_due(self) -> bool:
        """``tokens_used`` is at or past ``[context] compact_at`` of the window, and this
        boundary was not compacted yet (a compaction's own estimate may still be over);
        never when the API compacts (it would always come first, at the same threshold)."""
        if self.server_compacts:
            return False
        state = self.recorder.state
        threshold = self.config.context.threshold_for(self.model_name)
        return state.tokens_used >= threshold and not state.compacted_at(state.turn)

    def compact(self, trigger: str, tools: ToolRegistry) -> bool:
        """Summarise the transcript but its last ``keep_turns`` turns and record the
        ``compaction``; False when there is nothing to summarise."""
        context = self.config.context
        state = self.recorder.state
        messages = state.transcript()
        at = compaction.cut(messages, context.keep_turns)
        if at is None:
            return False
        kept = sum(m["role"] == "assistant" for m in messages[at:])
        last = state.turn - kept
        first = last - sum(m["role"] == "assistant" for m in messages[:at]) + 1
        asked = compaction.summary_messages(
            messages[:at], compaction.instruction(context.instructions)
        )
        request = replace(
            self.request(tools),
            messages=asked,
            summary=SummaryOf(len(state.live_compactions()), first, last),
            compact_trigger=None,  # a summary call summarises: the API must not compact it
        )
        try:
            reply = self.ask(request, "compaction")
        except ContextTooLongError as exc:
            raise ModelError(
                f"{exc}: the part of the transcript to summarise does not fit either; "
                f"{self._too_long_advice()}"
            ) from None
        summary = compaction.summary_text(reply.content)
        before = state.tokens_used
        after = compaction.estimate_tokens(
            before, messages, compaction.compacted(state.prompt, summary, messages[at:])
        )
        record: CompactionRecord = {
            "k": RecordKind.COMPACTION,
            "summary": summary,
            "keep": len(messages) - at,
            "first": first,
            "last": last,
            "usage": reply.usage.to_json(),
            "model": reply.model,
            "tokens_before": before,
            "tokens_after": after,
            "trigger": trigger,
        }
        if reply.id:
            record["id"] = reply.id
        self.recorder.record(record)
        self.recorder.event(
            Event.COMPACTION,
            strategy="client",
            first=first,
            last=last,
            tokens_before=before,
            tokens_after=after,
            trigger=trigger,
        )
        return True

    def _too_long_advice(self) -> str:
        context = self.config.context
        return (
            "the transcript does not fit the model's context window, and compaction cannot "
            "make it fit; "
            f"lower [context] keep_turns (now {context.keep_turns}) or [model] max_tokens, "
            "or rewind the task to an earlier turn, and run `agentd retry TASK`"
        )
