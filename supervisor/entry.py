"""The ``agentd`` command: ``agentd status --json`` answered by the running daemon when it
can be (``supervisor.ask``), every other command (and that one, when it cannot) by
``supervisor.cli``, which this module imports only then.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from supervisor.ask import answered


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    answer = answered(args, os.environ)
    if answer is None:
        from supervisor.cli import main as cli_main  # noqa: PLC0415  (the command line, when the daemon cannot answer)

        return cli_main(args)
    try:
        sys.stdout.buffer.write(answer)
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    return 0
