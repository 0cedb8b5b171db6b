"""The built-in tools (docs/design.md section 5), all confined to the task's workspace.

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
import selectors
import stat
import subprocess
import time
from collections.abc import Iterator

from worker.store.durable import DIR_MODE, atomic_write_at, open_private, write_exclusive_at
from worker.tools.effect import Effect
from worker.tools.paths import open_beneath, parent_beneath
from worker.tools.sandbox import SandboxRefused
from worker.tools.tool import Tool, ToolContext, ToolError, tool

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

    with contextlib.suppress(psutil.Error, OSError):
        proc = psutil.Process(pid)
        for child in [*proc.children(recursive=True), proc]:
            with contextlib.suppress(psutil.Error, OSError):
                child.kill()


class _Bounded:
    """One output stream of a command, kept in memory within a bound: its first
    ``KEEP`` bytes and its last ``KEEP`` bytes, and how many it had in all."""

    KEEP = MAX_OUTPUT // 2

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        room = self.KEEP - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.KEEP:
            del self.tail[: len(self.tail) - self.KEEP]

    def text(self) -> str:
        head = self.head.decode(errors="replace")
        left_out = self.size - len(self.head) - len(self.tail)
        if left_out == 0:
            return (self.head + self.tail).decode(errors="replace")
        return f"{head}\n[... {left_out} more bytes]\n{self.tail.decode(errors='replace')}"


def bounded_text(text: str) -> str:
    """``text`` kept as a command's output is: whole up to ``MAX_OUTPUT`` bytes, else its
    first and last ``MAX_OUTPUT // 2`` bytes and how many were left out between (the cap
    of an MCP tool's result too: ``worker.mcp.results``)."""
    if len(text) <= MAX_OUTPUT // 4:  # (a character is at most 4 bytes: within it as is)
        return text
    kept = _Bounded()
    kept.add(text.encode())
    return kept.text()


#: Bytes read from a command's pipes after its shell exited: what was written before the
#: exit is in the pipe's buffer (64 KiB by default); a background process that writes on
#: for ever cannot keep the tool reading.
DRAIN_LIMIT = 4 * MAX_OUTPUT


def _read_until_exit(
    proc: subprocess.Popen[bytes], pipes: dict[int, _Bounded], limit: float
) -> bool:
    """Read the command's output into ``pipes`` until its shell exits (not until EOF: a
    process left in the background may hold a pipe open), then what is left in the
    pipes' buffers. False when ``limit`` seconds passed first (nothing drained then)."""
    deadline = time.monotonic() + limit
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(pidfd, selectors.EVENT_READ)
            for fd in pipes:
                selector.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                for key, _ in selector.select(left):
                    if key.fd == pidfd:
                        _drain(pipes)
                        return True
                    data = os.read(key.fd, 65536)
                    if data:
                        pipes[key.fd].add(data)
                    else:
                        selector.unregister(key.fd)  # EOF: the other may still be open
    finally:
        os.close(pidfd)


def _drain(pipes: dict[int, _Bounded]) -> None:
    for fd, kept in pipes.items():
        drained = 0
        with contextlib.suppress(BlockingIOError):
            while drained < DRAIN_LIMIT and (data := os.read(fd, 65536)):
                kept.add(data)
                drained += len(data)


@tool(effect=Effect.UNSAFE)
def run_command(ctx: ToolContext, command: str, timeout: float = 60.0) -> str:
    """Run a shell command in the workspace; returns its exit code and output."""
    limit = max(0.1, min(float(timeout), ctx.timeout))
    try:
        argv = ctx.sandbox.argv(command, ctx.workspace, ctx.env)
    except SandboxRefused as exc:
        raise ToolError(str(exc)) from None
    # Output comes through pipes into memory, bounded (``_Bounded``): nothing touches a
    # disk whatever the command prints, and the shell's exit, not EOF, ends the reading.
    out_read, out_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    err_read, err_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    pipes = {out_read: _Bounded(), err_read: _Bounded()}
    try:
        for fd in (out_write, err_write):
            os.set_blocking(fd, True)  # the command's ends block as pipes usually do
        try:
            proc = subprocess.Popen(
                argv,
                cwd=ctx.workspace,
                env=dict(ctx.env),
                stdin=subprocess.DEVNULL,
                stdout=out_write,
                stderr=err_write,
            )
        finally:
            os.close(out_write)
            os.close(err_write)
        if not _read_until_exit(proc, pipes, limit):
            _kill_tree(proc.pid)
            proc.wait()
            _drain(pipes)
            raise ToolError(
                f"command timed out after {limit:g} s and was killed\n" + _outputs(pipes)
            )
        proc.wait()
        result = f"exit code {proc.returncode}\n" + _outputs(pipes)
        if ctx.sandbox.verdict() == "bwrap" and (
            note := ctx.sandbox.unseen(command, ctx.workspace)
        ):
            result += f"\n--- sandbox ---\n{note}\n"  # (said: the file is not missing)
        return result
    finally:
        os.close(out_read)
        os.close(err_read)


def _outputs(pipes: dict[int, _Bounded]) -> str:
    out, err = (kept.text() for kept in pipes.values())
    return f"--- stdout ---\n{out}\n--- stderr ---\n{err}"


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
