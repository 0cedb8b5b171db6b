"""A worker's step timings and token counts, published through its heartbeat.

The daemon serves Prometheus metrics (``supervisor/metrics.py``); what only a worker can
measure (the cost of recording a step, of a model call, of each tool call, the tokens of
each reply) reaches it through the spool, not through a scrape target per worker: each
worker keeps running histograms here, in memory, and ``worker.heartbeat`` writes them into
every beat (``heartbeat.json``, field ``metrics``) and once more when the worker ends. The
daemon folds the growth it sees per worker pid into its own histograms.

The cost on the loop is a ``perf_counter`` pair and ``observe``: a bisect and two adds
under a lock the heartbeat thread shares. Nothing here reads a prompt, a tool's input or
output, or a secret: only durations, token counts and tool names.

The shape, ``MetricsSnapshot``: ``{"v": METRICS_VERSION, "checkpoint": H, "model_call": H,
"tool_call": {TOOL: H}, "tokens": {"input": H, "output": H}, "spend": {MODEL: USAGE}}``
with ``H = {"b": [count per bucket, the last one +Inf], "s": sum}`` and ``USAGE`` the
tokens of every reply of that model this worker received (``Usage.to_json``: what the
daemon prices into ``agentd_cost_usd_total``; a reply received and then lost to a kill
before it was recorded was paid for all the same). Each count is its own bucket's (not
cumulative over the bounds, as Prometheus's ``le`` is) and only grows for the worker's life,
so a count that went down can only mean another process. The bounds are the constants
below, which both sides import.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

from worker.models.base import Usage

#: The version of the ``metrics`` field of a heartbeat; the daemon ignores another.
METRICS_VERSION = 1

#: Upper bounds (seconds) of a journal write's buckets: a write without sync takes tens of
#: microseconds, an fdatasync a millisecond on an SSD, much more on a busy disk.
CHECKPOINT_BOUNDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
#: Upper bounds (seconds) of model and tool calls: from a scripted reply to a long build.
CALL_BOUNDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: Token buckets of OpenTelemetry's ``gen_ai.client.token.usage`` (its advice: powers of 4).
TOKEN_BOUNDS = tuple(float(4**n) for n in range(14))
#: The ``gen_ai.token.type`` values.
TOKEN_TYPES = ("input", "output")


class Histogram:
    """Counts per bucket and a sum: Prometheus's histogram, without its library."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_json(self) -> dict[str, Any]:
        return {"b": list(self.counts), "s": self.sum}


class StepMetrics:
    """A worker's histograms, observed by the loop and read by the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checkpoint = Histogram(CHECKPOINT_BOUNDS)
        self.model_call = Histogram(CALL_BOUNDS)
        self.tool_call: dict[str, Histogram] = {}
        self.tokens = {kind: Histogram(TOKEN_BOUNDS) for kind in TOKEN_TYPES}
        self.spend: dict[str, Usage] = {}  # by model: every reply received

    def checkpointed(self, seconds: float) -> None:
        """One durable record written (``Recorder.record``)."""
        with self._lock:
            self.checkpoint.observe(seconds)

    def model_called(self, seconds: float, model: str, usage: Usage) -> None:
        """One model call answered, retries included, and the tokens of its reply."""
        prompt = usage.input_tokens + usage.cache_creation_input_tokens
        prompt += usage.cache_read_input_tokens
        with self._lock:
            self.model_call.observe(seconds)
            self.tokens["input"].observe(prompt)
            self.tokens["output"].observe(usage.output_tokens)
            self.spend[model] = self.spend.get(model, Usage()) + usage

    def tool_called(self, tool: str, seconds: float) -> None:
        with self._lock:
            histogram = self.tool_call.get(tool)
            if histogram is None:
                histogram = self.tool_call[tool] = Histogram(CALL_BOUNDS)
            histogram.observe(seconds)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "v": METRICS_VERSION,
                "checkpoint": self.checkpoint.to_json(),
                "model_call": self.model_call.to_json(),
                "tool_call": {name: h.to_json() for name, h in self.tool_call.items()},
                "tokens": {kind: h.to_json() for kind, h in self.tokens.items()},
                "spend": {model: usage.to_json() for model, usage in self.spend.items()},
            }
