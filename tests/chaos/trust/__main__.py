import sys

from tests.chaos.trust import main

sys.exit(main())
