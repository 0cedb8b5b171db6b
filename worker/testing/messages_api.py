"""A local stand-in for the Anthropic Messages API, for tests and process-level chaos runs.

``MessagesAPIServer`` speaks ``POST /v1/messages`` like the real service: a JSON reply, or
with ``"stream": true`` the SSE event sequence (message_start, content_block_start/delta/
stop, ping, message_delta, message_stop) over chunked HTTP/1.1, so the official SDK works
against ``srv.base_url`` unchanged. Requests are validated the way the API does (roles
alternate from ``user``, every tool_use answered by exactly one tool_result in the next
message, required fields, known block fields); a bad one gets a 400
``invalid_request_error`` and lands in ``srv.rejected``. The key is checked as the API does
(``x-api-key``, or ``Authorization: Bearer`` which this SDK sends).

Replies come from ``srv.replies`` (``Reply``, ``Fault`` or their JSON dicts, one per request;
running out is a rejection) or from ``srv.responder(request_json) -> Reply | Fault | None``.
``srv.faults`` is a queue of faults served to the next requests before any reply is taken::

    with MessagesAPIServer() as srv:
        srv.faults.append(Fault.overloaded())
        srv.replies.append(Reply.text("hello"))
        ...  # point ANTHROPIC_BASE_URL at srv.base_url, ANTHROPIC_API_KEY at srv.api_key
        assert srv.rejected == []

``MessagesAPIServer(context_limit=M)`` enforces a context window: a request whose prompt
counts more than M tokens (``prompt_tokens``, the messages' JSON size over 4, which is
also the reply's ``input_tokens``) gets the API's 400 ``invalid_request_error``
"prompt is too long: N tokens > M maximum".

``srv.on_request(body, rejection)`` sees each request as it is answered (``rejection`` is
None for a valid one), ``srv.on_served(body, reply_or_fault)`` once the answer is written
out (a fault campaign kills its client right after a fault there).

Faults (``Fault.<name>(...)``, or ``{"fault": "<name>", ...}`` in JSON): ``status_error``,
``rate_limit`` (429 + retry-after), ``server_error`` (500), ``overloaded`` (529),
``stream_error`` (an ``error`` event mid-stream), ``drop`` (no response), ``cut`` (socket
closed mid-stream), ``no_message_stop``, ``bad_tool_json``, ``hang`` (silence, or a stall
after some events, bounded by ``seconds`` and ended at once by ``close()``).

Server compaction: a request with the ``compact_20260112`` context-management edit (and
the ``compact-2026-01-12`` beta, refused without it) whose prompt reaches the edit's
trigger is compacted as the API does: the reply holds a ``compaction`` block (a summary,
an opaque ``encrypted_content`` and a ``signature`` over both) and ``usage.iterations``
with its ``compaction`` entry, which the top-level usage leaves out. With
``pause_after_compaction`` the block is the whole reply (``stop_reason`` ``compaction``);
without, the reply the responder gives follows it in the same message. Later requests
send the block back: one whose fields were changed fails its signature and gets the
API's 400, and the prompt counts from the last compaction block on (the API drops what
precedes it). A block whose ``content`` is null is a no-op, as in the API. Issued blocks
land in ``srv.compactions``; the responder still sees the whole request.

Standalone, to try long tasks offline (a context window, compaction) with real workers:
``python -m worker.testing.messages_api [--port N] [--script-file S] [--context-limit N]
[--port-file F] [--record-file R] [--by-turn] [--exit-with-parent]`` prints the two lines
to give the daemon (``ANTHROPIC_BASE_URL=...`` and ``ANTHROPIC_API_KEY=...``) and serves
until interrupted. S is ``{"responses": [reply or {"fault": NAME, ...}, ...], "api_key":
KEY}``; without it every request gets a short text reply ("Done."). Replies are served in
order, one per request; with ``--by-turn`` (``by_turn(responses)`` in-process) reply k
answers every request whose messages hold k assistant messages, so a client that crashed
and resumed, or many clients at once, get the reply of their turn. A reply's ``usage`` is
served as written; without one, ``input_tokens`` is ``prompt_tokens`` (the size of the
messages over 4), so a compacted transcript reports its smaller size.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

JSON = dict[str, Any]
Event = tuple[str, JSON]
DEFAULT_API_KEY = "sk-ant-test-local-key"

TOP_LEVEL_FIELDS = frozenset(
    "model max_tokens messages system tools tool_choice stream temperature top_p top_k "  # noqa: SIM905  (a word list reads shorter)
    "metadata stop_sequences thinking service_tier container mcp_servers context_management "
    "output_config".split()
)
BLOCK_FIELDS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text", "citations", "cache_control"}),
    "tool_use": frozenset(
        {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}
    ),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "image": frozenset({"type", "source", "cache_control"}),
    "document": frozenset({"type", "source", "title", "context", "citations", "cache_control"}),
    "compaction": frozenset(
        {"type", "content", "encrypted_content", "signature", "tool_changes", "cache_control"}
    ),
}
BLOCK_REQUIRED: dict[str, dict[str, type]] = {
    "text": {"text": str},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str},
    "thinking": {"thinking": str, "signature": str},
    "redacted_thinking": {"data": str},
}
BLOCK_ROLE = {
    "tool_use": "assistant",
    "thinking": "assistant",
    "compaction": "assistant",
    "tool_result": "user",
}
COMPACTION_BETA = "compact-2026-01-12"
COMPACT_EDIT = "compact_20260112"
DEFAULT_TRIGGER = 150_000  # the API's, when the edit names none
_SEAL_KEY = b"agentd local Messages API: compaction blocks"
TOOL_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def prompt_tokens(request: JSON) -> int:
    """The tokens a request's prompt counts as: its messages' JSON size over 4, so that
    ``input_tokens`` (and a client's tokens_used) grows with the transcript as it would;
    from the last compaction block on, when it holds one (the API drops what precedes)."""
    return max(1, len(json.dumps(after_compaction(request.get("messages", [])))) // 4)


def _is_compaction(block: Any) -> bool:
    """A compaction block that compacts: one with null ``content`` is a no-op."""
    return (
        isinstance(block, dict)
        and block.get("type") == "compaction"
        and block.get("content") is not None
    )


def after_compaction(messages: Any) -> Any:
    """``messages`` from their last compaction block on (all of them when there is none)."""
    if not isinstance(messages, list):
        return messages
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i].get("content") if isinstance(messages[i], dict) else None
        if not isinstance(content, list):
            continue
        for j in range(len(content) - 1, -1, -1):
            if _is_compaction(content[j]):
                return [{"role": messages[i]["role"], "content": content[j:]}, *messages[i + 1 :]]
    return messages


def _seal(content: Any, encrypted: Any) -> str:
    """The signature a compaction block carries: over its summary and opaque field."""
    digest = hmac.new(_SEAL_KEY, json.dumps([content, encrypted]).encode(), hashlib.sha256)
    return base64.b64encode(digest.digest()).decode()


def compact_edit(body: JSON) -> JSON | None:
    """The request's ``compact_20260112`` edit, if it asks for server compaction."""
    management = body.get("context_management")
    edits = management.get("edits") if isinstance(management, dict) else None
    for edit in edits if isinstance(edits, list) else []:
        if isinstance(edit, dict) and edit.get("type") == COMPACT_EDIT:
            return edit
    return None


def check_compaction(body: JSON, betas: set[str]) -> str | None:
    """The API's 400 message for the request's compaction parts, or None: the edit and
    compaction blocks take the beta, and every block must be sent back as it was issued."""
    edit = compact_edit(body)
    if edit is not None and COMPACTION_BETA not in betas:
        return (
            f"context_management.edits: `{COMPACT_EDIT}` requires the "
            f"`anthropic-beta: {COMPACTION_BETA}` header"
        )
    if edit is not None:
        trigger = edit.get("trigger")
        value = trigger.get("value") if isinstance(trigger, dict) else DEFAULT_TRIGGER
        if trigger is not None and (not isinstance(value, int) or value < 1):
            return "context_management.edits.trigger.value: Input should be a positive integer"
    for i, message in enumerate(body["messages"]):
        content = message["content"]
        for j, block in enumerate(content if isinstance(content, list) else []):
            if not _is_compaction(block):
                continue
            if COMPACTION_BETA not in betas:
                return f"messages.{i}.content.{j}: `compaction` blocks require the beta"
            if block.get("signature") != _seal(block["content"], block.get("encrypted_content")):
                return (
                    f"messages.{i}.content.{j}: the `compaction` block's `signature` does not "
                    "verify; send compaction blocks back exactly as they were returned"
                )
    return None


def compaction_reply(body: JSON, tokens: int, then: Reply | None) -> Reply:
    """The reply of a request compacted at ``tokens``: the block, then ``then``'s
    content when the edit does not pause."""
    summary = (
        f"Summary of {len(after_compaction(body['messages']))} messages ({tokens} tokens): "
        "the task so far, what was done, and the next step."
    )
    encrypted = base64.b64encode(os.urandom(48)).decode()
    block = {
        "type": "compaction",
        "content": summary,
        "encrypted_content": encrypted,
        "signature": _seal(summary, encrypted),
    }
    compacting = {
        "type": "compaction",
        "input_tokens": tokens,
        "output_tokens": max(1, len(summary) // 4),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    if then is None:
        usage = {"input_tokens": 0, "output_tokens": 0, "iterations": [compacting]}
        return Reply([block], stop_reason="compaction", usage=usage)
    sampled = then.message({"messages": [{"role": "assistant", "content": [block]}]})["usage"]
    usage = {**sampled, "iterations": [compacting, {"type": "message", **sampled}]}
    return Reply([block, *then.content], then.stop_reason, usage, then.model, then.delay)


@dataclass
class Reply:
    """One assistant message. ``stop_reason`` defaults from the content; usage from sizes."""

    content: list[JSON]
    stop_reason: str | None = None
    usage: JSON = field(default_factory=dict)
    model: str | None = None
    delay: float = 0.0

    @classmethod
    def text(cls, text: str, **kwargs: Any) -> Reply:
        return cls([{"type": "text", "text": text}], **kwargs)

    @classmethod
    def tool_use(
        cls,
        name: str,
        tool_input: JSON,
        *,
        text: str | None = None,
        id: str | None = None,
        **kw: Any,
    ) -> Reply:
        block: JSON = {"type": "tool_use", "name": name, "input": tool_input}
        if id is not None:
            block["id"] = id
        return cls([*([{"type": "text", "text": text}] if text else []), block], **kw)

    def message(self, request: JSON) -> JSON:
        """The full API message for this reply (tool_use ids filled in)."""
        content = [dict(b) for b in self.content]
        for block in content:
            if block.get("type") == "tool_use":
                block.setdefault("id", _new_id("toolu"))
        has_tool = any(b.get("type") == "tool_use" for b in content)
        usage = {
            "input_tokens": prompt_tokens(request),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": max(1, len(json.dumps(content)) // 4),
            **self.usage,
        }
        return {
            "id": _new_id("msg"),
            "type": "message",
            "role": "assistant",
            "model": self.model or request.get("model", ""),
            "content": content,
            "stop_reason": self.stop_reason or ("tool_use" if has_tool else "end_turn"),
            "stop_sequence": None,
            "usage": usage,
        }


_STREAM_FAULT_REPLY = Reply.tool_use(
    "write_file", {"path": "a.txt", "content": "x" * 40}, text="Hi"
)


@dataclass
class Fault:
    """A failure served instead of a reply. Build with the class methods."""

    kind: str  # status | drop | cut | no_stop | bad_json | stream_error | hang
    status: int = 500
    error_type: str = "api_error"
    message: str = "Internal server error"
    retry_after: float | None = None
    after_events: int | None = None  # cut/hang: SSE events sent before the fault
    seconds: float = 10.0  # hang: upper bound, so a test always terminates
    reply: Reply | None = None  # stream faults: what is streamed up to the fault

    @classmethod
    def status_error(cls, status: int, error_type: str, message: str, **kw: Any) -> Fault:
        return cls("status", status=status, error_type=error_type, message=message, **kw)

    @classmethod
    def rate_limit(cls, retry_after: float = 1.0) -> Fault:
        msg = "Number of request tokens has exceeded your per-minute rate limit"
        return cls.status_error(429, "rate_limit_error", msg, retry_after=retry_after)

    @classmethod
    def server_error(cls) -> Fault:
        return cls.status_error(500, "api_error", "Internal server error")

    @classmethod
    def overloaded(cls) -> Fault:
        return cls.status_error(529, "overloaded_error", "Overloaded")

    @classmethod
    def drop(cls) -> Fault:
        """Read the request, then close the connection without a response."""
        return cls("drop")

    @classmethod
    def cut(cls, after_events: int = 5, reply: Reply | None = None) -> Fault:
        """Close the socket mid-stream, after ``after_events`` events (no final chunk)."""
        return cls("cut", after_events=after_events, reply=reply)

    @classmethod
    def no_message_stop(cls, reply: Reply | None = None) -> Fault:
        """A well-terminated stream that lacks its ``message_stop`` event."""
        return cls("no_stop", reply=reply)

    @classmethod
    def bad_tool_json(cls, reply: Reply | None = None) -> Fault:
        """A complete stream whose tool_use input_json_delta is not valid JSON."""
        return cls("bad_json", reply=reply)

    @classmethod
    def stream_error(
        cls, error_type: str = "overloaded_error", message: str = "Overloaded"
    ) -> Fault:
        """An ``event: error`` after message_start, as the API sends when overloaded mid-way."""
        return cls("stream_error", error_type=error_type, message=message)

    @classmethod
    def hang(cls, seconds: float = 10.0, after_events: int | None = None) -> Fault:
        """Say nothing (or stall after ``after_events`` events) for ``seconds``, then drop."""
        return cls("hang", seconds=seconds, after_events=after_events)

    @classmethod
    def from_json(cls, data: JSON) -> Fault:
        params = {k: v for k, v in data.items() if k != "fault"}
        if "reply" in params:
            params["reply"] = Reply(**params["reply"])
        if data["fault"] not in FAULT_NAMES:
            raise ValueError(f"unknown fault {data['fault']!r}; one of {sorted(FAULT_NAMES)}")
        factory: Callable[..., Fault] = getattr(cls, data["fault"])
        return factory(**params)


FAULT_NAMES = frozenset(  # what ``{"fault": NAME, ...}`` may name: the Fault class methods
    "status_error rate_limit server_error overloaded drop cut no_message_stop bad_tool_json "  # noqa: SIM905  (the same)
    "stream_error hang".split()
)


def as_action(item: Reply | Fault | JSON) -> Reply | Fault:
    if isinstance(item, Reply | Fault):
        return item
    return Fault.from_json(item) if "fault" in item else Reply(**item)


def by_turn(responses: list[Reply | Fault | JSON]) -> Callable[[JSON], Reply | Fault | None]:
    """A stateless responder: reply k for a request whose messages hold k assistant messages
    (None, a visible rejection, past the end)."""
    actions = [as_action(item) for item in responses]

    def respond(request: JSON) -> Reply | Fault | None:
        messages = request.get("messages")
        turn = (
            sum(1 for m in messages if isinstance(m, dict) and _answers(m))
            if isinstance(messages, list)
            else 0
        )
        return actions[turn] if turn < len(actions) else None

    return respond


def _answers(message: JSON) -> bool:
    """An assistant message that is a reply of the script's, not a compaction alone."""
    content = message.get("content")
    return message.get("role") == "assistant" and not (
        isinstance(content, list) and content and all(_is_compaction(b) for b in content)
    )


@dataclass
class Rejection:
    status: int
    error_type: str
    message: str
    request: Any = None


# -- validation ---------------------------------------------------------------------------


def _check_block(block: Any, where: str, role: str, final_assistant: bool) -> str | None:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        return f"{where}: each content block must be an object with a `type`"
    kind = block["type"]
    if kind in BLOCK_FIELDS and (extra := sorted(set(block) - BLOCK_FIELDS[kind])):
        return f"{where}.{extra[0]}: Extra inputs are not permitted"
    if kind not in BLOCK_FIELDS and role == "user":
        return f"{where}.type: Input tag '{kind}' does not match any of the expected tags"
    if (kind == "tool_result") != (role == "user") and kind in BLOCK_ROLE:
        return f"{where}: `{kind}` blocks can only appear in {BLOCK_ROLE[kind]} messages"
    for name, typ in BLOCK_REQUIRED.get(kind, {}).items():
        if not isinstance(block.get(name), typ):
            return f"{where}.{name}: Input should be a valid {typ.__name__}"
    if kind == "text" and not block["text"] and not final_assistant:
        return "messages: text content blocks must be non-empty"
    if kind == "tool_use" and not TOOL_ID.match(block["id"]):
        return f"{where}.id: String should match pattern '^[a-zA-Z0-9_-]+$'"
    if kind == "tool_result" and not isinstance(block.get("content", ""), str | list):
        return f"{where}.content: Input should be a valid string or list"
    return None


def validate_request(body: Any) -> str | None:
    """The API's 400 message for ``body``, or None when the API would accept it."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            return f"{name}: Field required"
    if extra := sorted(set(body) - TOP_LEVEL_FIELDS):
        return f"{extra[0]}: Extra inputs are not permitted"
    if not isinstance(body["model"], str) or not body["model"]:
        return "model: Input should be a valid string"
    max_tokens = body["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return "max_tokens: Input should be greater than or equal to 1"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "stream: Input should be a valid boolean"
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        return "system: Input should be a valid string or list of text blocks"
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        return "tools: Input should be a valid list"
    names = [t.get("name") if isinstance(t, dict) else None for t in tools]
    for i, (tool, tool_name) in enumerate(zip(tools, names, strict=True)):
        if not isinstance(tool_name, str) or not TOOL_NAME.match(tool_name):
            return f"tools.{i}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'"
        if "type" not in tool and not isinstance(tool.get("input_schema"), dict):
            return f"tools.{i}.input_schema: Field required"
    if len(set(names)) != len(names):
        return "tools: Tool names must be unique."
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    return _check_messages(messages)


def _check_messages(messages: list[Any]) -> str | None:
    pending: list[str] = []  # tool_use ids of the previous assistant message
    seen_ids: set[str] = set()
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"messages.{i}: Input should be a valid dictionary"
        if extra := sorted(set(msg) - {"role", "content"}):
            return f"messages.{i}.{extra[0]}: Extra inputs are not permitted"
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        if i == 0 and role != "user":
            return 'messages: first message must use the "user" role'
        if i > 0 and role == messages[i - 1].get("role"):
            return (
                'messages: roles must alternate between "user" and "assistant", '
                f'but found multiple "{role}" roles in a row'
            )
        if not isinstance(content, str | list):
            return f"messages.{i}.content: Input should be a valid string or list"
        final_assistant = i == last and role == "assistant"
        if not content and not final_assistant:
            return (
                f"messages.{i}: all messages must have non-empty content except for "
                "the optional final assistant message"
            )
        blocks = content if isinstance(content, list) else []
        for j, block in enumerate(blocks):
            if error := _check_block(block, f"messages.{i}.content.{j}", role, final_assistant):
                return error
        if role == "user":
            answered: set[str] = set()
            others = False
            for j, block in enumerate(blocks):
                if block["type"] != "tool_result":
                    others = True
                    continue
                tid = block["tool_use_id"]
                if tid not in pending:
                    return (
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {tid}. Each `tool_result` block must have a "
                        "corresponding `tool_use` block in the previous message."
                    )
                if tid in answered:
                    return f"messages.{i}.content.{j}: duplicate `tool_result` for {tid}"
                if others:
                    return f"messages.{i}: `tool_result` blocks must come first in the content"
                answered.add(tid)
            if missing := [t for t in pending if t not in answered]:
                return _unanswered(i - 1, missing)
            pending = []
        else:
            pending = [b["id"] for b in blocks if b["type"] == "tool_use"]
            for tid in pending:
                if tid in seen_ids:
                    return f"messages.{i}: `tool_use` ids must be unique; {tid} is repeated"
                seen_ids.add(tid)
    return _unanswered(last, pending) if pending else None


def _unanswered(index: int, ids: list[str]) -> str:
    return (
        f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately "
        f"after: {', '.join(ids)}. Each `tool_use` block must have a corresponding "
        "`tool_result` block in the next message."
    )


# -- SSE ----------------------------------------------------------------------------------


def _pieces(text: str, size: int = 12) -> list[str]:
    return [text[k : k + size] for k in range(0, len(text), size)] or [""]


def stream_events(message: JSON, *, bad_json: bool = False) -> list[Event]:
    """The SSE events the API sends for ``message``."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    events: list[Event] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        first: JSON
        deltas: list[JSON]
        if kind == "text":
            first = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"])]
        elif kind == "tool_use":
            raw = json.dumps(block["input"])
            if bad_json:
                raw, bad_json = raw[: len(raw) // 2] + '",,}', False
            first = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in _pieces(raw)]
        elif kind == "thinking":
            first = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p} for p in _pieces(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif _is_compaction(block):  # the summary and opaque field come in one delta
            # (a null one, a failed compaction, comes whole in its start event)
            first = {k: v for k, v in block.items() if k not in ("content", "encrypted_content")}
            fields = {k: block.get(k) for k in ("content", "encrypted_content")}
            deltas = [{"type": "compaction_delta", **fields}]
        else:
            first, deltas = block, []
        start_block = {"type": "content_block_start", "index": index, "content_block": first}
        events.append(("content_block_start", start_block))
        if index == 0:
            events.append(("ping", {"type": "ping"}))
        events += [
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
            for d in deltas
        ]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _sse(event: Event) -> bytes:
    return f"event: {event[0]}\ndata: {json.dumps(event[1])}\n\n".encode()


# -- server -------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small writes: Nagle + delayed ACK would add 40 ms each
    server: _HTTPServer

    timeout = 60  # a safety net: an idle keep-alive connection never outlives a minute

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections.add(self.connection)
            if self.server.owner.closing.is_set():
                self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_POST(self) -> None:
        self.server.owner.handle(self)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins every handler thread
    owner: MessagesAPIServer
    connections: set[socket.socket]
    lock: threading.Lock

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            self.owner.errors.append(repr(error))
            super().handle_error(request, client_address)


class MessagesAPIServer:
    """The local Messages API. Use as a context manager; see the module docstring."""

    def __init__(
        self,
        *,
        api_key: str | None = DEFAULT_API_KEY,
        responder: Callable[[JSON], Reply | Fault | None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        context_limit: int | None = None,
    ) -> None:
        self.api_key = api_key  # None: any non-empty key is accepted
        #: the model's context window in tokens (``prompt_tokens``); a longer prompt gets
        #: the API's 400 "prompt is too long", and None accepts any size
        self.context_limit = context_limit
        self.responder = responder or self._next_scripted
        self.replies: deque[Reply | Fault | JSON] = deque()
        self.faults: deque[Fault] = deque()
        self.requests: list[JSON] = []  # every request body that parsed as JSON
        self.headers: list[dict[str, str]] = []
        self.rejected: list[Rejection] = []
        self.compactions: list[JSON] = []  # the compaction blocks served, in order
        self.errors: list[str] = []  # exceptions inside the server itself
        self.on_request: Callable[[JSON, Rejection | None], None] | None = None
        #: called with a request and what was served for it, once it is written out
        self.on_served: Callable[[JSON, Reply | Fault], None] | None = None
        #: called with a request and the whole message of a complete reply to it (id,
        #: model, usage: what the API's own accounts bill), once it is written out
        self.on_message: Callable[[JSON, JSON], None] | None = None
        self.closing = threading.Event()  # set by close(): hangs and delays end at once
        self._cond = threading.Condition()
        self._httpd = _HTTPServer((host, port), _Handler, bind_and_activate=True)
        self._httpd.owner = self
        self._httpd.connections = set()
        self._httpd.lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MessagesAPIServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self.closing.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        with self._httpd.lock:
            for conn in self._httpd.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._httpd.server_close()

    def __enter__(self) -> MessagesAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> None:
        """Block until ``count`` requests arrived; AssertionError after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.requests) >= count, timeout):
                raise AssertionError(f"{len(self.requests)} requests arrived, expected {count}")

    def _compacting(self, body: JSON, tokens: int) -> Reply | Fault | None:
        """The responder's answer, compacted first when the request asks for it and
        its prompt reached the trigger."""
        edit = compact_edit(body)
        trigger = (edit or {}).get("trigger") or {"value": DEFAULT_TRIGGER}
        if edit is None or tokens < trigger["value"]:
            return self.responder(body)
        then = None
        if not edit.get("pause_after_compaction"):
            answer = self.responder(body)
            if not isinstance(answer, Reply):
                return answer  # a fault, or nothing scripted: no compaction is served
            then = answer
        reply = compaction_reply(body, tokens, then)
        self.compactions.append(reply.content[0])
        return reply

    def _next_scripted(self, request: JSON) -> Reply | Fault | None:
        return as_action(self.replies.popleft()) if self.replies else None

    # -- one request ----------------------------------------------------------------------

    def _reject(self, h: _Handler, status: int, kind: str, message: str, body: Any) -> None:
        rejection = Rejection(status, kind, message, body)
        self.rejected.append(rejection)
        if self.on_request is not None and isinstance(body, dict):
            self.on_request(body, rejection)
        self.send_error_json(h, status, kind, message)

    def handle(self, h: _Handler) -> None:
        raw = h.rfile.read(int(h.headers.get("content-length") or 0))
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict):
            with self._cond:
                self.requests.append(body)
                self.headers.append({k.lower(): v for k, v in h.headers.items()})
                self._cond.notify_all()
        if h.path.split("?")[0] != "/v1/messages":
            return self._reject(h, 404, "not_found_error", f"Not found: {h.path}", body)
        auth = h.headers.get("authorization") or ""
        key = h.headers.get("x-api-key") or auth.removeprefix("Bearer ").strip()
        if not key:
            return self._reject(
                h, 401, "authentication_error", "x-api-key header is required", body
            )
        if self.api_key is not None and key != self.api_key:
            return self._reject(h, 401, "authentication_error", "invalid x-api-key", body)
        if not h.headers.get("anthropic-version"):
            msg = "anthropic-version: header is required"
            return self._reject(h, 400, "invalid_request_error", msg, body)
        if body is None:
            return self._reject(
                h, 400, "invalid_request_error", "The request body is not valid JSON.", body
            )
        if error := validate_request(body):
            return self._reject(h, 400, "invalid_request_error", error, body)
        betas = {b.strip() for b in (h.headers.get("anthropic-beta") or "").split(",")}
        if error := check_compaction(body, betas):
            return self._reject(h, 400, "invalid_request_error", error, body)
        tokens = prompt_tokens(body)
        if self.context_limit is not None and tokens > self.context_limit:
            msg = f"prompt is too long: {tokens} tokens > {self.context_limit} maximum"
            return self._reject(h, 400, "invalid_request_error", msg, body)
        action = self.faults.popleft() if self.faults else self._compacting(body, tokens)
        if action is None:  # a test that scripted too few replies: make it visible
            msg = f"test server: no reply scripted for request {len(self.requests)}"
            return self._reject(h, 400, "invalid_request_error", msg, body)
        if self.on_request is not None:
            self.on_request(body, None)
        if isinstance(action, Fault):
            self._serve_fault(h, action, body)
        elif action.delay and self.closing.wait(action.delay):
            h.close_connection = True
            return None
        else:
            message = action.message(body)
            if body.get("stream"):
                self._send_stream(h, stream_events(message))
            else:
                self._send_json(h, 200, message)
            if self.on_message is not None:
                self.on_message(body, message)
        if self.on_served is not None:
            self.on_served(body, action)
        return None

    def _serve_fault(self, h: _Handler, fault: Fault, body: JSON) -> None:
        stream = bool(body.get("stream"))
        if fault.kind == "status":
            headers = {} if fault.retry_after is None else {"retry-after": f"{fault.retry_after:g}"}
            return self.send_error_json(h, fault.status, fault.error_type, fault.message, headers)
        if (fault.kind == "hang" and fault.after_events is None) or fault.kind == "drop":
            if fault.kind == "hang":
                self.closing.wait(fault.seconds)
            h.close_connection = True
            return None
        message = (fault.reply or _STREAM_FAULT_REPLY).message(body)
        if not stream:  # stream faults on a JSON request: a body cut in half
            data = json.dumps(message).encode()
            self._start(h, 200, "application/json", {"content-length": str(len(data))})
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])
            h.close_connection = True
            return None
        events = stream_events(message, bad_json=fault.kind == "bad_json")
        if fault.kind == "no_stop":
            events = events[:-1]
        elif fault.kind == "stream_error":
            error = {"type": "error", "error": {"type": fault.error_type, "message": fault.message}}
            events = [*events[:1], ("error", error)]
        elif fault.kind in ("cut", "hang"):
            return self._send_stream(h, events[: fault.after_events], abort=fault)
        return self._send_stream(h, events)

    def _start(self, h: _Handler, status: int, content_type: str, extra: dict[str, str]) -> None:
        h.send_response(status)
        h.send_header("content-type", content_type)
        h.send_header("request-id", _new_id("req"))
        for name, value in extra.items():
            h.send_header(name, value)

    def _send_json(
        self, h: _Handler, status: int, payload: JSON, extra: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(payload).encode()
        self._start(h, status, "application/json", extra or {})
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def send_error_json(
        self, h: _Handler, status: int, kind: str, message: str, extra: dict[str, str] | None = None
    ) -> None:
        payload = {"type": "error", "error": {"type": kind, "message": message}}
        self._send_json(h, status, payload, extra)

    def _send_stream(self, h: _Handler, events: list[Event], abort: Fault | None = None) -> None:
        self._start(h, 200, "text/event-stream; charset=utf-8", {"transfer-encoding": "chunked"})
        h.send_header("cache-control", "no-cache")
        h.end_headers()
        for event in events:
            data = _sse(event)
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()
        if abort is not None:  # cut: no terminating chunk; hang: stall first
            if abort.kind == "hang":
                self.closing.wait(abort.seconds)
            h.close_connection = True
            return
        h.wfile.write(b"0\r\n\r\n")


# -- standalone ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.testing.messages_api", description=__doc__
    )
    parser.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    parser.add_argument(
        "--script-file", type=Path, help='the replies, {"responses": [...]} (default: "Done.")'
    )
    parser.add_argument(
        "--context-limit",
        type=int,
        metavar="N",
        help='the context window in tokens: a longer prompt gets the API\'s "prompt is too long"',
    )
    parser.add_argument("--port-file", type=Path, help="write the port here once serving")
    parser.add_argument(
        "--record-file",
        type=Path,
        help="append one JSON line per request, and one per complete reply served "
        '({"served": {"id", "model", "usage"}, "request": its first message})',
    )
    parser.add_argument(
        "--by-turn",
        action="store_true",
        help="answer a request holding k assistant messages with response k (stateless)",
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one is gone (no orphan after a crash)",
    )
    args = parser.parse_args(argv)
    if args.context_limit is not None and args.context_limit < 1:
        parser.error("--context-limit must be a number of tokens, 1 or more")
    try:
        script = json.loads(args.script_file.read_text()) if args.script_file else {}
    except (OSError, ValueError) as exc:
        parser.error(f"--script-file {args.script_file}: {exc}")
    responses = script.get("responses", [])
    responder = by_turn(responses) if args.by_turn else None
    if args.script_file is None:
        responder = lambda _: Reply.text("Done.")  # noqa: E731  (a default, said in --help)
    try:
        server = MessagesAPIServer(
            api_key=script.get("api_key", DEFAULT_API_KEY),
            port=args.port,
            responder=responder,
            context_limit=args.context_limit,
        )
    except OSError as exc:
        parser.error(f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}")
    if responder is None:
        server.replies.extend(as_action(item) for item in responses)
    record_lock = threading.Lock()

    def record(body: JSON, rejection: Rejection | None) -> None:
        if args.record_file is None:
            return
        line = {"at": time.time(), "request": body, "rejected": rejection and rejection.message}
        with record_lock, args.record_file.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def served(body: JSON, message: JSON) -> None:
        if args.record_file is None:
            return
        what = {k: message[k] for k in ("id", "model", "usage")}
        line = {"at": time.time(), "served": what, "request": {"messages": body["messages"][:1]}}
        with record_lock, args.record_file.open("a") as f:
            f.write(json.dumps(line) + "\n")

    server.on_request = record
    server.on_message = served
    stop = threading.Event()
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with server:
        print(f"ANTHROPIC_BASE_URL={server.base_url}", flush=True)
        print(f"ANTHROPIC_API_KEY={server.api_key or DEFAULT_API_KEY}", flush=True)
        if args.port_file is not None:
            tmp = args.port_file.with_name(args.port_file.name + ".tmp")
            tmp.write_text(f"{server.port}\n")
            os.replace(tmp, args.port_file)
        while not stop.wait(0.2):
            if args.exit_with_parent and os.getppid() != parent:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
