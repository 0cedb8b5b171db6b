"""Liveness verdicts: is a worker hung, stalled, or alive until when. Pure functions; the
daemon asks them when one could be due (``supervisor.watch``).

A verdict compares times on one clock, ``CLOCK_MONOTONIC``, which on Linux is system-wide
(every process reads the same clock) and is never stepped: an NTP correction, an operator's
``date -s`` or a VM resumed with a new wall time moves the wall clock only. A worker's
heartbeat (``worker/heartbeat.py``) carries both clocks for each instant it records: ``at``
and ``phase_started`` (wall time, for display) and ``at_mono`` and ``phase_started_mono``
(monotonic, for verdicts).

A heartbeat without the monotonic fields comes from a worker of an earlier release that
this daemon adopted; its wall times are carried over to the monotonic clock at the
moment of reading (``Beat.of``), which is what judging by the wall clock amounts to, for
the life of that worker.

``judge`` is the whole policy: the daemon reads the beat when its ``Watch`` says a verdict
could be due, calls it and carries out its verdict, as ``agentd run`` does.

A worker on a spool holds its own dead-man (``worker/heartbeat.py``): the kernel kills it
``heartbeat.timeout`` after its last beat, stopped or not. Its hang is then no instant to
wake for: the daemon learns it from the exit (``hung_by_deadman``), and reads the beat only
when a deadline could pass. A daemon whose ``heartbeat.timeout`` is shorter than the
worker's dead-man (a reload shortened it) judges the beat's age itself, as it does for a
worker without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.config import Config
from worker.protocol import heartbeat_shaped


@dataclass(frozen=True)
class Limits:
    """What the verdict enforces, from ``[heartbeat]`` and ``[deadlines]``."""

    interval: float  # heartbeat.interval: how often a worker started now beats
    timeout: float  # heartbeat.timeout
    model_call: float  # deadlines.model_call
    tool_call: float  # deadlines.tool_call plus the slack a tool gets to record its timeout

    @property
    def shortest_call(self) -> float:
        """The shortest deadline a phase can have."""
        return min(self.model_call, self.tool_call)


#: Seconds past ``deadlines.tool_call`` before a tool call is stalled: a tool is told its
#: deadline and may keep it itself, recording its timed-out result first.
TOOL_DEADLINE_SLACK = 1.0


def limits_of(config: Config) -> Limits:
    """The limits ``[heartbeat]`` and ``[deadlines]`` of ``config`` set."""
    hb, deadlines = config.heartbeat, config.deadlines
    return Limits(
        interval=hb.interval,
        timeout=hb.timeout,
        model_call=deadlines.model_call,
        tool_call=deadlines.tool_call + TOOL_DEADLINE_SLACK,
    )


@dataclass(frozen=True)
class Beat:
    """One heartbeat, its instants on the monotonic clock."""

    at: float
    phase: str
    phase_started: float
    interval: float | None = None  # the worker's own beat interval (None: not recorded)
    deadman: float | None = None  # the seconds its dead-man was armed ahead (None: none)

    @classmethod
    def of(cls, data: Mapping[str, Any], wall: float, mono: float) -> Beat:
        """The beat a worker wrote (``worker.protocol.heartbeat_shaped``), read at wall time
        ``wall`` and monotonic time ``mono``."""
        at_wall = float(data["at"])
        started_wall = float(data.get("phase_started", at_wall))
        at = data.get("at_mono")
        started = data.get("phase_started_mono")
        interval = data.get("interval")
        deadman = data.get("deadman")
        return cls(
            at=float(at) if at is not None else mono - (wall - at_wall),
            phase=str(data.get("phase", "idle")),
            phase_started=float(started) if started is not None else mono - (wall - started_wall),
            interval=float(interval) if interval is not None else None,
            deadman=float(deadman) if deadman is not None else None,
        )

    @classmethod
    def of_worker(cls, data: Any, pid: int, wall: float, mono: float) -> Beat | None:
        """The beat in ``data`` (a heartbeat as read) if worker ``pid`` wrote it and it has
        the shape a worker writes, else None (none yet, or a previous worker's)."""
        if not heartbeat_shaped(data) or data.get("pid") != pid:
            return None
        return cls.of(data, wall, mono)

    def age(self, mono: float) -> float:
        """Seconds since the beat was written; never negative (a beat read just as it is
        written, or a pre-monotonic beat across a wall-clock step)."""
        return max(0.0, mono - self.at)


@dataclass(frozen=True)
class Alive:
    """No verdict before ``until`` (monotonic): the next read of the heartbeat is then."""

    until: float


@dataclass(frozen=True)
class Hung:
    """The heartbeat went silent: the worker cannot checkpoint; kill it at once."""

    age: float


@dataclass(frozen=True)
class Stalled:
    """The current model or tool call ran past its deadline: TERM, grace, KILL."""

    phase: str
    age: float


Verdict = Alive | Hung | Stalled


def phase_limit(phase: str, limits: Limits) -> float | None:
    """The deadline of a phase: ``model`` and ``compaction`` (a summary call) have the
    model call's, a tool its own plus slack (a tool is told its deadline and may keep it
    itself, as run_command does: it records its timed-out result first), ``idle`` none."""
    if phase == "idle":
        return None
    return limits.model_call if phase in ("model", "compaction") else limits.tool_call


def judge(beat: Beat | None, spawned: float, now: float, limits: Limits) -> Verdict:
    """The verdict on a worker started at ``spawned`` whose last beat is ``beat`` (None
    when it has not beaten yet), at ``now``; every time is monotonic.

    A worker that beats more slowly than ``heartbeat.interval`` says (one started before a
    reload shortened it) gets the difference added to the timeout: it is judged by the
    margin the config allows over its own interval, never by one it cannot meet.

    ``Alive.until`` is the earliest instant a verdict could fall due: the beat passing the
    timeout (unless the worker's own dead-man kills it by then), the phase passing its
    deadline, or, since a phase that begins after this read has a whole deadline ahead of
    it, the shortest deadline from now."""
    last = beat.at if beat is not None else spawned
    timeout = limits.timeout
    if beat is not None and beat.interval is not None:
        timeout += max(0.0, beat.interval - limits.interval)
    if now - last > timeout:
        return Hung(now - last)
    until = now + limits.shortest_call
    if beat is None or beat.deadman is None or beat.deadman > timeout:
        until = min(until, last + timeout)  # no dead-man keeps the timeout: judged here
    if beat is None:
        return Alive(until)
    limit = phase_limit(beat.phase, limits)
    if limit is None:
        return Alive(until)
    if now - beat.phase_started > limit:
        return Stalled(beat.phase, now - beat.phase_started)
    return Alive(min(until, beat.phase_started + limit))


@dataclass(frozen=True)
class KilledHung:
    """A worker its own dead-man killed: its beat's age at the exit, and how far ahead it
    had armed the dead-man. ``worker_hung`` says both."""

    age: float
    deadman: float

    def fields(self) -> dict[str, float]:
        """The ``worker_hung`` event's fields."""
        return {"age": round(self.age, 3), "deadman": self.deadman}


def hung_by_deadman(beat: Beat | None, signal: str | None, now: float) -> KilledHung | None:
    """The hang of a worker that ended by SIGKILL nobody here sent, when its dead-man had
    expired by ``now`` (it was hung: the kernel killed it), else None. (A ``kill -9`` from
    elsewhere at the very instant reads the same; either is a crash.)"""
    if signal != "SIGKILL" or beat is None or beat.deadman is None:
        return None
    age = beat.age(now)
    return KilledHung(age, beat.deadman) if age >= beat.deadman else None
