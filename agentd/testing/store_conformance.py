"""The ``TaskStore`` conformance suite (``worker.testing.store_conformance``): import its
tests into a test module of your backend and give a ``store`` fixture::

    from agentd.testing.store_conformance import *  # noqa: F403
"""

from worker.testing.store_conformance import *  # noqa: F403
