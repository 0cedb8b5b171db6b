"""Process trees of chaos class 21 (``tests.chaos.nodes``): a node's daemon, fork server and
workers (each worker in a session of its own, so a process group is not enough), frozen
with SIGSTOP walk by walk until no new process appears, thawed, or killed whole."""

from __future__ import annotations

import contextlib
import functools
import signal

import psutil

from tests.daemon import reap_orphans
from tests.support import poll_for


def freeze_tree(root: int) -> list[psutil.Process]:
    """SIGSTOP process ``root`` and every descendant, walking the tree again until no new
    one appears (a process that forked just before its parent stopped is found on the next
    walk; a stopped one forks no more). The frozen processes, root first."""
    frozen: dict[int, psutil.Process] = {}
    while True:
        try:
            top = psutil.Process(root)
            found = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        new = [p for p in found if p.pid not in frozen]
        if not new:
            return list(frozen.values())
        for proc in new:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP)  # (psutil checks it is still that process)
                frozen[proc.pid] = proc
        # A signal is delivered when its process is next scheduled: walk again only once
        # each has stopped, so that no fork of theirs can come after the walk.
        poll_for(functools.partial(_halted, new), 5.0, what="SIGSTOP to land")


def _halted(procs: list[psutil.Process]) -> bool:
    """Each stopped, or gone (a zombie, or reaped)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                return False
    return True


def thaw(frozen: list[psutil.Process]) -> None:
    """SIGCONT every process ``freeze_tree`` stopped (those still there)."""
    for proc in frozen:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGCONT)


def kill_tree(root: int) -> int:
    """``kill -9`` of ``root``'s whole tree, frozen first so that none escapes by forking;
    returns once every one has died, with how many there were."""
    return kill_frozen(freeze_tree(root))


def kill_frozen(frozen: list[psutil.Process], timeout: float = 10.0) -> int:
    """SIGKILL every process ``freeze_tree`` stopped; returns once all have died (orphans
    reaped: this process is their subreaper), with how many there were."""
    for proc in frozen:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(frozen, timeout=timeout)
    reap_orphans()
    if alive:
        raise RuntimeError(f"processes outlived SIGKILL: {[p.pid for p in alive]}")
    return len(frozen)
