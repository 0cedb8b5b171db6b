"""``reconcile.plan``: every effect class x policy x decision x tool presence x reconcile."""

from __future__ import annotations

import itertools

import pytest

from worker.reconcile import Action, Plan, plan
from worker.state import Call
from worker.tools.registry import Effect, Tool, ToolContext

EFFECTS = list(Effect)
POLICIES = [None, "rerun", "hold"]
DECISIONS = [None, "rerun", "skip", "result"]


def _func(ctx: ToolContext) -> str:
    return "ran"


def _reconcile(ctx: ToolContext, data: dict[str, object]) -> str | None:
    return None


def _tool(effect: Effect, reconcilable: bool) -> Tool:
    return Tool(
        "t", "a tool", effect, {"type": "object", "properties": {}}, _func,
        _reconcile if reconcilable else None,
    )  # fmt: skip


def _call(effect: Effect | None, decision: str | None) -> Call:
    call = Call("toolu_1", "t", {}, turn=1, effect=effect, key="k", attempt=1)
    if decision is not None:
        call.decision = {"k": "decision", "call_id": "toolu_1", "attempt": 1, "action": decision}
    return call


def expected(
    effect: Effect, policy: str | None, decision: str | None, present: bool, reconcilable: bool
) -> tuple[Action, bool]:
    """docs/design.md section 5, written out independently of the code under test."""
    if decision is not None:  # 1. the operator's word is final; no reconcile needed
        return Action(decision), False
    if not present:  # an unknown tool: nobody can tell whether re-running is safe
        return Action.HOLD, False
    # 2. the reconcile check is tried first whenever the tool has one
    if policy is not None:  # 3. a policy override
        return (Action.RERUN if policy == "rerun" else Action.HOLD), reconcilable
    safe = effect in (Effect.READ_ONLY, Effect.IDEMPOTENT, Effect.KEYED)  # 4. the class
    return (Action.RERUN if safe else Action.HOLD), reconcilable


CASES = list(itertools.product(EFFECTS, POLICIES, DECISIONS, [True, False], [True, False]))


@pytest.mark.parametrize(
    ("effect", "policy", "decision", "present", "reconcilable"),
    CASES,
    ids=[
        f"{e.value}-policy:{p}-decision:{d}-{'tool' if t else 'no_tool'}-"
        f"{'reconcile' if r else 'no_reconcile'}"
        for e, p, d, t, r in CASES
    ],
)
def test_plan(
    effect: Effect, policy: str | None, decision: str | None, present: bool, reconcilable: bool
) -> None:
    call = _call(effect, decision)
    tool = _tool(effect, reconcilable) if present else None
    policies = {"t": policy} if policy else {}
    step = plan(call, tool, policies)
    assert isinstance(step, Plan)
    assert (step.action, step.try_reconcile) == expected(
        effect, policy, decision, present, reconcilable
    )
    assert step.why  # every plan says why, for the dangling_* events


def test_case_count() -> None:
    assert len(CASES) == 4 * 3 * 4 * 2 * 2


def test_unsafe_without_anything_holds_and_says_why() -> None:
    step = plan(_call(Effect.UNSAFE, None), _tool(Effect.UNSAFE, False), {})
    assert step == Plan(Action.HOLD, False, "unsafe: its outcome is unknown")


def test_missing_tool_is_named() -> None:
    step = plan(_call(Effect.READ_ONLY, None), None, {})
    assert "'t'" in step.why
    assert "no longer available" in step.why


def test_policy_of_another_tool_does_not_apply() -> None:
    step = plan(_call(Effect.UNSAFE, None), _tool(Effect.UNSAFE, False), {"other": "rerun"})
    assert step.action is Action.HOLD


@pytest.mark.parametrize(
    ("recorded", "now", "action"),
    [
        (Effect.UNSAFE, Effect.IDEMPOTENT, Action.HOLD),
        (Effect.IDEMPOTENT, Effect.UNSAFE, Action.RERUN),
        (None, Effect.UNSAFE, Action.HOLD),
        (None, Effect.KEYED, Action.RERUN),
    ],
)
def test_the_effect_recorded_with_the_intent_counts(
    recorded: Effect | None, now: Effect, action: Action
) -> None:
    """The call ran under the effect class recorded in its intent; a tool redeclared
    later does not change what is known about that call (absent: the tool's class)."""
    assert plan(_call(recorded, None), _tool(now, False), {}).action is action


@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("reconcilable", [True, False])
def test_a_call_asked_before_it_runs_holds_until_decided_whatever_its_class(
    effect: Effect, policy: str | None, reconcilable: bool
) -> None:
    # docs/guides/tools.md: it never ran, so there is nothing to reconcile, and it
    # runs only on a decision: neither its class nor a policy runs it by itself
    call = _call(effect, None)
    call.asked = True
    policies = {"t": policy} if policy else {}
    step = plan(call, _tool(effect, reconcilable), policies)
    assert (step.action, step.try_reconcile) == (Action.HOLD, False)
    assert step.why == "waits for approval before it runs"
    call.decision = {"k": "decision", "call_id": "toolu_1", "attempt": 1, "action": "rerun"}
    assert plan(call, _tool(effect, reconcilable), policies).action is Action.RERUN
