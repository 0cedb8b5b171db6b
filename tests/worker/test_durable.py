"""Durable writes: atomic replacement, exclusive creation, private modes."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO
from worker.errors import StorageError
from worker.store.durable import (
    atomic_write,
    atomic_write_json,
    open_private,
    private_dir,
    read_json,
    read_regular,
    write_exclusive,
)


@pytest.fixture
def no_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _eio(*_: object) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_atomic_write_replaces_the_content(tmp_path: Path) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"old")
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["f"]


def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    obj = {"a": [1, 2.5, None, True], "b": "héllo ✓"}
    atomic_write_json(path, obj)
    assert read_json(path) == obj


@pytest.mark.parametrize("fault", ["fsync", "write", "replace"])
def test_failed_atomic_write_keeps_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"old content")
    monkeypatch.setattr(os, fault, _eio)
    with pytest.raises(StorageError, match="EIO") as info:
        atomic_write(path, b"new content that never lands")
    monkeypatch.undo()
    assert "\n" not in str(info.value)
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["f"], "the temp file was left behind"


def test_failed_fsync_of_the_folder_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    real = os.fsync

    def fail_on_folders(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            _eio()
        real(fd)

    monkeypatch.setattr(os, "fsync", fail_on_folders)
    with pytest.raises(StorageError, match="fsync of folder"):
        atomic_write(path, b"data")


def test_write_exclusive_creates_once(tmp_path: Path) -> None:
    path = tmp_path / "f"
    assert write_exclusive(path, b"first") is True
    assert write_exclusive(path, b"second") is False
    assert path.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["f"]


def test_write_exclusive_one_winner_among_threads(tmp_path: Path) -> None:
    writers = 8
    for trial in range(20):
        path = tmp_path / f"decision-{trial}"
        barrier = threading.Barrier(writers)
        results: list[bool | BaseException | None] = [None] * writers

        def write(
            i: int,
            path: Path = path,
            barrier: threading.Barrier = barrier,
            results: list[bool | BaseException | None] = results,
        ) -> None:
            barrier.wait()
            try:
                results[i] = write_exclusive(path, f"writer {i} ".encode() * 500)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert all(r is True or r is False for r in results), results
        winners = [i for i, r in enumerate(results) if r is True]
        assert len(winners) == 1, results
        assert path.read_bytes() == f"writer {winners[0]} ".encode() * 500
    assert sorted(os.listdir(tmp_path)) == sorted(f"decision-{t}" for t in range(20))


_RACER = """
import sys, time
from pathlib import Path
from worker.store.durable import write_exclusive
path, me, at = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
while time.time() < at:
    time.sleep(0.0005)
print("won" if write_exclusive(path, ("process " + me).encode()) else "lost")
"""


def test_write_exclusive_one_winner_among_processes(tmp_path: Path) -> None:
    path = tmp_path / "decision"
    start_at = time.time() + 0.7  # every racer is up and spinning by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(path), str(i), str(start_at)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    outputs = [p.communicate(timeout=30)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 6
    assert sorted(outputs) == ["lost"] * 5 + ["won"]
    assert path.read_bytes() == f"process {outputs.index('won')}".encode()
    assert os.listdir(tmp_path) == ["decision"]


def test_private_dir_is_0700_under_umask_0(tmp_path: Path, no_umask: None) -> None:
    path = private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    private_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_files_are_0600_under_umask_0(tmp_path: Path, no_umask: None) -> None:
    atomic_write(tmp_path / "atomic", b"x")
    write_exclusive(tmp_path / "exclusive", b"x")
    os.close(open_private(tmp_path / "opened", os.O_WRONLY | os.O_CREAT))
    loose = tmp_path / "loose"
    loose.write_bytes(b"x")
    loose.chmod(0o666)
    os.close(open_private(loose, os.O_RDONLY))
    for name in ("atomic", "exclusive", "opened", "loose"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


def test_open_private_never_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError, match=r"symbolic links|Too many levels"):
        open_private(link, os.O_WRONLY | os.O_TRUNC)
    assert target.read_bytes() == b"secret"


def test_read_regular_gives_the_whole_file_and_at_most_its_limit_plus_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "f"
    for size in (0, 1, 4095, 4096, 70_000):
        data = os.urandom(size)
        path.write_bytes(data)
        assert read_regular(path) == data
        assert read_regular(path, limit=100) == data[:101]
        assert read_regular(path, limit=size) == data  # (its limit: no byte more to tell)


def test_read_regular_reads_on_past_a_size_the_file_does_not_report() -> None:
    # a regular file of /proc says it is empty and is not: one read of its size would stop
    expected = Path("/proc/self/mountinfo").read_bytes()
    assert os.stat("/proc/self/mountinfo").st_size == 0 and len(expected) > 100
    got = read_regular("/proc/self/mountinfo", follow_symlinks=True)
    assert got.splitlines()[0] == expected.splitlines()[0] and len(got) > 100


def test_read_regular_reads_what_a_file_grew_by_while_it_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "growing"
    path.write_bytes(b"a" * 1000)
    real_fstat = os.fstat
    sizes: list[int] = []

    def fstat_then_grow(fd: int) -> os.stat_result:
        found = real_fstat(fd)
        sizes.append(found.st_size)
        if len(sizes) == 2:  # read_regular's own look at the size: it grows right after
            with path.open("ab") as more:
                more.write(b"b" * 5000)
        return found

    monkeypatch.setattr("worker.store.durable.os.fstat", fstat_then_grow)
    assert read_regular(path) == b"a" * 1000 + b"b" * 5000
    assert sizes == [1000, 1000]  # (the size it went by: the rest was read on)


def test_read_regular_reads_on_past_a_short_read_before_the_file_s_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    data = os.urandom(10_000)
    path.write_bytes(data)
    real_read = os.read
    calls: list[int] = []

    def short_first(fd: int, n: int) -> bytes:
        calls.append(n)
        return real_read(fd, min(n, 3000) if len(calls) == 1 else n)  # (FUSE, NFS: a short read)

    monkeypatch.setattr("worker.store.durable.os.read", short_first)
    assert read_regular(path) == data
