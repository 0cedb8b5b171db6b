"""The built-in tools (docs/design.md section 5), all confined to the task's workspace.

``outbox_send`` is the ``keyed`` example: it stands for any service that deduplicates by
idempotency key (a payment API, a message queue). Its "service" is the ``outbox/`` folder
of the workspace, where each delivery is one file named by its key, so a second delivery
with the same key is recognised and not repeated.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import time
from pathlib import Path

from worker.store.durable import atomic_write, private_dir, write_exclusive
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
        with open(target, "rb") as f:
            data = f.read(MAX_READ + 1)
    except FileNotFoundError:
        raise ToolError(f"no file {path!r} in the workspace") from None
    except IsADirectoryError:
        raise ToolError(f"{path!r} is a folder; use list_dir") from None
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
        return f"exit code {proc.returncode}\n" + _outputs(pipes)
    finally:
        os.close(out_read)
        os.close(err_read)


def _outputs(pipes: dict[int, _Bounded]) -> str:
    out, err = (kept.text() for kept in pipes.values())
    return f"--- stdout ---\n{out}\n--- stderr ---\n{err}"


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
