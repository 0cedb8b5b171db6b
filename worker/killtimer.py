"""A kill armed in the kernel: this process receives SIGKILL at a deadline, stopped or not.

A worker that keeps a lease (``worker.lease``) stops itself when the lease may have
ended. A worker that is frozen (SIGSTOP of its node's tree, a paused VM, a machine that
swaps it out) cannot: it acts again only after the thaw, and by then another node may
have taken the task and the frozen worker's tool may still be running. So the deadline is
handed to the kernel before any tool runs: a POSIX timer (``timer_create``) on
``CLOCK_BOOTTIME`` whose expiry sends the process SIGKILL (``SIGEV_SIGNAL``). The kernel
delivers it whether or not the process is scheduled: SIGKILL ends a stopped process too.
Its tools then die with it: bubblewrap's ``--die-with-parent`` (``PR_SET_PDEATHSIG``)
kills the sandbox, whose PID namespace takes every process in it down.

``CLOCK_BOOTTIME`` is the monotonic clock that also counts a system suspend: no wall-clock
step moves it, and a laptop's sleep does not stop it. A timer is the process's own: a
fork does not inherit it, and an exec deletes it.

Where ``timer_create`` cannot be had (no such function in the C library, or the kernel
refuses), ``KillTimer.create`` says why in one line and the worker runs on with its own
deadline only (``worker.lease``): what it had before.

The heartbeat's dead-man (``worker.heartbeat``) is a timer of the same kind on
``CLOCK_MONOTONIC``, the clock the daemon's liveness verdicts are on (``CLOCK_BOOTTIME``
would kill every worker as hung on a laptop's wake-up), armed a timeout ahead at every
beat (``arm_in``): a worker that cannot beat any more (stopped, or its interpreter stuck)
is killed by the kernel at the instant the daemon would have judged it hung.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import time
from typing import Protocol

#: ``CLOCK_BOOTTIME`` and ``CLOCK_MONOTONIC`` (linux/time.h), ``TIMER_ABSTIME``, ``SIGEV_SIGNAL``.
CLOCK_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", 7)
CLOCK_MONOTONIC = time.CLOCK_MONOTONIC
TIMER_ABSTIME = 1
SIGEV_SIGNAL = 0
_SIGEV_SIZE = 64  # sizeof(struct sigevent) on Linux, every architecture


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Sigevent(ctypes.Structure):
    # union sigval (a pointer's size), then sigev_signo and sigev_notify, then padding
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("_pad", ctypes.c_byte * (_SIGEV_SIZE - ctypes.sizeof(ctypes.c_void_p) - 8)),
    ]


class Timer(Protocol):
    """What a lease keeper needs of a kill timer (``KillTimer``, or a test's stand-in)."""

    def arm_at(self, deadline: float) -> None: ...
    def disarm(self) -> None: ...
    def close(self) -> None: ...


class DeadMan(Protocol):
    """What a heartbeat needs of a kill timer: a kill that many seconds from now."""

    def arm_in(self, seconds: float) -> None: ...


def boottime() -> float:
    """Now on ``CLOCK_BOOTTIME``: the clock a ``KillTimer`` deadline is read on."""
    return time.clock_gettime(CLOCK_BOOTTIME)


def _library() -> ctypes.CDLL:
    """The C library that has ``timer_create``: libc itself since glibc 2.34, else librt."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "timer_create"):
        return libc
    name = ctypes.util.find_library("rt")
    if name is None:
        raise OSError("timer_create is not in the C library and there is no librt")
    return ctypes.CDLL(name, use_errno=True)


def _timespec(seconds: float) -> _Timespec:
    whole = int(seconds)
    return _Timespec(whole, int((seconds - whole) * 1e9))


class KillTimer:
    """One POSIX timer of this process that sends it SIGKILL when it expires.

    ``arm_at`` sets (or moves) the deadline, a time on the timer's clock (``boottime`` for
    ``CLOCK_BOOTTIME``, the default), ``arm_in`` one that many seconds from now;
    ``disarm`` takes it back; ``close`` deletes the timer. Made by ``create``, which says
    why when the kernel or the C library has none."""

    def __init__(
        self, lib: ctypes.CDLL, timer: ctypes.c_void_p, clock: int = CLOCK_BOOTTIME
    ) -> None:
        self._lib = lib
        self._clock = clock
        self._timer: ctypes.c_void_p | None = timer
        self._pid = os.getpid()
        self.deadline: float | None = None  # the armed deadline, None when disarmed

    @classmethod
    def create(cls, clock: int = CLOCK_BOOTTIME) -> KillTimer | str:
        """A disarmed timer on ``clock``, or the one-line reason there can be none here."""
        try:
            lib = _library()
            lib.timer_create.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_Sigevent),
                ctypes.POINTER(ctypes.c_void_p),
            ]
            lib.timer_settime.argtypes = [
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.POINTER(_Itimerspec),
                ctypes.POINTER(_Itimerspec),
            ]
            lib.timer_delete.argtypes = [ctypes.c_void_p]
        except (OSError, AttributeError) as exc:
            return f"no kernel kill timer: {exc}"
        event = _Sigevent(sigev_signo=signal.SIGKILL, sigev_notify=SIGEV_SIGNAL)
        timer = ctypes.c_void_p()
        if lib.timer_create(clock, ctypes.byref(event), ctypes.byref(timer)) != 0:
            return f"no kernel kill timer: timer_create refused ({os.strerror(ctypes.get_errno())})"
        return cls(lib, timer, clock)

    def arm_at(self, deadline: float) -> None:
        """SIGKILL this process at ``deadline`` (seconds on its clock), replacing any
        deadline armed before; a deadline already past kills it at once."""
        self._set(_Itimerspec(_Timespec(0, 0), _timespec(max(deadline, 1e-9))), TIMER_ABSTIME)
        self.deadline = deadline

    def arm_in(self, seconds: float) -> None:
        """SIGKILL this process ``seconds`` from now, replacing any deadline armed before
        (relative: the kernel counts from its own now)."""
        self._set(_Itimerspec(_Timespec(0, 0), _timespec(max(seconds, 1e-9))), 0)
        self.deadline = time.clock_gettime(self._clock) + seconds

    def disarm(self) -> None:
        """No kill until the next ``arm_at``."""
        self._set(_Itimerspec(_Timespec(0, 0), _Timespec(0, 0)), 0)
        self.deadline = None

    def close(self) -> None:
        """Delete the timer (disarmed with it); a fork's copy of this object does nothing."""
        if self._timer is not None and os.getpid() == self._pid:
            self._lib.timer_delete(self._timer)
        self._timer = None
        self.deadline = None

    def _set(self, value: _Itimerspec, flags: int) -> None:
        if self._timer is None or os.getpid() != self._pid:
            return  # closed, or a forked child's copy (timers are not inherited)
        if self._lib.timer_settime(self._timer, flags, ctypes.byref(value), None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timer_settime: {os.strerror(errno)}")
