"""The fork server: workers start from a warm, preloaded process.

``python -m worker.forkserver`` imports the worker and the ``anthropic`` SDK once (the
SDK import alone costs about a second and 80 MB), freezes the garbage collector's view
of what it loaded, and then serves spawn requests on its standard input, one JSON object
a line::

    -> {"task": "/spool/tasks/t1", "config": null, "env": {...}, "output": ".../worker.log"}
    <- {"pid": 4242}                       or   {"error": "why"}

Each worker is forked from this warm state, so a restart skips the import and the
pages it loaded stay shared between workers (copy-on-write). The fork is double: an
intermediate child forks the worker and exits at once, so the worker is re-parented to
the supervisor, which declares itself a child subreaper. The supervisor therefore
reaps its workers and reads their exit status directly, however they were started.

The server is single-threaded and creates no client before forking, so a child
inherits no lock held by another thread and no open connection. It exits when its
standard input closes (the supervisor is gone).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from typing import Any


def preload() -> None:
    """Import everything a worker needs, then keep it out of the collector's way."""
    import anthropic  # noqa: F401, PLC0415
    import psutil  # noqa: F401, PLC0415

    import worker.__main__  # noqa: PLC0415
    import worker.models.messages_api  # noqa: PLC0415
    import worker.models.scripted  # noqa: F401, PLC0415

    gc.collect()
    gc.freeze()  # collections in children leave the preloaded objects' pages shared


def _become_worker(request: dict[str, Any]) -> None:
    """In the grandchild: set up the process as ``python -m worker`` would be, run it."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    out = os.open(request["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    args = [request["task"]]
    if request.get("config"):
        args += ["--config", request["config"]]
    from worker.__main__ import main  # noqa: PLC0415

    code = 1
    try:
        code = main(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn(request: dict[str, Any]) -> int:
    """Double-fork a worker for ``request``; its pid."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                _become_worker(request)
            os.write(write_end, f"{pid}\n".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(middle, 0)
    return int(data)


def serve() -> int:
    preload()
    os.write(1, b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            reply: dict[str, Any] = {"pid": spawn(request)}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(1, (json.dumps(reply) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(serve())
