"""What a sandboxed command is shown of its own installation (``worker.tools.installation``):
followed from ``argv[0]`` through symlinks and ``#!`` lines, each step shown as its venv,
its outermost ``node_modules`` or its prefix, never a home or temporary folder whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.tools.installation import installed


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_node_server_in_node_modules_shows_the_outermost_node_modules(tmp_path: Path) -> None:
    modules = tmp_path / "proj" / "node_modules"
    script = executable(
        modules / "pkg" / "node_modules" / "x" / "index.js", "#!/usr/bin/env node\n"
    )
    (modules / ".bin").mkdir(parents=True)
    (modules / ".bin" / "server").symlink_to(script)
    found = installed([str(modules / ".bin" / "server"), "/"], "/usr/bin:/bin")
    assert found.paths == (modules,)  # ("/" is an argument, never shown; node is in /usr)
    assert found.notes == ()


def test_a_venv_script_shows_its_venv_and_the_prefix_of_its_python(tmp_path: Path) -> None:
    prefix = tmp_path / "pyenv" / "versions" / "3.99"
    (prefix / "lib").mkdir(parents=True)
    python = executable(prefix / "bin" / "python3.99", "")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {prefix / 'bin'}\n")
    (venv / "bin" / "python").symlink_to(python)
    server = executable(venv / "bin" / "mcp-server-x", f"#!{venv / 'bin' / 'python'}\n")
    found = installed(["mcp-server-x"], f"{venv / 'bin'}:/usr/bin")
    assert set(found.paths) == {venv, prefix}
    assert server.exists()


def test_an_interpreters_script_is_shown_alone_and_code_is_not_a_file(tmp_path: Path) -> None:
    script = executable(tmp_path / "tools" / "server.py", "print()\n")
    assert installed(["python3", str(script)], "/usr/bin:/bin").paths == (script,)
    assert installed(["python3", "-c", str(script)], "/usr/bin:/bin").paths == ()


def test_a_home_folder_is_never_shown_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / "lib").mkdir(parents=True)
    server = executable(home / "bin" / "server", "")
    monkeypatch.setenv("HOME", str(home))
    found = installed([str(server)], "/usr/bin")
    assert found.paths == (server,)
    (note,) = found.notes
    assert note.startswith(f"{server} lies in {home}, which the sandbox never shows whole")


def test_a_program_not_on_path_is_said() -> None:
    found = installed(["no-such-server-x1"], "/usr/bin:/bin")
    assert found.paths == () and found.notes == (
        "no-such-server-x1 is not found on the command's PATH",
    )


def test_a_program_in_the_workspace_chooses_nothing_else_to_show(tmp_path: Path) -> None:
    """The task may write a file of its workspace: a ``#!`` line there that names a
    program elsewhere (a folder of the user's, say) is not followed."""
    elsewhere = tmp_path / "private"
    (elsewhere / "lib").mkdir(parents=True)
    python = executable(elsewhere / "bin" / "python3", "")
    workspace = tmp_path / "ws"
    server = executable(workspace / "server", f"#!{python}\n")
    assert installed([str(server)], "/usr/bin", workspace=workspace).paths == ()
    assert installed([str(server)], "/usr/bin").paths == (server, elsewhere)  # (the control)
