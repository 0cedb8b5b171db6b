"""An MCP server for the faults a real one will not do on cue: ``python fault_server.py``.

Plain JSON-RPC over stdio, the standard library only (no SDK: it must be able to break
the protocol). Its tools, each with annotations (``readOnlyHint``...) so that a trusted
server's classes can be tested:

    echo(text)            the text, and the request's ``_meta`` as JSON (read-only)
    count(file, seconds?) append a line (the request's _meta) to FILE in the workspace, then
                          sleep (unsafe)
    settle(file, seconds?) write FILE in the workspace, after sleeping (idempotent)
    die()                 the process exits in the middle of the call (read-only)
    die_once(file)        exits mid-call unless FILE exists in the workspace, which it makes
    hang()                never answers (read-only); a notifications/cancelled it gets is
                          appended to cancelled.log in the workspace
    slow(seconds)         answers after ``seconds`` (read-only)
    garbage()             prints lines that are no JSON-RPC, then answers (read-only)
    out_of_order()        answers an id nobody asked, then sends a notification, then
                          answers (read-only)
    change_tools()        drops ``vanishing``, adds ``newcomer``, says tools/list_changed
    vanishing()           a tool that change_tools takes away
    image()               a text and a PNG image
    structured()          structuredContent only, no text
    fail()                an isError result
    read(path)            a file's text, wherever it is: what the sandbox must stop
    ask_client(method)    sends ``method`` (sampling/createMessage, elicitation/create,
                          roots/list) to the client and returns its answer
    daemon(marker)        starts a process that double-forks away and sleeps, its argv
                          holding ``marker``
    env(variable)         the value of an environment variable (or "unset")

Any other argument is ignored (a tag that names the server's processes). Flags:
``--fail-start`` exits at once; ``--no-list`` answers tools/list with an error, ``--hang-list``
never;
``--daemonize MARKER`` leaves a daemon behind at start (as ``daemon``); ``--log-start
NAME`` appends a line to NAME in the workspace as it starts; ``--stubborn`` ignores SIGTERM
and goes on after its stdin closes (only SIGKILL ends it).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

READ_ONLY = {"readOnlyHint": True}
UNSAFE = {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False}
IDEMPOTENT = {"readOnlyHint": False, "idempotentHint": True}
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000105a5e6b60000000049454e44ae426082"
    )
).decode()

_out = threading.Lock()
_tools_changed = False


def send(message: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def answer(request_id: Any, result: dict[str, Any]) -> None:
    send({"jsonrpc": "2.0", "id": request_id, "result": result})


def text_result(text: str, **more: Any) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": False, **more}


def tool(tool_name: str, annotations: dict[str, bool], **properties: str) -> dict[str, Any]:
    return {
        "name": tool_name,
        "description": f"fault server: {tool_name}",
        "inputSchema": {
            "type": "object",
            "properties": {key: {"type": kind} for key, kind in properties.items()},
        },
        "annotations": annotations,
    }


def tools() -> list[dict[str, Any]]:
    listed = [
        tool("echo", READ_ONLY, text="string"),
        tool("count", UNSAFE, file="string", seconds="number"),
        tool("settle", IDEMPOTENT, file="string", seconds="number"),
        tool("die", READ_ONLY),
        tool("die_once", READ_ONLY, file="string"),
        tool("hang", READ_ONLY),
        tool("slow", READ_ONLY, seconds="number"),
        tool("garbage", READ_ONLY),
        tool("out_of_order", READ_ONLY),
        tool("change_tools", UNSAFE),
        tool("image", READ_ONLY),
        tool("structured", READ_ONLY),
        tool("fail", READ_ONLY),
        tool("read", READ_ONLY, path="string"),
        tool("ask_client", READ_ONLY, method="string"),
        tool("daemon", UNSAFE, marker="string"),
        tool("env", READ_ONLY, variable="string"),
    ]
    if _tools_changed:
        return [*listed, tool("newcomer", READ_ONLY)]
    return [*listed, tool("vanishing", READ_ONLY)]


def start_daemon(marker: str) -> int:
    """A grandchild in a session of its own that sleeps on, its argv holding ``marker``."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            os.close(reader)
            os.write(writer, str(os.getpid()).encode())
            os.close(writer)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.execvp("sleep", [f"sleep-{marker}", "3600"])  # noqa: S606  (a daemon on purpose)
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    pid = int(os.read(reader, 32) or b"0")
    os.close(reader)
    return pid


_asked: dict[int, Any] = {}  # our requests to the client: id -> the call to answer
_next_id = [100000]


def call(request_id: Any, name: str, args: dict[str, Any], meta: Any) -> None:
    global _tools_changed  # noqa: PLW0603  (the server's one piece of state)
    here = Path.cwd()
    if name == "echo":
        answer(request_id, text_result(json.dumps({"text": args.get("text"), "meta": meta})))
    elif name == "count":  # the effect first, then the call takes its time
        with open(here / str(args["file"]), "a") as f:
            f.write(f"{json.dumps(meta)}\n")
        time.sleep(float(args.get("seconds") or 0))
        answer(request_id, text_result("counted"))
    elif name == "settle":
        time.sleep(float(args.get("seconds") or 0))
        (here / str(args["file"])).write_text("settled")
        answer(request_id, text_result("settled"))
    elif name == "die":
        os._exit(17)
    elif name == "die_once":
        marker = here / str(args["file"])
        if not marker.exists():
            marker.write_text("died once")
            os._exit(17)
        answer(request_id, text_result("alive"))
    elif name == "hang":
        pass  # never answered
    elif name == "slow":
        seconds = float(args.get("seconds") or 0)
        threading.Timer(seconds, answer, (request_id, text_result(f"slept {seconds}"))).start()
    elif name == "garbage":
        with _out:
            sys.stdout.write('this is not JSON\n{"jsonrpc": "2.0", "bogus": true}\n\x00\x01\n')
            sys.stdout.flush()
        answer(request_id, text_result("after garbage"))
    elif name == "out_of_order":
        answer(987654, text_result("an answer nobody asked for"))
        send(
            {
                "jsonrpc": "2.0",
                "method": "notifications/message",
                "params": {"level": "info", "data": "hi"},
            }
        )
        answer(request_id, text_result("in order after all"))
    elif name == "change_tools":
        _tools_changed = True
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        answer(request_id, text_result("changed"))
    elif name == "vanishing":
        answer(request_id, text_result("still here"))
    elif name == "newcomer":
        answer(request_id, text_result("new"))
    elif name == "image":
        answer(
            request_id,
            {
                "content": [
                    {"type": "text", "text": "a pixel"},
                    {"type": "image", "data": PNG, "mimeType": "image/png"},
                ]
            },
        )
    elif name == "structured":
        answer(request_id, {"content": [], "structuredContent": {"b": 2, "a": [1]}})
    elif name == "fail":
        answer(request_id, {"content": [{"type": "text", "text": "it failed"}], "isError": True})
    elif name == "read":
        try:
            answer(request_id, text_result(Path(str(args["path"])).read_text(errors="replace")))
        except OSError as exc:
            answer(request_id, {"content": [{"type": "text", "text": str(exc)}], "isError": True})
    elif name == "ask_client":
        _next_id[0] += 1
        _asked[_next_id[0]] = request_id
        method = str(args["method"])
        params: dict[str, Any] = {}
        if method == "sampling/createMessage":
            params = {
                "messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}],
                "maxTokens": 5,
            }
        elif method == "elicitation/create":
            params = {
                "message": "your password?",
                "requestedSchema": {"type": "object", "properties": {}},
            }
        send({"jsonrpc": "2.0", "id": _next_id[0], "method": method, "params": params})
    elif name == "env":
        answer(request_id, text_result(os.environ.get(str(args["variable"]), "unset")))
    elif name == "daemon":
        answer(request_id, text_result(str(start_daemon(str(args["marker"])))))
    else:
        send(
            {
                "jsonrpc": "2.0",
                "id": request_id,
                "error": {"code": -32602, "message": f"no tool {name}"},
            }
        )


def main() -> None:
    if "--fail-start" in sys.argv:
        print("fault server: refusing to start (--fail-start)", file=sys.stderr)
        sys.exit(3)
    if "--daemonize" in sys.argv:
        start_daemon(sys.argv[sys.argv.index("--daemonize") + 1])
    if "--log-start" in sys.argv:
        with open(sys.argv[sys.argv.index("--log-start") + 1], "a") as f:
            f.write(f"started {os.getpid()}\n")
    if "--stubborn" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("fault server: up", file=sys.stderr, flush=True)
    serve()
    while "--stubborn" in sys.argv:
        time.sleep(1)


def serve() -> None:
    for line in sys.stdin:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        method = message.get("method")
        request_id = message.get("id")
        params = message.get("params") or {}
        if method is None and request_id in _asked:  # the client's answer to ask_client
            answer(_asked.pop(request_id), text_result(json.dumps(message)))
        elif method == "initialize":
            answer(
                request_id,
                {
                    "protocolVersion": params.get("protocolVersion", "2025-11-25"),
                    "capabilities": {"tools": {"listChanged": True}},
                    "serverInfo": {"name": "fault-server", "version": "1"},
                },
            )
        elif method == "tools/list":
            if "--hang-list" in sys.argv:
                continue  # never answered
            if "--no-list" in sys.argv:
                send(
                    {
                        "jsonrpc": "2.0",
                        "id": request_id,
                        "error": {"code": -32603, "message": "no list today"},
                    }
                )
            else:
                answer(request_id, {"tools": tools()})
        elif method == "tools/call":
            call(
                request_id,
                params.get("name", ""),
                params.get("arguments") or {},
                params.get("_meta"),
            )
        elif method == "notifications/cancelled":
            with open("cancelled.log", "a") as f:
                f.write(json.dumps(params) + "\n")
        elif method == "ping":
            answer(request_id, {})
        elif request_id is not None and method is not None:
            send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": method}})


if __name__ == "__main__":
    main()
