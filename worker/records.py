"""The words of a task's journal records: their kinds (``RecordKind``), how a tool call
ended (``CallOutcome``), and the shape of each kind (a TypedDict per kind, ``Record``).

Every record is a JSON object whose ``k`` names its kind (docs/ARCHITECTURE.md, "Record
kinds", says what each carries). The worker writes them, and the fold
(``worker.state.TaskState.apply``), the daemon, the history and the transcript read them
back; each names a kind by a member, never by its text. A member is its text, so a
journal of an earlier release reads back unchanged.

The shapes are what a writer builds, checked by mypy where it builds them; they change
nothing written (the same keys, in the same order). ``at``, the time a record was
written, is added to each by what appends it (``Recorder.record``), and is no part of a
shape. A reader still reads parsed JSON, as a journal of any release holds it, and checks
what it uses.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict


class RecordKind(StrEnum):
    """The ``k`` of a journal record."""

    HEADER = "header"  # the first: the journal's version and task
    BASE = "base"  # a fork's first after its header: the parent's scene at the fork turn
    USER = "user"  # a user message beside the prompt
    TOOLS = "tools"  # the tools the task is offered, at its first start with MCP servers
    TURN = "turn"  # an assistant reply, its usage, model and message id
    INTENT = "intent"  # a tool call about to run: tool, effect, key, attempt
    RESULT = "result"  # what a call returned
    HOLD = "hold"  # calls held for an operator, or a hold on the budget
    DECISION = "decision"  # an operator's decision on a held call, as applied
    COMPACTION = "compaction"  # a summary that replaces the transcript before its tail
    REWIND = "rewind"  # the live branch back to a turn's boundary
    VCS = "vcs"  # a turn boundary's workspace commits
    RETRY = "retry"  # a failed task retried by `agentd retry`
    END = "end"  # done or failed, with the reason


class CallOutcome(StrEnum):
    """How a tool call ended: the ``outcome`` of its ``result`` record, and of the call in
    ``agentd history`` and ``agentd show``."""

    RAN = "ran"  # it ran once, as the model asked
    RERUN = "rerun"  # it was dangling and ran again: safe to repeat, or an operator's rerun
    RECONCILED = "reconciled"  # it was dangling; its tool found out what it had done
    SKIPPED = "skipped"  # it was dangling; an operator skipped it
    OPERATOR = "operator"  # it was dangling; an operator supplied its result
    ERROR = "error"  # it could not run (an unknown tool, bad input, a server that kept failing)
    NOT_RUN = "not_run"  # never run: its reply was cut off at max_tokens (its input may be)
    # never recorded: what the views say of a call with no result yet, or a fork's
    PENDING = "pending"  # its turn is the latest and it has not started
    DANGLING = "dangling"  # it started and never finished: held, or to be settled on resume
    INHERITED = "inherited"  # a fork's call, run by the task it was forked from


# -- the shape of each kind ---------------------------------------------------------------


class Who(TypedDict):
    """Who asked for what a record says (docs/design.md section 15): a rewind, a fork, a
    decision made by an operator."""

    by: NotRequired[str]  # the Unix user
    via: NotRequired[str]  # cli, console, api or run


class HeaderRecord(TypedDict):
    """The first record: the journal's version (its framing) and the task."""

    k: Literal[RecordKind.HEADER]
    v: int
    task: str


class Origin(Who):
    """Where a fork comes from: the parent task and the turn it was forked at."""

    task: str
    turn: int


#: A fork's first record after its header: the parent's scene at the fork turn
#: (``TaskState.to_snapshot``) and ``from``, a word Python keeps (so the functional form).
ForkBaseRecord = TypedDict(
    "ForkBaseRecord",
    {
        "k": Literal[RecordKind.BASE],
        "scene": dict[str, Any],
        "from": Origin,
    },
)


class UserRecord(TypedDict):
    """A user message beside the prompt: a fork's extra prompt, or "continue" after a
    reply cut off at max_tokens. ``content``: the Messages API's content blocks."""

    k: Literal[RecordKind.USER]
    content: list[dict[str, Any]]


class RemoteTool(TypedDict):
    """One MCP tool of a task's recorded list (``worker.mcp.catalog``)."""

    name: str  # what the model sees
    server: str
    tool: str  # the server's own name for it
    description: str
    input_schema: dict[str, Any]
    effect: str
    effect_from: str


class ToolList(TypedDict):
    """A task's recorded tools (the ``tools`` record without its ``k`` and ``at``)."""

    local: list[str]
    mcp: list[RemoteTool]
    listed: dict[str, list[str]]  # every tool each listed server offered: what changes are told by


class ToolsRecord(ToolList):
    """The tools a task is offered, recorded at its first start with MCP servers."""

    k: Literal[RecordKind.TOOLS]


class TurnRecord(TypedDict):
    """An assistant reply: its message, why it stopped, its usage and model; the context
    after it when the API compacted (``tokens_used``), and the API's message id."""

    k: Literal[RecordKind.TURN]
    turn: int
    message: dict[str, Any]  # {"role": "assistant", "content": [...]}
    stop_reason: str | None
    usage: dict[str, int]
    model: str
    tokens_used: NotRequired[int]
    id: NotRequired[str]


class IntentRecord(TypedDict):
    """A tool call about to run. Its input is not copied: it is in the turn's
    ``tool_use`` block (docs/ARCHITECTURE.md, "Record kinds")."""

    k: Literal[RecordKind.INTENT]
    call_id: str
    tool: str
    effect: str
    key: str  # the idempotency key the tool is handed
    attempt: int
    asked: NotRequired[bool]  # it waits for an approval before it runs (docs/guides/tools.md)
    renewed: NotRequired[bool]  # not a start: the attempt held again (its decision expired)


class ResultRecord(TypedDict):
    """What a call returned, its secrets taken out (``Recorder.record``), and how it ended."""

    k: Literal[RecordKind.RESULT]
    call_id: str
    content: str | list[dict[str, Any]]
    is_error: bool
    outcome: CallOutcome


class HeldCall(TypedDict):
    """A call held for an operator, and why."""

    call_id: str
    attempt: int
    tool: str
    why: str


class HoldRecord(TypedDict):
    """Calls held for an operator; or none, and ``budget``: a task held on its budget."""

    k: Literal[RecordKind.HOLD]
    calls: list[HeldCall]
    budget: NotRequired[str]


class DecisionRecord(Who):
    """An operator's decision on a held call, as applied: ``action`` (rerun, skip,
    result), and the skip's ``reason`` or the supplied ``result``."""

    k: Literal[RecordKind.DECISION]
    call_id: str
    attempt: int
    action: str
    reason: NotRequired[str]
    result: NotRequired[str]


class CompactionRecord(TypedDict):
    """A summary that replaces the transcript before its last ``keep`` messages (turns
    ``first`` to ``last``), with the summary call's usage and the estimate around it."""

    k: Literal[RecordKind.COMPACTION]
    summary: str
    keep: int
    first: int
    last: int
    usage: dict[str, int]
    model: str
    tokens_before: int
    tokens_after: int
    trigger: str  # threshold, too_long
    id: NotRequired[str]


class RewindRecord(Who):
    """The live branch back to turn ``to``'s boundary."""

    k: Literal[RecordKind.REWIND]
    to: int


class VcsRecord(TypedDict):
    """A turn boundary's workspace: its HEAD commit and its snapshot commit."""

    k: Literal[RecordKind.VCS]
    turn: int
    commit: str | None
    snapshot: str


class RetryRecord(TypedDict):
    """A failed task retried by ``agentd retry`` goes on: the ``n``-th retry."""

    k: Literal[RecordKind.RETRY]
    n: int


class EndRecord(TypedDict):
    """The task done or failed, and why."""

    k: Literal[RecordKind.END]
    state: str  # done, failed
    reason: str


#: Any record, as a writer builds it; ``k`` tells which.
Record = (
    HeaderRecord
    | ForkBaseRecord
    | UserRecord
    | ToolsRecord
    | TurnRecord
    | IntentRecord
    | ResultRecord
    | HoldRecord
    | DecisionRecord
    | CompactionRecord
    | RewindRecord
    | VcsRecord
    | RetryRecord
    | EndRecord
)

#: The shape of each kind's records.
SHAPES: dict[RecordKind, Any] = {
    RecordKind.HEADER: HeaderRecord,
    RecordKind.BASE: ForkBaseRecord,
    RecordKind.USER: UserRecord,
    RecordKind.TOOLS: ToolsRecord,
    RecordKind.TURN: TurnRecord,
    RecordKind.INTENT: IntentRecord,
    RecordKind.RESULT: ResultRecord,
    RecordKind.HOLD: HoldRecord,
    RecordKind.DECISION: DecisionRecord,
    RecordKind.COMPACTION: CompactionRecord,
    RecordKind.REWIND: RewindRecord,
    RecordKind.VCS: VcsRecord,
    RecordKind.RETRY: RetryRecord,
    RecordKind.END: EndRecord,
}
