"""The ``SharedStore`` conformance suite (``worker.testing.shared_conformance``): import
its tests into a test module of your backend and give a ``shared_backend`` fixture::

    from agentd.testing.shared_conformance import *  # noqa: F403
"""

from worker.testing.shared_conformance import *  # noqa: F403
