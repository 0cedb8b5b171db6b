"""Confinement of tool paths to the task's workspace.

A path from the model is relative to the workspace. It is refused when it is absolute,
contains NUL, or resolves (following ``..`` and any symlink on the way) outside the
workspace. The check resolves real paths, so a symlink planted inside the workspace that
points out of it is refused too.
"""

from __future__ import annotations

import os
from pathlib import Path

from worker.tools.tool import ToolError


def confine(workspace: Path, user_path: str) -> Path:
    if "\0" in user_path:
        raise ToolError("path contains a NUL byte")
    if os.path.isabs(user_path):
        raise ToolError(f"path {user_path!r} is absolute; give a path inside the workspace")
    root = os.path.realpath(workspace)
    target = os.path.realpath(os.path.join(root, user_path))
    if target != root and not target.startswith(root + os.sep):
        raise ToolError(f"path {user_path!r} escapes the workspace")
    return Path(target)
