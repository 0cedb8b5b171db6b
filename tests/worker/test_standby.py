"""A config read ahead by a standby worker (worker/standby.py) is used only while its file
is the one read: a file rewritten since, another path, or none is read again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.models import messages_api
from worker.standby import ConfigAhead


def test_a_config_read_ahead_is_used_while_its_file_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text("max_workers = 3\n")
    ahead = ConfigAhead.read(path)
    assert ahead is not None
    config = ahead.current(path)
    assert config is not None and config.max_workers == 3
    assert ahead.current(None) is None
    assert ahead.current(tmp_path / "other.toml") is None


def test_a_rewritten_config_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text("max_workers = 3\n")
    ahead = ConfigAhead.read(path)
    assert ahead is not None
    fresh = tmp_path / "agentd.toml.new"  # replaced as the daemon writes its workers' copy
    fresh.write_text("max_workers = 4\n")
    os.replace(fresh, path)
    assert ahead.current(path) is None


def test_a_config_rewritten_in_place_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text("max_workers = 3\n")
    ahead = ConfigAhead.read(path)
    assert ahead is not None
    stat = path.stat()
    path.write_text("max_workers = 5\n")  # the same size, the same inode
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert ahead.current(path) is None


def test_a_config_that_cannot_be_read_ahead_is_left_to_the_worker(tmp_path: Path) -> None:
    assert ConfigAhead.read(tmp_path / "missing.toml") is None
    bad = tmp_path / "bad.toml"
    bad.write_text("max_workers = 'many'\n")
    assert ConfigAhead.read(bad) is None


def test_an_http_client_built_ahead_is_taken_once_and_only_in_the_same_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    messages_api.prepare_http_client()
    ahead = messages_api._prepared
    assert ahead is not None
    assert messages_api.http_client() is ahead[0]  # taken
    assert messages_api.http_client() is not ahead[0]  # once
    messages_api.prepare_http_client()
    stale = messages_api._prepared
    assert stale is not None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # the task's differs
    fresh = messages_api.http_client()
    assert fresh is not stale[0] and stale[0].is_closed
    fresh.close()
