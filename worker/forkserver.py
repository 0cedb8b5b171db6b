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

Once the supervisor has said so (``{"standby": {"config": PATH}}``, a line it sends when
the server is ready and again at each reload, which is not answered), the server keeps
one *standby*: a worker forked ahead of need, in its own session, that has read the
config file ahead (``worker.standby``) and waits for a request on a pipe of its own.
The next request goes to it: no fork on the way to the worker's start. Its intermediate
parent stays until then, so a standby is no child of the supervisor (not a worker of
its, not a stray) until the server ends that parent and hands it the request; the server
forks the next standby after it has answered. A standby holds no task's file or secret
before its request; it exits when its pipe closes: when the server replaces it, or ends
however it ends.

The server takes over the daemon's secrets at start (``worker.credentials``: through a
pipe, never in its environment, which is what every forked worker's ``/proc/PID/environ``
shows) and is non-dumpable, as its workers are; they inherit the secrets in memory.

The server is single-threaded and keeps no client: the two it builds while preloading
(``warm_sdk``) open no socket and are closed before the first fork, so a child inherits
no lock held by another thread and no open connection. It exits when its
standard input closes (the supervisor is gone).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker import proctitle
from worker.credentials import take_over
from worker.output import LOG_FILE_LIMIT, BoundedOutput
from worker.standby import ConfigAhead
from worker.store.durable import open_private

#: The argument that has the server preload the ``mcp`` SDK too: given by a daemon whose
#: config has ``[mcp.servers]``. Its import costs a worker that starts a server about
#: 0.65 s and the server 26 MB (docs/results/performance.md): worth it only where servers
#: are configured, so it is not preloaded otherwise.
PRELOAD_MCP = "--preload-mcp"

#: The key of the supervisor's line that (re)places the standby, with what it reads
#: ahead: ``{"standby": {"config": PATH}}``. A line that is not answered.
STANDBY = "standby"


def preload(*, mcp: bool = False) -> None:
    """Import everything a worker needs (with ``mcp``, the MCP SDK too), then keep it out
    of the collector's way."""
    import anthropic  # noqa: F401, PLC0415  (imported to be in memory before the forks)
    import psutil  # noqa: F401, PLC0415  (the same)

    import worker.__main__  # noqa: PLC0415  (preloaded here, not at the module's import)
    import worker.models.messages_api  # noqa: PLC0415  (the same)
    import worker.models.scripted  # noqa: PLC0415  (the same)
    import worker.tools.builtin  # noqa: PLC0415  (the same: it registers the tools)

    if mcp:
        import worker.mcp.session  # noqa: F401, PLC0415  (the SDK: imports only, no thread)

        print("agentd fork server: the mcp SDK preloaded", file=sys.stderr, flush=True)

    warm_sdk()
    gc.collect()
    gc.freeze()  # collections in children leave the preloaded objects' pages shared


#: One streamed reply (a text block and a tool call), as the Messages API sends it.
_WARM_EVENTS: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_preload",
            "type": "message",
            "role": "assistant",
            "model": "preload",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "toolu_preload", "name": "t", "input": {}},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": "{}"},
    },
    {"type": "content_block_stop", "index": 1},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 1},
    },
    {"type": "message_stop"},
]


#: A request shaped as a worker's resumed one: a system prompt, a tool, and a tool call
#: with its result (the SDK builds its transforms of each type on first use).
_WARM_TOOLS: list[Any] = [
    {
        "name": "t",
        "description": "preload",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
_WARM_MESSAGES: list[Any] = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "toolu_preload", "name": "t", "input": {"path": "."}},
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_preload", "content": "hi"}],
    },
]


def warm_sdk() -> None:
    """Do the SDK's lazy first-use work here, once, instead of in every worker before its
    first model call: build a client as a worker does (its HTTP stack is imported on first
    use, and the TLS context, whose CA bundle takes tens of milliseconds to load, is kept
    for the workers: ``tls_context``), and parse one streamed reply served from memory
    (the validators of the stream's types are built on first use; the request is shaped as a
    resumed worker's, whose transforms are built on first use too). A standby runs it again
    for the pages it touches (copied on first write after a fork). No socket is opened and
    both clients are closed before any fork. Best effort: a failure here only leaves that
    work to the workers."""
    with contextlib.suppress(Exception):
        import anthropic  # noqa: PLC0415  (inside the best-effort block: a failure is suppressed)
        import httpx2  # noqa: PLC0415  (the same)

        from worker.models.messages_api import tls_context  # noqa: PLC0415  (the same)

        http_client = anthropic.DefaultHttpxClient(verify=tls_context())
        anthropic.Anthropic(api_key="preload", max_retries=0, http_client=http_client).close()
        body = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in _WARM_EVENTS)
        headers = {"content-type": "text/event-stream"}
        transport = httpx2.MockTransport(
            lambda _: httpx2.Response(200, headers=headers, content=body)
        )
        with (
            anthropic.Anthropic(
                api_key="preload",
                base_url="http://preload.invalid",
                max_retries=0,
                http_client=httpx2.Client(transport=transport),
            ) as client,
            client.messages.stream(
                model="preload",
                max_tokens=1,
                system="preload",
                tools=_WARM_TOOLS,
                messages=_WARM_MESSAGES,
            ) as stream,
        ):
            for _ in stream:
                pass
            stream.get_final_message()


def _become_worker(request: dict[str, Any], ahead: ConfigAhead | None = None) -> None:
    """In the grandchild: set up the process as ``python -m worker`` would be, run it
    (a standby has its own session already, and maybe its config read ``ahead``)."""
    if os.getsid(0) != os.getpid():
        os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:  # never through a symlink planted at worker.log: open_private will not follow it
        out = open_private(Path(request["output"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:  # a full or read-only spool: the worker runs (and says so by its exit code)
        out = os.open(os.devnull, os.O_WRONLY)
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
    from worker.__main__ import main  # noqa: PLC0415  (in the forked child, after its environment is set)

    code = 1
    try:
        code = main(args, ahead)
    except BaseException:  # said in worker.log: the os._exit below would swallow it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn(request: dict[str, Any]) -> tuple[int, int]:
    """Double-fork a worker for ``request``: (its pid, the intermediate child's pid). The
    pid is known as soon as the intermediate child has written it, before that child has
    exited: the caller replies first and reaps it after (``reap``)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(write_end)
                    _become_worker(request)
                finally:
                    os._exit(1)  # never the intermediate child's 0: that would read as done
            os.write(write_end, f"{pid}\n".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.readline()
        return int(data), middle
    except ValueError:
        reap(middle)
        raise


@dataclass(frozen=True)
class Standby:
    """The worker forked ahead of need: ``pid`` waits, its task unknown, for one request
    on the pipe ``feed`` (the server holds the only write end: when the server ends, the
    standby reads the end of its input and exits). Its parent ``middle`` stays until the
    standby is handed a task: until then the standby is no child of the supervisor (whose
    children are its workers), and once the server has reaped ``middle`` it is."""

    pid: int
    middle: int
    feed: int


def stand_by(config: str | None) -> Standby:
    """Fork a standby (``config``: the file it reads ahead, if any)."""
    feed_r, feed_w = os.pipe()
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            os.close(feed_w)
            _let_go_of_the_server()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(write_end)
                    _wait_for_a_task(feed_r, config)
                finally:
                    os._exit(1)
            os.close(feed_r)
            os.write(write_end, f"{pid}\n".encode())
            os.close(write_end)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # until the standby ends, or the server hands it over
        finally:
            os._exit(0)
    os.close(feed_r)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as pipe:
            return Standby(int(pipe.readline()), middle, feed_w)
    except ValueError:
        os.close(feed_w)
        reap(middle)
        raise


def _let_go_of_the_server() -> None:
    """Hold none of the server's pipes to the supervisor: a standby that outlives the
    server for a moment must not keep them open."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)


def _wait_for_a_task(feed: int, config: str | None) -> None:
    """In the standby: do ahead what no task's data goes into (``worker.standby``), then
    wait for a request; become its worker, or exit when the server is gone."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    proctitle.standby()
    ahead = ConfigAhead.read(Path(config)) if config else None
    warm_sdk()  # again, here: the pages a model call touches are copied now, not in it
    with contextlib.suppress(Exception):  # best effort: else the first call builds it
        from worker.models.messages_api import prepare_http_client  # noqa: PLC0415  (preloaded)

        prepare_http_client()
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(feed, 65536)
        if not chunk:  # the server is gone, or has replaced this standby
            os._exit(0)
        data += chunk
    os.close(feed)
    _become_worker(json.loads(data), ahead)


def hand_over(standby: Standby, request: dict[str, Any]) -> int | None:
    """Give ``request`` to ``standby``: its pid, or None when it is gone (a fork then).
    Its parent is killed (the caller reaps it, off the answer's path): the worker is the
    supervisor's child from the moment that parent is gone, microseconds after the kill,
    as a forked worker is once its intermediate parent has exited."""
    try:
        if reap(standby.middle, wait=False):  # ended: so has the standby
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(standby.middle, signal.SIGKILL)
        try:
            os.write(standby.feed, (json.dumps(request) + "\n").encode())
        except OSError:  # (EPIPE: it died meanwhile)
            return None
        return standby.pid
    finally:
        os.close(standby.feed)


def dismiss(standby: Standby) -> int:
    """Let ``standby`` go (it reads the end of its input and exits); its parent, to reap."""
    os.close(standby.feed)
    return standby.middle


def reap(middle: int, *, wait: bool = True) -> bool:
    """Reap an intermediate child; without ``wait``, only if it has exited already."""
    with contextlib.suppress(ChildProcessError):
        return os.waitpid(middle, 0 if wait else os.WNOHANG)[0] != 0
    return True


#: Seconds between a worker handed out and the fork of the next standby: not while the
#: worker, the daemon and the server compete for the CPU at that worker's start.
STANDBY_PAUSE = 0.1


@dataclass
class _Due:
    """When the next standby is forked (monotonic; None: not now)."""

    at: float | None = None

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


def _lines(fd: int, pause: Callable[[], float | None]) -> Iterator[bytes | None]:
    """The lines read from ``fd`` as they come, and None each time ``pause()`` seconds
    pass without one (``pause()`` None: wait as long as it takes); ends at its end."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            yield line
        timeout = pause()
        if timeout is not None and not select.select([fd], [], [], timeout)[0]:
            yield None
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buffer += chunk


def _parsed(line: bytes) -> dict[str, Any] | None:
    with contextlib.suppress(ValueError):
        request = json.loads(line)
        return request if isinstance(request, dict) else None
    return None


def _serve_one(
    request: dict[str, Any] | None, standby: Standby | None, middles: list[int]
) -> dict[str, Any]:
    """The answer to a request for a worker: handed to ``standby``, or forked."""
    try:
        if request is None:
            raise ValueError("not a JSON object")
        pid = None
        if standby is not None:
            pid = hand_over(standby, request)
            middles.append(standby.middle)
        if pid is None:
            pid, middle = spawn(request)
            middles.append(middle)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"pid": pid}


def serve() -> int:
    take_over()  # (it may execute this process again: the copy's thread starts after it)
    proctitle.fork_server()
    if len(sys.argv) > 1:  # its log: bounded as a worker's output is (``worker.output``)
        BoundedOutput.install(Path(sys.argv[1]), LOG_FILE_LIMIT, fds=(2,))
    preload(mcp=PRELOAD_MCP in sys.argv[2:])
    os.write(1, b'{"ready": true}\n')
    middles: list[int] = []  # intermediate children not reaped yet: off the reply's path
    standby: Standby | None = None
    wanted: dict[str, Any] | None = None  # what the supervisor said of standbys, if it did
    due = _Due()  # when the next standby is forked
    for line in _lines(0, due.left):
        request = _parsed(line) if line is not None else None
        if line is None:  # (the pause before the next standby is over)
            pass
        elif request is not None and STANDBY in request:
            wanted = request[STANDBY]  # (re)place the standby now; no answer
            if standby is not None:
                middles.append(dismiss(standby))
                standby = None
            due.at = time.monotonic()
        else:
            due.at = time.monotonic() + STANDBY_PAUSE
            found, standby = standby, None
            os.write(1, (json.dumps(_serve_one(request, found, middles)) + "\n").encode())
        if standby is None and isinstance(wanted, dict) and due.left() == 0.0:
            due.at = None  # the next one, once the last has started
            with contextlib.suppress(OSError, ValueError):
                standby = stand_by(wanted.get("config"))
        middles = [m for m in middles if not reap(m, wait=False)]
    if standby is not None:
        middles.append(dismiss(standby))
    for middle in middles:
        reap(middle)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
