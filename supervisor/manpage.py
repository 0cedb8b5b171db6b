"""``python -m supervisor.manpage man|bash|zsh|fish``: one rendering of the command line
(``supervisor.clidoc``) of ``supervisor.cli``'s parser, printed; ``make man`` writes the
man page so."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from supervisor import clidoc
from supervisor.cli import build_parser
from worker import __version__


def main(argv: Sequence[str] | None = None) -> int:
    what = (list(argv) if argv is not None else sys.argv[1:]) or ["man"]
    parser = build_parser()
    if what[0] == "man":
        sys.stdout.write(clidoc.man(clidoc.describe(parser), __version__))
    elif what[0] in clidoc.SHELLS:
        sys.stdout.write(clidoc.completion(parser, what[0]))
    else:
        print("usage: python -m supervisor.manpage man|bash|zsh|fish", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
