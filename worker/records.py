"""The words of a task's journal records: their kinds (``RecordKind``) and how a tool
call ended (``CallOutcome``).

Every record is a JSON object whose ``k`` names its kind (docs/ARCHITECTURE.md, "Record
kinds", says what each carries). The worker writes them, and the fold
(``worker.state.TaskState.apply``), the daemon, the history and the transcript read them
back; each names a kind by a member, never by its text. A member is its text, so a
journal of an earlier release reads back unchanged.
"""

from __future__ import annotations

from enum import StrEnum


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
