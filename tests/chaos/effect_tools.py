"""User tools of every effect class whose side effects land in an *external* record.

Loaded by chaos workers through ``[tools] modules = ["tests.chaos.effect_tools"]`` (with the
repository on ``PYTHONPATH``). The "outside world" of these tools is a folder next to the
effects log, never the task's workspace, so nothing a worker or a resume does to its own
spool can hide an effect:

* ``AGENTD_CHAOS_EFFECTS``: the effects log, one JSON line per action, written with a single
  ``O_APPEND`` write and fsync'd before the tool goes on. A line is
  ``{"kind", "tool", "effect", "tag", "call_id", "key", "pid", "result", "at"}``, kind one of
  ``exec`` (a read, no side effect), ``effect`` (a real side effect), ``dup`` (the keyed
  service recognised the key and did nothing), ``reconciled`` (the reconcile check found
  the effect), ``self_kill`` (the tool is about to SIGKILL its own worker; ``when`` says
  ``before`` or ``after`` the effect).
* ``AGENTD_CHAOS_SELF_KILL``: probability (0..1) that a tool kills its own worker with
  SIGKILL right after its side effect is durable and before the worker records its result:
  the instant where a crash makes the outcome of a call unknown although it took effect.
* ``AGENTD_CHAOS_SELF_KILL_BEFORE``: probability that a tool kills its worker after the
  call's intent is durable and right before its side effect (unknown, and it did not).
* ``AGENTD_CHAOS_SELF_KILL_TAGS``: when set, a comma-separated list of the ``tag`` inputs
  of the calls that may kill their worker; the others never do.
* ``AGENTD_CHAOS_SELF_KILL_ONCE``: when set, a token: a call kills its worker only if no
  ``self_kill`` line of its tag carries that token yet, so a worker restarted with the same
  environment (``agentd run`` restarts its own) runs the call again without dying again.
* ``AGENTD_CHAOS_JITTER``: up to this many seconds of sleep before and after the effect, so
  that kills at random instants land inside a tool call too.

For the unsafe tool the line *is* the effect (a charge on a ledger): effect and record are
one atomic append, so the log is exact. The keyed "service" deduplicates by idempotency key
under a lock, by looking for an ``effect`` line with the key, so it too logs only real
effects. The idempotent tool sets a value in a key-value folder (the same state however often
it runs) and logs each run. The campaign (``tests.chaos.kill9``) reads the log to decide held
calls like a careful operator and to count repeated effects.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker.store.durable import atomic_write
from worker.tools.registry import Effect, ToolContext, ToolError, tool

EFFECTS_ENV = "AGENTD_CHAOS_EFFECTS"
SELF_KILL_ENV = "AGENTD_CHAOS_SELF_KILL"
SELF_KILL_BEFORE_ENV = "AGENTD_CHAOS_SELF_KILL_BEFORE"
SELF_KILL_TAGS_ENV = "AGENTD_CHAOS_SELF_KILL_TAGS"
SELF_KILL_ONCE_ENV = "AGENTD_CHAOS_SELF_KILL_ONCE"
JITTER_ENV = "AGENTD_CHAOS_JITTER"

_rng = random.Random()  # chaos, not cryptography


def effects_log() -> Path:
    named = os.environ.get(EFFECTS_ENV, "")
    if not named:
        raise ToolError(f"{EFFECTS_ENV} is not set: the chaos tools have no outside world")
    return Path(named)


def world_dir() -> Path:
    """The folder that stands for the outside world: next to the log, outside the spool."""
    log = effects_log()
    path = log.with_name(log.name + ".world")
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every whole line of an effects log (a line cut by a kill mid-write is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = []
    for raw in text.splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            if isinstance(line, dict):
                lines.append(line)
    return lines


def _env_float(name: str) -> float:
    try:
        return max(0.0, float(os.environ.get(name, "0") or 0))
    except ValueError:
        return 0.0


def _jitter() -> None:
    if (most := _env_float(JITTER_ENV)) > 0:
        time.sleep(_rng.uniform(0, most))


def _append(line: dict[str, Any]) -> None:
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
    fd = os.open(effects_log(), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)  # one small O_APPEND write: whole or absent
        os.fsync(fd)
    finally:
        os.close(fd)


def _line(
    ctx: ToolContext, kind: str, name: str, effect: Effect, tag: str, result: str
) -> dict[str, Any]:
    return {
        "kind": kind,
        "tool": name,
        "effect": effect.value,
        "tag": tag,
        "call_id": ctx.call_id,
        "key": ctx.idempotency_key,
        "pid": os.getpid(),
        "result": result,
        "at": time.time(),
    }


def _acted(ctx: ToolContext, kind: str, name: str, effect: Effect, tag: str, result: str) -> str:
    """Record what the tool just did, then maybe die before the worker records the result."""
    _append(_line(ctx, kind, name, effect, tag, result))
    _after(ctx, name, effect, tag)
    return result


def _after(ctx: ToolContext, name: str, effect: Effect, tag: str) -> None:
    """The instant after a durable effect: maybe SIGKILL this worker, else dawdle a little."""
    _maybe_die(ctx, name, effect, tag, "after", _env_float(SELF_KILL_ENV))
    _jitter()


def _before(ctx: ToolContext, name: str, effect: Effect, tag: str) -> None:
    """The instant before the effect (the intent is durable): dawdle, maybe SIGKILL."""
    _jitter()
    _maybe_die(ctx, name, effect, tag, "before", _env_float(SELF_KILL_BEFORE_ENV))


def _maybe_die(ctx: ToolContext, name: str, effect: Effect, tag: str, when: str, p: float) -> None:
    tags = os.environ.get(SELF_KILL_TAGS_ENV, "")
    if tags and tag not in tags.split(","):
        return
    once = os.environ.get(SELF_KILL_ONCE_ENV, "")
    if once and any(
        line.get("kind") == "self_kill" and line.get("tag") == tag and line.get("once") == once
        for line in read_log(effects_log())
    ):
        return
    if p > 0 and _rng.random() < p:
        line = {**_line(ctx, "self_kill", name, effect, tag, ""), "when": when}
        _append({**line, "once": once} if once else line)
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _service_lock() -> Iterator[None]:
    fd = os.open(world_dir() / "service.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _delivered(key: str) -> dict[str, Any] | None:
    for line in read_log(effects_log()):
        if line.get("kind") == "effect" and line.get("key") == key:
            return line
    return None


def _kv(name: str) -> Path:
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ToolError(f"bad name {name!r}: letters, digits, '-' and '_' only")
    return world_dir() / f"kv-{name}"


# -- the tools ------------------------------------------------------------------------


@tool(effect=Effect.READ_ONLY)
def chaos_lookup(ctx: ToolContext, tag: str, name: str) -> str:
    """Read a value from the outside key-value store (no side effect)."""
    _before(ctx, "chaos_lookup", Effect.READ_ONLY, tag)
    try:
        value = _kv(name).read_text()
    except FileNotFoundError:
        value = "<unset>"
    return _acted(ctx, "exec", "chaos_lookup", Effect.READ_ONLY, tag, f"{name} = {value}")


@tool(effect=Effect.IDEMPOTENT)
def chaos_set(ctx: ToolContext, tag: str, name: str, value: str) -> str:
    """Set a value in the outside key-value store (setting it twice is setting it once)."""
    _before(ctx, "chaos_set", Effect.IDEMPOTENT, tag)
    atomic_write(_kv(name), value.encode())
    return _acted(ctx, "effect", "chaos_set", Effect.IDEMPOTENT, tag, f"{name} set to {value}")


def _keyed(ctx: ToolContext, name: str, tag: str, what: str) -> str:
    """The deduplicating service: one real effect per idempotency key, ever."""
    if not ctx.idempotency_key:
        raise ToolError(f"{name} needs an idempotency key")
    _before(ctx, name, Effect.KEYED, tag)
    with _service_lock():
        earlier = _delivered(ctx.idempotency_key)
        if earlier is None:
            kind, result = "effect", f"{what} (key {ctx.idempotency_key})"
        else:
            kind, result = "dup", f"{earlier['result']} (duplicate suppressed)"
        _append(_line(ctx, kind, name, Effect.KEYED, tag, result))
    _after(ctx, name, Effect.KEYED, tag)
    return result


def _send_reconcile(ctx: ToolContext, data: dict[str, Any]) -> str | None:
    """Has this call's key already been delivered? Then its result, else None (unknown)."""
    earlier = _delivered(ctx.idempotency_key)
    if earlier is None:
        return None
    tag = str(data.get("tag", ""))
    _append(_line(ctx, "reconciled", "chaos_send", Effect.KEYED, tag, earlier["result"]))
    return f"{earlier['result']} (already delivered)"


@tool(effect=Effect.KEYED, reconcile=_send_reconcile)
def chaos_send(ctx: ToolContext, tag: str, to: str, body: str) -> str:
    """Send a message through the outside service, deduplicated by idempotency key."""
    return _keyed(ctx, "chaos_send", tag, f"sent {len(body)} chars to {to}")


@tool(effect=Effect.KEYED)
def chaos_enqueue(ctx: ToolContext, tag: str, item: str) -> str:
    """Enqueue a job on the outside service, deduplicated by idempotency key (no reconcile
    check: a dangling call is re-run with its key and the service drops the duplicate)."""
    return _keyed(ctx, "chaos_enqueue", tag, f"enqueued {item}")


@tool(effect=Effect.UNSAFE)
def chaos_charge(ctx: ToolContext, tag: str, amount: int) -> str:
    """Charge an amount on the outside ledger. Not idempotent: a second run charges again."""
    _before(ctx, "chaos_charge", Effect.UNSAFE, tag)
    ref = f"ch-{ctx.call_id[-8:]}-{os.getpid()}"
    return _acted(ctx, "effect", "chaos_charge", Effect.UNSAFE, tag, f"charged {amount} ({ref})")


@tool(effect=Effect.UNSAFE)
def chaos_slow_charge(ctx: ToolContext, tag: str, amount: int, seconds: float) -> str:
    """Charge an amount on the outside ledger once ``seconds`` have passed (a long call,
    for a freeze to catch in flight). Not idempotent: a second run charges again."""
    _before(ctx, "chaos_slow_charge", Effect.UNSAFE, tag)
    time.sleep(max(0.0, min(float(seconds), 60.0)))
    ref = f"ch-{ctx.call_id[-8:]}-{os.getpid()}"
    return _acted(
        ctx, "effect", "chaos_slow_charge", Effect.UNSAFE, tag, f"charged {amount} ({ref})"
    )


#: The tools of the kill -9 and compaction campaigns (the slow charge is class 21's).
CHAOS_TOOLS = ("chaos_lookup", "chaos_set", "chaos_send", "chaos_enqueue", "chaos_charge")
