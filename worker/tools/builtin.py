"""The built-in tools (DESIGN.md section 5), all confined to the task's workspace.

``outbox_send`` is the ``keyed`` example: it stands for any service that deduplicates by
idempotency key (a payment API, a message queue). Its "service" is the ``outbox/`` folder
of the workspace, where each delivery is one file named by its key, so a second delivery
with the same key is recognised and not repeated.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import IO

from worker.store.durable import (
    NotRegularFileError,
    atomic_write,
    private_dir,
    read_regular,
    write_exclusive,
)
from worker.tools.paths import confine
from worker.tools.sandbox import SandboxRefused
from worker.tools.tool import Effect, Tool, ToolContext, ToolError, tool

MAX_READ = 1024 * 1024
MAX_OUTPUT = 64 * 1024


@tool(effect=Effect.READ_ONLY)
def read_file(ctx: ToolContext, path: str) -> str:
    """Read a UTF-8 text file from the workspace."""
    target = confine(ctx.workspace, path)
    try:
        data = read_regular(target, MAX_READ, follow_symlinks=True)
    except FileNotFoundError:
        raise ToolError(f"no file {path!r} in the workspace") from None
    except IsADirectoryError:
        raise ToolError(f"{path!r} is a folder; use list_dir") from None
    except NotRegularFileError as exc:
        raise ToolError(f"{path!r} is {exc.strerror}") from None
    if len(data) > MAX_READ:
        raise ToolError(f"{path!r} is larger than {MAX_READ} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ToolError(f"{path!r} is not UTF-8 text") from None


@tool(effect=Effect.READ_ONLY)
def list_dir(ctx: ToolContext, path: str = ".") -> str:
    """List a folder of the workspace; folders end with '/'."""
    target = confine(ctx.workspace, path)
    try:
        entries = sorted(os.scandir(target), key=lambda e: e.name)
    except FileNotFoundError:
        raise ToolError(f"no folder {path!r} in the workspace") from None
    except NotADirectoryError:
        raise ToolError(f"{path!r} is a file; use read_file") from None
    return "\n".join(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)


def _parent_ready(ctx: ToolContext, path: str) -> Path:
    """The confined target of ``path`` with its parent folders created."""
    target = confine(ctx.workspace, path)
    if target == Path(os.path.realpath(ctx.workspace)):
        # Writing "the workspace itself" would put a temp file next to it, outside.
        raise ToolError(f"path {path!r} names the workspace itself; give a file path in it")
    target.parent.mkdir(parents=True, exist_ok=True)
    return confine(ctx.workspace, path)  # again: a folder created on the way is checked too


@tool(effect=Effect.IDEMPOTENT)
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or replace a text file in the workspace (parent folders are created)."""
    atomic_write(_parent_ready(ctx, path), content.encode())
    return f"wrote {len(content.encode())} bytes to {path}"


@tool(effect=Effect.UNSAFE)
def append_file(ctx: ToolContext, path: str, content: str) -> str:
    """Append text to a file in the workspace (created if missing)."""
    target = _parent_ready(ctx, path)
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, content.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"appended {len(content.encode())} bytes to {path}"


def _kill_tree(pid: int) -> None:
    import psutil  # noqa: PLC0415  (only needed when a command overruns)

    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        for child in [*proc.children(recursive=True), proc]:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _clip(data: bytes, size: int) -> str:
    text = data[:MAX_OUTPUT].decode(errors="replace")
    return text + (f"\n[... {size - MAX_OUTPUT} more bytes]" if size > MAX_OUTPUT else "")


@tool(effect=Effect.UNSAFE)
def run_command(ctx: ToolContext, command: str, timeout: float = 60.0) -> str:
    """Run a shell command in the workspace; returns its exit code and output."""
    limit = max(0.1, min(float(timeout), ctx.timeout))
    try:
        argv = ctx.sandbox.argv(command, ctx.workspace, ctx.env)
    except SandboxRefused as exc:
        raise ToolError(str(exc)) from None
    # Output goes to files, not pipes: a background process that escapes the command's
    # process tree may keep a pipe open for ever, but it cannot keep the tool waiting.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            argv,
            cwd=ctx.workspace,
            env=dict(ctx.env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            raise ToolError(
                f"command timed out after {limit:g} s and was killed\n" + _outputs(out, err)
            ) from None
        return f"exit code {proc.returncode}\n" + _outputs(out, err)


def _outputs(out: IO[bytes], err: IO[bytes]) -> str:
    texts = []
    for stream in (out, err):
        stream.seek(0)
        texts.append(_clip(stream.read(MAX_OUTPUT + 1), os.fstat(stream.fileno()).st_size))
    return f"--- stdout ---\n{texts[0]}\n--- stderr ---\n{texts[1]}"


def _outbox_entry(ctx: ToolContext) -> Path:
    # confined like any tool path: an outbox/ that is a symlink out of the workspace is refused
    return private_dir(confine(ctx.workspace, "outbox")) / f"{ctx.idempotency_key}.json"


def _outbox_reconcile(ctx: ToolContext, data: dict[str, object]) -> str | None:
    entry = _outbox_entry(ctx)
    if not os.path.exists(entry):
        return None
    return f"delivered to {data.get('to')} (key {ctx.idempotency_key}, already recorded)"


@tool(effect=Effect.KEYED, reconcile=_outbox_reconcile)
def outbox_send(ctx: ToolContext, to: str, body: str) -> str:
    """Deliver a message to the outbox service, deduplicated by the call's idempotency key."""
    record = json.dumps({"to": to, "body": body, "key": ctx.idempotency_key}).encode()
    if write_exclusive(_outbox_entry(ctx), record):
        return f"delivered to {to} (key {ctx.idempotency_key})"
    return f"delivered to {to} (key {ctx.idempotency_key}, duplicate suppressed)"


BUILTIN_TOOLS: tuple[Tool, ...] = (
    read_file,
    list_dir,
    write_file,
    append_file,
    run_command,
    outbox_send,
)
