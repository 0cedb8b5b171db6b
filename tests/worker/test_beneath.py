"""Resolving paths beneath a directory fd: the kernel's way (openat2) and the walk."""

from __future__ import annotations

import errno
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.tools import beneath
from worker.tools.beneath import Escape, Root


@pytest.fixture(params=[True, False], ids=["openat2", "walk"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Root]:
    ws = tmp_path / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "b" / "f.txt").write_text("deep")
    (ws / "top.txt").write_text("top")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret")
    with Root(ws, openat2=request.param) as r:
        assert r.openat2 is request.param
        yield r


def read(root: Root, path: str) -> str:
    fd = root.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 100).decode()
    finally:
        os.close(fd)


def test_the_kernel_way_is_taken_where_the_kernel_has_it() -> None:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if platform.machine() in ("x86_64", "aarch64") and (major, minor) >= (5, 6):
        assert beneath.HAVE_OPENAT2


@pytest.mark.parametrize(
    ("path", "text"),
    [
        ("top.txt", "top"),
        ("a/b/f.txt", "deep"),
        ("./a//b/./f.txt", "deep"),
        ("a/../top.txt", "top"),
    ],
)
def test_plain_paths(root: Root, path: str, text: str) -> None:
    assert read(root, path) == text


def test_symlinks_inside_are_followed(root: Root) -> None:
    ws = Path(root.path)
    (ws / "rel").symlink_to("a/b")
    (ws / "a" / "up").symlink_to("../top.txt")
    (ws / "abs").symlink_to(ws / "a" / "b" / "f.txt")  # absolute, but inside
    (ws / "chain").symlink_to("rel/../b/f.txt")  # the link's .. is physical: a/b/.. is a
    assert read(root, "rel/f.txt") == "deep"
    assert read(root, "a/up") == "top"
    assert read(root, "abs") == "deep"
    assert read(root, "chain") == "deep"


@pytest.mark.parametrize("link", ["../outside", "ABS/outside", "a/../../outside", "/etc"])
@pytest.mark.parametrize("through", ["{}/secret.txt", "{}"])
def test_symlinks_out_are_an_escape(root: Root, link: str, through: str) -> None:
    ws = Path(root.path)
    (ws / "out").symlink_to(link.replace("ABS", str(ws.parent)))
    with pytest.raises(Escape):
        root.open(through.format("out"), os.O_RDONLY)
    with pytest.raises(Escape):
        root.parent(through.format("out") + "/new.txt", create=True)
    assert sorted(os.listdir(ws.parent / "outside")) == ["secret.txt"]


@pytest.mark.parametrize("path", ["..", "../outside/secret.txt", "a/../..", "a/b/../../../ws"])
def test_dot_dot_above_the_root_is_an_escape(root: Root, path: str) -> None:
    with pytest.raises(Escape):
        root.open(path, os.O_RDONLY)


def test_errors_of_the_open_pass_through(root: Root) -> None:
    ws = Path(root.path)
    with pytest.raises(FileNotFoundError):
        root.open("nope.txt", os.O_RDONLY)
    with pytest.raises(NotADirectoryError):
        root.open("top.txt/x", os.O_RDONLY)
    (ws / "loop").symlink_to("loop")
    with pytest.raises(OSError) as info:
        root.open("loop", os.O_RDONLY)
    assert info.value.errno == errno.ELOOP


def test_parent_follows_a_final_symlink_and_creates_folders(root: Root) -> None:
    ws = Path(root.path)
    (ws / "alias").symlink_to("a/b/f.txt")
    fd, name = root.parent("alias")
    try:
        assert name == "f.txt"
        assert os.path.samestat(os.fstat(fd), os.stat(ws / "a" / "b"))
    finally:
        os.close(fd)
    fd, name = root.parent("x/y/z.txt", create=True)
    os.close(fd)
    assert name == "z.txt" and (ws / "x" / "y").is_dir() and not (ws / "x" / "y" / "z.txt").exists()
    fd, name = root.parent("a/b/..")
    os.close(fd)
    assert name == ""
    with pytest.raises(FileNotFoundError):
        root.parent("missing/z.txt")


def test_the_root_stays_the_folder_it_opened(root: Root, tmp_path: Path) -> None:
    """The fd is the workspace: the name swapped for a link to elsewhere changes nothing."""
    ws = Path(root.path)
    ws.rename(tmp_path / "moved")
    ws.symlink_to(tmp_path / "outside")
    assert read(root, "top.txt") == "top"
    with pytest.raises(FileNotFoundError):
        root.open("secret.txt", os.O_RDONLY)


def test_the_root_itself_is_opened_without_following_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    with Root(tmp_path / "link") as r:  # the name is resolved once, when opened
        assert r.path == str(tmp_path / "real")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        Root(tmp_path / "file")
