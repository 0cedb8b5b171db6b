"""A task's execution state: the fold of its journal records.

``TaskState.apply(record)`` is the only way state changes, both while the worker runs
(each record is applied right after it is durable) and on resume (records are replayed
from the last snapshot). The transcript is rebuilt by construction so that every
assistant tool_use is answered by exactly one tool_result, in tool_use order, in the
next user message (invariant 3): the tool_result message is only emitted once every call
of the turn has a result, and a second result for a call is ignored.

Records (see worker/store/journal.py for the frame format)::

    turn      {"turn", "message", "stop_reason", "usage", "model", "tokens_used"?, "at"}
              ``tokens_used``: when the usage's own sum is not it (a server compaction)
    intent    {"call_id", "tool", "effect", "key", "attempt", "asked"?, "renewed"?, "at"}
              (its input: the turn's ``tool_use`` block, recorded once); ``asked``: the
              call waits for an approval before it runs; ``renewed``: not a start, the
              attempt held again (a decision that expired)
    result    {"call_id", "content", "is_error", "outcome", "at"}
    user      {"content": [blocks], "at"}                 an extra user message
    hold      {"calls": [{"call_id", "attempt"}], "at"}   awaiting an operator
    decision  {"call_id", "attempt", "action", "reason"?, "result"?, "at"}
    end       {"state": "done" | "failed", "reason", "at"}
    rewind    {"to": TURN, "at"}                          back to the scene after TURN
    base      {"scene": snapshot of a scene, "from": {"task", "turn"}, "at"}  a fork's start
    vcs       {"turn", "commit", "snapshot"}              workspace version-control state
    compaction {"summary", "keep", "first", "last", "usage", "model", "tokens_before",
                "tokens_after", "trigger", "at"}
    tools     {"local", "mcp", "listed", "at"}                the tools the task is offered,
              recorded at its first start (worker.mcp.catalog); kept by rewinds and forks
              the transcript becomes the prompt, the summary and its last ``keep``
              messages (worker.compaction); ``first``..``last``: the turns it replaces

Rewind needs the scene after any earlier turn. ``TaskState`` keeps a small ``Boundary``
per turn (the transcript list it was on and how many of its messages and calls the scene
had, the counters, and a copy of its last message, which a later user record may
extend), so a rewind is a cut, not a replay. A compaction starts a new transcript list
and leaves the old one as it was, so a rewind to a turn before a compaction gets the
full transcript of that time back, and the compaction is off the live branch.
Boundaries are not part of snapshots: a rewind record met after a snapshot raises
``NeedsFullReplay`` and the reader folds the journal from the start.

A snapshot (``snapshot_bytes``) is a cache of what the *next step* needs: the
transcript, the counters, the calls of the latest turn and the open holds. The ledger of
finished calls and the per-turn history are the journal's alone (``agentd history``
folds the journal), so a snapshot does not store every tool result a second time. It is
zlib-compressed JSON with a crc32 trailer (0.27x the transcript's size in the checkpoint
benchmark; less compressible transcripts take more), checked before it is trusted. A full
scene, history and all (``to_snapshot``), is what a fork's ``base`` record carries.
"""

from __future__ import annotations

import copy
import struct
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from worker import compaction
from worker.budget import Spend, spend_from_json, spend_json
from worker.models.base import JSON, Usage
from worker.records import CallOutcome
from worker.store.durable import dump_json, load_json

SNAPSHOT_VERSION = 2  # a scene's JSON: a base record's, and inside a snapshot file
#: A base record (a fork's first) may carry a scene of version 1, with no spend by model.
BASE_VERSIONS = (1, SNAPSHOT_VERSION)
SNAPSHOT_MAGIC = b"agentd-snapshot 2\n"  # the snapshot file's format
SNAPSHOT_TRAILER = struct.Struct("<I")  # the crc32 at its end


class NeedsFullReplay(Exception):
    """A record needs history that a snapshot does not carry: fold from the start."""


class OutdatedSnapshot(ValueError):
    """A snapshot of an earlier format (version 1 kept no spend by model): a cache miss,
    not damage; the journal is folded from its start, as it would be without one."""


@dataclass
class Boundary:
    """The scene right after a turn: what a rewind to that turn keeps."""

    transcript: list[JSON]  # the message list of that time (shared, never changed in place)
    messages: int
    last_message: JSON
    calls: int
    turn_calls: list[str]
    usage: Usage
    spend: Spend
    tokens_used: int
    stop_reason: str | None


@dataclass
class Call:
    """One tool_use of the transcript and what became of it: a ledger entry."""

    call_id: str
    tool: str
    input: Any
    turn: int
    effect: str | None = None
    key: str | None = None
    attempt: int = 0  # intents recorded so far; the current attempt's number
    started_at: str | None = None
    result: JSON | None = None  # the result record once there is one
    decision: JSON | None = None  # the decision record for the current attempt
    #: its current attempt waits for an operator's approval before it runs at all
    #: (docs/guides/tools.md): its intent was recorded with ``"asked": true``
    asked: bool = False

    @property
    def dangling(self) -> bool:
        """Started (an intent is durable) but never recorded as finished."""
        return self.attempt > 0 and self.result is None

    @property
    def outcome(self) -> str:
        if self.result is not None:
            return str(self.result.get("outcome", CallOutcome.RAN))
        return CallOutcome.DANGLING if self.attempt else CallOutcome.PENDING


@dataclass
class TurnInfo:
    turn: int
    at: str
    model: str
    stop_reason: str
    usage: Usage
    offset: int  # index of the turn record in the record list
    epoch: int = 0  # the branch (rewinds before it) this turn was recorded on
    rewound: bool = False  # a later rewind cut this turn from the live branch


@dataclass
class CompactionInfo:
    """One compaction, for history and status: made after ``turn``, replacing turns
    ``first`` to ``last``."""

    turn: int
    first: int
    last: int
    tokens_before: int
    tokens_after: int  # an estimate, by the transcript's size (worker.compaction)
    headline: str  # the summary's first line
    at: str
    usage: Usage
    epoch: int = 0
    rewound: bool = False
    model: str = ""  # the model that wrote the summary


@dataclass
class TaskState:
    prompt: str
    messages: list[JSON] = field(default_factory=list)
    turn: int = 0
    usage: Usage = field(default_factory=Usage)  # the current branch
    usage_total: Usage = field(default_factory=Usage)  # everything ever spent
    #: ``usage`` and ``usage_total`` by model, for their cost (worker.budget); each is
    #: replaced, never changed in place, so a detached copy may share them
    spend: Spend = field(default_factory=dict)
    spend_total: Spend = field(default_factory=dict)
    tokens_used: int = 0
    calls: dict[str, Call] = field(default_factory=dict)
    turn_calls: list[str] = field(default_factory=list)  # call ids of the latest turn
    stop_reason: str | None = None
    held: list[JSON] = field(default_factory=list)
    ended: JSON | None = None
    epoch: int = 0  # rewinds so far: part of every new idempotency key
    retries: int = 0  # the operator's retries recorded (``retry`` records: see _apply_retry)
    turns: list[TurnInfo] = field(default_factory=list)
    records: int = 0  # records applied
    boundaries: dict[int, Boundary] | None = field(default_factory=dict)  # None: unknown
    vcs: dict[int, JSON] = field(default_factory=dict)  # turn -> workspace VCS state
    compactions: list[CompactionInfo] = field(default_factory=list)  # every branch's
    tools: JSON | None = None  # the tools record (worker.mcp.catalog); None: not recorded

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "user", "content": [{"type": "text", "text": self.prompt}]}]

    # -- the fold -----------------------------------------------------------------------

    def apply(self, record: JSON) -> None:
        kind = record.get("k")
        handler = getattr(self, f"_apply_{kind}", None)
        if handler is not None:
            handler(record)
        self.records += 1

    def _apply_header(self, record: JSON) -> None:
        pass

    def boundary(self) -> Boundary:
        """The current scene as a Boundary (meaningful when no call is pending)."""
        last = self.messages[-1]
        return Boundary(
            transcript=self.messages,
            messages=len(self.messages),
            last_message={"role": last["role"], "content": list(last["content"])},
            calls=len(self.calls),
            turn_calls=list(self.turn_calls),
            usage=self.usage,
            spend=self.spend,
            tokens_used=self.tokens_used,
            stop_reason=self.stop_reason,
        )

    def _spent(self, model: str, usage: Usage) -> None:
        """Count ``usage`` of a call to ``model``: on this branch, and in the whole life."""
        self.usage = self.usage + usage
        self.usage_total = self.usage_total + usage
        self.spend = _plus(self.spend, model, usage)
        self.spend_total = _plus(self.spend_total, model, usage)

    def _apply_turn(self, record: JSON) -> None:
        if self.boundaries is not None:
            self.boundaries[self.turn] = self.boundary()
        message: JSON = record["message"]
        usage = Usage.from_json(record.get("usage") or {})
        self.turn = int(record["turn"])
        model = str(record.get("model", ""))
        self._spent(model, usage)
        self.tokens_used = int(record.get("tokens_used", usage.context_tokens))
        self.stop_reason = record.get("stop_reason")
        self.messages.append({"role": "assistant", "content": message["content"]})
        self.turn_calls = []
        for block in message["content"]:
            if block.get("type") == "tool_use":
                call = Call(block["id"], block["name"], block.get("input"), self.turn)
                self.calls[call.call_id] = call
                self.turn_calls.append(call.call_id)
        self.turns.append(
            TurnInfo(
                self.turn,
                str(record.get("at", "")),
                model,
                str(self.stop_reason),
                usage,
                self.records,
                self.epoch,
            )
        )

    def _apply_intent(self, record: JSON) -> None:
        call = self.calls.get(record["call_id"])
        if call is None or call.result is not None:
            return
        call.attempt = int(record.get("attempt", call.attempt + 1))
        call.effect = record.get("effect")
        call.key = record.get("key")
        if not record.get("renewed") or record.get("asked"):
            # (a call of unknown outcome held again keeps its start; one asked again is
            # asked now)
            call.started_at = record.get("at")
        call.asked = bool(record.get("asked", False))
        call.decision = None

    def _apply_result(self, record: JSON) -> None:
        call = self.calls.get(record["call_id"])
        if call is None or call.result is not None:
            return
        call.result = record
        self.held = [h for h in self.held if h["call_id"] != call.call_id]
        if call.call_id in self.turn_calls and not self.pending_calls():
            self._append_user(
                [_tool_result_block(self.calls[cid].result or {}, cid) for cid in self.turn_calls]
            )

    def _apply_user(self, record: JSON) -> None:
        self._append_user(list(record["content"]))
        self.stop_reason = None  # the user spoke last: the model answers next
        self.ended = None

    def _apply_vcs(self, record: JSON) -> None:
        self.vcs[int(record["turn"])] = {
            "commit": record.get("commit"),
            "snapshot": record.get("snapshot"),
        }

    def _apply_rewind(self, record: JSON) -> None:
        to = int(record["to"])
        if self.boundaries is None:
            raise NeedsFullReplay("a rewind after a snapshot")
        if to > self.turn or (to == self.turn and self.pending_calls()):
            return  # refused at write time; a hand-made record is ignored, never half-done
        mark = self.boundaries.get(to) if to < self.turn else self.boundary()
        if mark is None:
            return
        self.messages = mark.transcript[: mark.messages]
        self.messages[-1] = {
            "role": mark.last_message["role"],
            "content": list(mark.last_message["content"]),
        }
        self.calls = dict(list(self.calls.items())[: mark.calls])
        self.turn_calls = list(mark.turn_calls)
        self.usage = mark.usage
        self.spend = mark.spend
        self.tokens_used = mark.tokens_used
        self.stop_reason = mark.stop_reason
        self.turn = to
        self.held = []
        self.ended = None
        for info in self.turns:
            if info.turn > to and not info.rewound:
                info.rewound = True
        for made in self.compactions:
            if made.turn > to and not made.rewound:
                made.rewound = True
        self.boundaries = {t: b for t, b in self.boundaries.items() if t < to}
        self.vcs = {t: v for t, v in self.vcs.items() if t <= to}
        self.epoch += 1

    def _apply_compaction(self, record: JSON) -> None:
        keep = int(record["keep"])
        if self.pending_calls() or not 0 <= keep <= len(self.messages) - 2:
            return  # never written so (worker.loop compacts at a boundary): ignored whole
        summary = str(record["summary"])
        # copies: a user record extends the last message, and the old list stays as it was
        kept = [dict(m) for m in self.messages[len(self.messages) - keep :]] if keep else []
        if kept and kept[0]["role"] != "assistant":
            return
        self.messages = compaction.compacted(self.prompt, summary, kept)
        usage = Usage.from_json(record.get("usage") or {})
        # (a record from before the model was written: the summary's model was the turns')
        model = str(record.get("model") or (self.turns[-1].model if self.turns else ""))
        self._spent(model, usage)
        before = self.tokens_used
        self.tokens_used = int(record.get("tokens_after", before))  # until the next turn
        self.compactions.append(
            CompactionInfo(
                turn=self.turn,
                first=int(record["first"]),
                last=int(record["last"]),
                tokens_before=int(record.get("tokens_before", before)),
                tokens_after=self.tokens_used,
                headline=summary.strip().splitlines()[0] if summary.strip() else "",
                at=str(record.get("at", "")),
                usage=usage,
                epoch=self.epoch,
                model=model,
            )
        )

    def live_compactions(self) -> list[CompactionInfo]:
        """The compactions of the live branch, oldest first."""
        return [c for c in self.compactions if not c.rewound]

    @property
    def compaction_count(self) -> int:
        """The compactions of the live branch, both kinds: the client's (``compaction``
        records) and the API's (a compaction block in a reply, ``[context] strategy =
        "server"``), as status and the heartbeat show them."""
        server: int = sum(
            block.get("type") == "compaction"
            for message in self.messages
            if message["role"] == "assistant" and isinstance(message["content"], list)
            for block in message["content"]
            if isinstance(block, dict)
        )
        return len(self.live_compactions()) + server

    def compacted_at(self, turn: int) -> bool:
        """Whether the live branch compacted right after ``turn``: once per boundary."""
        return any(c.turn == turn for c in self.live_compactions())

    def _apply_base(self, record: JSON) -> None:
        base, _ = TaskState.from_snapshot(record["scene"], base=True)
        base.records = self.records
        base.boundaries = {}  # the parent's turns stay with the parent: no rewind past here
        self.__dict__.update(vars(base))

    def _apply_hold(self, record: JSON) -> None:
        self.held = list(record["calls"])

    def _apply_decision(self, record: JSON) -> None:
        call = self.calls.get(record["call_id"])
        if call is not None and call.attempt == record.get("attempt"):
            call.decision = record

    def _apply_end(self, record: JSON) -> None:
        self.ended = {"state": record["state"], "reason": record["reason"]}

    def _apply_tools(self, record: JSON) -> None:
        """The task's tool list: once, at its first start (a second one is ignored)."""
        if self.tools is None:
            self.tools = {k: v for k, v in record.items() if k not in ("k", "at")}

    def _apply_retry(self, record: JSON) -> None:
        """An operator retried the task after it ended failed: it goes on from here."""
        self.retries = int(record["n"])
        self.ended = None

    def _append_user(self, blocks: list[JSON]) -> None:
        last = self.messages[-1]
        if last["role"] == "user":
            last["content"] = [*last["content"], *blocks]
        else:
            self.messages.append({"role": "user", "content": blocks})

    # -- questions the loop asks ----------------------------------------------------------

    def pending_calls(self) -> list[Call]:
        """Calls of the latest turn without a result, in tool_use order."""
        return [self.calls[cid] for cid in self.turn_calls if self.calls[cid].result is None]

    def dangling(self) -> list[Call]:
        return [c for c in self.pending_calls() if c.dangling]

    @property
    def last_role(self) -> str:
        return str(self.messages[-1]["role"])

    def transcript(self) -> list[JSON]:
        """The messages to send to the model (a copy the caller may not mutate back)."""
        return self.messages

    # -- snapshots -----------------------------------------------------------------------

    def to_snapshot(self, offset: int) -> JSON:
        return {
            "v": SNAPSHOT_VERSION,
            "offset": offset,
            "records": self.records,
            "prompt": self.prompt,
            "messages": self.messages,
            "turn": self.turn,
            "usage": self.usage.to_json(),
            "usage_total": self.usage_total.to_json(),
            "spend": spend_json(self.spend),
            "spend_total": spend_json(self.spend_total),
            "tokens_used": self.tokens_used,
            "calls": [vars(c) for c in self.calls.values()],
            "turn_calls": self.turn_calls,
            "stop_reason": self.stop_reason,
            "held": self.held,
            "ended": self.ended,
            "epoch": self.epoch,
            "retries": self.retries,
            "turns": [
                {**vars(t), "usage": t.usage.to_json()}  # TurnInfo with usage as JSON
                for t in self.turns
            ],
            "vcs": {str(t): v for t, v in self.vcs.items()},
            "compactions": [{**vars(c), "usage": c.usage.to_json()} for c in self.compactions],
        } | ({"tools": self.tools} if self.tools is not None else {})

    @classmethod
    def from_snapshot(cls, data: JSON, *, base: bool = False) -> tuple[TaskState, int]:
        """The state and journal offset a snapshot holds; KeyError/TypeError if malformed.
        A snapshot file of version 1 is ``OutdatedSnapshot`` (the journal has it all); a
        ``base`` record's scene of version 1 (a fork made by release 0.1) has its spend by
        model rebuilt from its turns (``_spend_of_v1``)."""
        version = data.get("v")
        if version == 1 and not base:
            raise OutdatedSnapshot("a snapshot of format 1 keeps no spend by model")
        if version not in BASE_VERSIONS:
            raise ValueError(f"snapshot version {version!r}")
        usage, usage_total = Usage.from_json(data["usage"]), Usage.from_json(data["usage_total"])
        turns = [TurnInfo(**{**t, "usage": Usage.from_json(t["usage"])}) for t in data["turns"]]
        compactions = [
            CompactionInfo(**{**c, "usage": Usage.from_json(c["usage"])})
            for c in data.get("compactions", [])
        ]
        if "spend" in data:
            spend, spend_total = (
                spend_from_json(data["spend"]),
                spend_from_json(data["spend_total"]),
            )
        else:
            spend = spend_total = _spend_of_v1(usage, turns, compactions)
        state = cls(
            prompt=data["prompt"],
            messages=data["messages"],
            turn=data["turn"],
            usage=usage,
            usage_total=usage_total,
            spend=spend,
            spend_total=spend_total,
            tokens_used=data["tokens_used"],
            calls={c["call_id"]: Call(**c) for c in data["calls"]},
            turn_calls=list(data["turn_calls"]),
            stop_reason=data["stop_reason"],
            held=list(data["held"]),
            ended=data["ended"],
            epoch=data["epoch"],
            retries=data.get("retries", 0),
            turns=turns,
            records=data["records"],
            boundaries=None,
            vcs={int(t): v for t, v in data.get("vcs", {}).items()},
            compactions=compactions,
            tools=data.get("tools"),  # (a scene of a release before tool lists: none)
        )
        offset = int(data["offset"])
        if offset < 0:
            raise ValueError(f"snapshot offset {offset} is negative")
        return state, offset

    def clone(self) -> TaskState:
        return copy.deepcopy(self)

    def compact(self) -> TaskState:
        """This state without its history: only the latest turn's calls, no per-turn
        records. What the next step needs, and all a snapshot file keeps (shares data
        with ``self``; serialize it, do not mutate it)."""
        calls = {cid: self.calls[cid] for cid in self.turn_calls}
        return replace(self, calls=calls, turns=[], boundaries=None)

    def detached(self) -> TaskState:
        """``compact()`` sharing nothing the fold changes later, so another thread may
        serialize it while the loop goes on: the fold only replaces messages but the last
        (whose content it extends), and changes calls, holds, vcs and compactions in
        place. Costs a list copy, not a serialization."""
        compact = self.compact()
        last = self.messages[-1]
        return replace(
            compact,
            messages=[*self.messages[:-1], {**last, "content": list(last["content"])}],
            calls={cid: replace(call) for cid, call in compact.calls.items()},
            turn_calls=list(self.turn_calls),
            held=list(self.held),
            vcs=dict(self.vcs),
            compactions=[replace(made) for made in self.compactions],
        )


def _spend_of_v1(usage: Usage, turns: list[TurnInfo], made: list[CompactionInfo]) -> Spend:
    """The spend by model of a fork's scene of version 1, whose usage (the parent's branch
    up to the fork point, which was also its whole life) is its turns' and its
    compactions' (a compaction's summary was written by the model of the turn before it).
    When they do not add up to it, the usage is kept under no model (it has no price)."""
    spend: Spend = {}
    model = ""
    for turn in turns:
        model = turn.model
        spend = _plus(spend, model, turn.usage)
        for compaction_made in made:
            if compaction_made.turn == turn.turn and not compaction_made.rewound:
                spend = _plus(spend, model, compaction_made.usage)
    total = sum(spend.values(), Usage())
    return spend if total == usage else {"": usage}


def _plus(spend: Spend, model: str, usage: Usage) -> Spend:
    """``spend`` with ``usage`` added to ``model``'s: a new mapping."""
    return {**spend, model: spend.get(model, Usage()) + usage}


def snapshot_bytes(state: TaskState, offset: int) -> bytes:
    """The snapshot file of ``state`` at journal ``offset``: its compact scene
    (``TaskState.compact``) sealed by ``seal_snapshot``."""
    return seal_snapshot(state.compact().to_snapshot(offset))


def scene_json(state: TaskState, offset: int) -> bytes:
    """The compact scene of ``state`` at journal ``offset`` as JSON: what a store without
    snapshot files keeps (``dump_scene``)."""
    return dump_scene(state.compact().to_snapshot(offset))


def seal_snapshot(scene: JSON) -> bytes:
    """A snapshot file: a magic line, ``scene`` as zlib-compressed JSON, and the crc32 of
    every byte before it, so a flipped bit is a refused snapshot, never a wrong state."""
    body = SNAPSHOT_MAGIC + zlib.compress(dump_scene(scene), 1)
    return body + SNAPSHOT_TRAILER.pack(zlib.crc32(body))


def dump_scene(scene: JSON) -> bytes:
    """``dump_json(scene)`` made a piece at a time: each top-level value, and each slice of
    a top-level list (the messages, the calls). The same bytes, unless a piece holds what
    only the standard library writes (an integer past 64 bits): then the same JSON, with
    the other pieces' floats spelt orjson's way. Snapshots are written on a thread of
    their own while the loop goes on, and one dump of a long transcript would hold the
    GIL throughout (tens of milliseconds at a thousand turns); between pieces, the loop
    thread gets its turn."""

    def piece(value: Any) -> bytes:
        if not isinstance(value, list) or len(value) <= _SCENE_PIECE:
            return dump_json(value)
        # a list's dump is "[" + its items' dumps joined by "," + "]": a slice's, unbracketed
        slices = range(0, len(value), _SCENE_PIECE)
        return b"[" + b",".join(dump_json(value[i : i + _SCENE_PIECE])[1:-1] for i in slices) + b"]"

    return b"{" + b",".join(dump_json(k) + b":" + piece(v) for k, v in scene.items()) + b"}"


#: The items of a list dumped in one go by ``dump_scene``: a few hundred microseconds of
#: holding the GIL, and few enough calls that the pieces cost nothing.
_SCENE_PIECE = 64


def open_snapshot(data: bytes) -> JSON:
    """The scene a snapshot file holds; ValueError if it is damaged or not one of ours."""
    end = len(data) - SNAPSHOT_TRAILER.size
    if not data.startswith(SNAPSHOT_MAGIC) or end < len(SNAPSHOT_MAGIC):
        raise ValueError("not an agentd snapshot (format 2)")
    body, (crc,) = memoryview(data)[:end], SNAPSHOT_TRAILER.unpack_from(data, end)
    if crc != zlib.crc32(body):
        raise ValueError("snapshot checksum mismatch")
    try:  # (views, not copies: a long transcript's snapshot is megabytes)
        scene = load_json(zlib.decompress(body[len(SNAPSHOT_MAGIC) :]))
    except zlib.error as exc:
        raise ValueError(f"snapshot does not decompress: {exc}") from None
    if not isinstance(scene, dict):
        raise ValueError("a snapshot is a JSON object")
    return scene


def parse_snapshot(data: bytes) -> tuple[TaskState, int]:
    """The state and offset of a snapshot file; ValueError (or KeyError, TypeError) if it
    is damaged or not one of ours. A snapshot is a cache: the caller falls back to the
    journal."""
    return TaskState.from_snapshot(open_snapshot(data))


def _tool_result_block(result: JSON, call_id: str) -> JSON:
    block: JSON = {"type": "tool_result", "tool_use_id": call_id, "content": result["content"]}
    if result.get("is_error"):
        block["is_error"] = True
    return block


def fold(prompt: str, records: list[JSON], state: TaskState | None = None) -> TaskState:
    state = state or TaskState(prompt)
    for record in records:
        state.apply(record)
    return state
