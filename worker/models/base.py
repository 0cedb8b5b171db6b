"""The seam between the agent loop and a model: the ``Model`` protocol and its data.

A backend turns a transcript into one assistant reply. It raises
``RetryableModelError`` for faults worth another attempt (the loop retries with capped
backoff and records nothing until a whole reply arrived) and ``ModelError`` for faults
that end the task. Replies are plain frozen data, ready to be journaled as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

JSON = dict[str, Any]


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    #: The part of ``cache_creation_input_tokens`` written to the 1-hour cache, which is
    #: priced apart (worker.budget); in JSON only when there is one.
    cache_creation_1h_input_tokens: int = 0

    def to_json(self) -> JSON:
        data: JSON = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
        }
        if self.cache_creation_1h_input_tokens:
            data["cache_creation_1h_input_tokens"] = self.cache_creation_1h_input_tokens
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Usage:
        return cls(
            input_tokens=int(data.get("input_tokens") or 0),
            output_tokens=int(data.get("output_tokens") or 0),
            cache_creation_input_tokens=int(data.get("cache_creation_input_tokens") or 0),
            cache_read_input_tokens=int(data.get("cache_read_input_tokens") or 0),
            cache_creation_1h_input_tokens=int(data.get("cache_creation_1h_input_tokens") or 0),
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_creation_input_tokens + other.cache_creation_input_tokens,
            self.cache_read_input_tokens + other.cache_read_input_tokens,
            self.cache_creation_1h_input_tokens + other.cache_creation_1h_input_tokens,
        )

    @property
    def context_tokens(self) -> int:
        """The size of the context this call saw plus what it wrote: ``tokens_used``."""
        return (
            self.input_tokens
            + self.cache_creation_input_tokens
            + self.cache_read_input_tokens
            + self.output_tokens
        )


@dataclass(frozen=True)
class SummaryOf:
    """What a compaction's summary call replaces: the task's ``index``-th compaction on
    its live branch (0-based), summarising turns ``first`` to ``last``."""

    index: int
    first: int
    last: int


@dataclass(frozen=True)
class ModelRequest:
    model: str
    max_tokens: int
    messages: Sequence[JSON]
    system: str | None = None
    tools: Sequence[JSON] = ()
    summary: SummaryOf | None = None  # set on a compaction's summary call, None on a turn
    #: ``[context] strategy = "server"`` on a backend that offers it: the input tokens at
    #: which the API compacts the transcript itself; None: it never does
    compact_trigger: int | None = None


@dataclass(frozen=True)
class ModelReply:
    content: list[JSON]
    stop_reason: str
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    #: ``tokens_used`` after this reply when ``usage`` does not say it: a reply that
    #: compacted on the server bills the old context it summarised, but holds only
    #: the summary and what came after it; None: ``usage.context_tokens``
    context_tokens: int | None = None
    #: The API's id of the message (recorded with the turn: what names a call in the
    #: API's own accounts); "" for a backend without one (scripted).
    id: str = ""


class Model(Protocol):
    """A model backend. ``turn_index`` is the number of assistant turns already recorded."""

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply: ...

    def close(self) -> None: ...


@runtime_checkable
class ServerCompaction(Protocol):
    """A backend that honours ``ModelRequest.compact_trigger`` with the API's own
    compaction (``[context] strategy = "server"``); a backend without it gets the client
    strategy, and the worker says so once in a ``context_strategy_fallback`` warning."""

    offers_server_compaction: bool


def offers_server_compaction(model: Model) -> bool:
    """Whether ``model`` compacts on the server when a request asks it to."""
    return isinstance(model, ServerCompaction) and model.offers_server_compaction
