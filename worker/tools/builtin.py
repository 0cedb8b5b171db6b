"""The built-in tools (DESIGN.md section 5), all confined to the task's workspace.

``outbox_send`` is the ``keyed`` example: it stands for any service that deduplicates by
idempotency key (a payment API, a message queue). Its "service" is the ``outbox/`` folder
of the workspace, where each delivery is one file named by its key, so a second delivery
with the same key is recognised and not repeated.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from typing import IO

from worker.store.durable import DIR_MODE, atomic_write_at, open_private, write_exclusive_at
from worker.tools.paths import open_beneath, parent_beneath
from worker.tools.sandbox import SandboxRefused
from worker.tools.tool import Effect, Tool, ToolContext, ToolError, tool

MAX_READ = 1024 * 1024
MAX_OUTPUT = 64 * 1024


@tool(effect=Effect.READ_ONLY)
def read_file(ctx: ToolContext, path: str) -> str:
    """Read a UTF-8 text file from the workspace."""
    try:
        # O_NONBLOCK: a FIFO planted in the workspace must not hang the call
        fd = open_beneath(ctx.workspace_root, path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ToolError(f"no file {path!r} in the workspace") from None
    except NotADirectoryError:
        raise ToolError(f"a folder on the way to {path!r} is a file") from None
    try:
        kind = os.fstat(fd).st_mode
        if stat.S_ISDIR(kind):
            raise ToolError(f"{path!r} is a folder; use list_dir")
        if not stat.S_ISREG(kind):
            raise ToolError(f"{path!r} is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_READ + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_READ:
        raise ToolError(f"{path!r} is larger than {MAX_READ} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ToolError(f"{path!r} is not UTF-8 text") from None


@tool(effect=Effect.READ_ONLY)
def list_dir(ctx: ToolContext, path: str = ".") -> str:
    """List a folder of the workspace; folders end with '/'."""
    try:
        fd = open_beneath(ctx.workspace_root, path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise ToolError(f"no folder {path!r} in the workspace") from None
    except NotADirectoryError:
        raise ToolError(f"{path!r} is a file; use read_file") from None
    try:
        with os.scandir(fd) as found:
            entries = sorted(found, key=lambda e: e.name)
        return "\n".join(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)
    finally:
        os.close(fd)


@tool(effect=Effect.IDEMPOTENT)
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or replace a text file in the workspace (parent folders are created)."""
    data = content.encode()
    dir_fd, name = parent_beneath(ctx.workspace_root, path)
    try:
        atomic_write_at(dir_fd, name, data, shown=ctx.workspace / path)
    except IsADirectoryError:
        raise ToolError(f"{path!r} is a folder; give a file path in the workspace") from None
    finally:
        os.close(dir_fd)
    return f"wrote {len(data)} bytes to {path}"


@tool(effect=Effect.UNSAFE)
def append_file(ctx: ToolContext, path: str, content: str) -> str:
    """Append text to a file in the workspace (created if missing)."""
    data = content.encode()
    dir_fd, name = parent_beneath(ctx.workspace_root, path)
    try:
        fd = open_private(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, dir_fd=dir_fd)
    except IsADirectoryError:
        raise ToolError(f"{path!r} is a folder; give a file path in the workspace") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ToolError(f"{path!r} was swapped for a symlink meanwhile; try again") from None
    finally:
        os.close(dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"appended {len(data)} bytes to {path}"


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


@contextlib.contextmanager
def _outbox(ctx: ToolContext) -> Iterator[tuple[int, str]]:
    """The fd of the outbox folder (0700) and the name of this call's entry in it, resolved
    beneath the workspace like any tool path: an outbox/ that is a symlink out is refused."""
    dir_fd, name = parent_beneath(ctx.workspace_root, f"outbox/{ctx.idempotency_key}.json")
    try:
        if os.fstat(dir_fd).st_mode & 0o777 != DIR_MODE:
            os.fchmod(dir_fd, DIR_MODE)
        yield dir_fd, name
    finally:
        os.close(dir_fd)


def _outbox_reconcile(ctx: ToolContext, data: dict[str, object]) -> str | None:
    with _outbox(ctx) as (dir_fd, name):
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
    return f"delivered to {data.get('to')} (key {ctx.idempotency_key}, already recorded)"


@tool(effect=Effect.KEYED, reconcile=_outbox_reconcile)
def outbox_send(ctx: ToolContext, to: str, body: str) -> str:
    """Deliver a message to the outbox service, deduplicated by the call's idempotency key."""
    record = json.dumps({"to": to, "body": body, "key": ctx.idempotency_key}).encode()
    with _outbox(ctx) as (dir_fd, name):
        created = write_exclusive_at(dir_fd, name, record, shown=ctx.workspace / "outbox" / name)
    if created:
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
