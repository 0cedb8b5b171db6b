"""``python -m supervisor``: the agentd command line."""

import sys

from supervisor.entry import main

sys.exit(main())
