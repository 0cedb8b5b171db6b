"""``python -m supervisor``: the agentd command line."""

import sys

from supervisor.cli import main

sys.exit(main())
