"""What agentd's own tests use, for testing your tools, your harness or a deployment
without the real service: the local Messages API (``MessagesAPIServer``: it validates
every request as the API does, serves scripted replies and injects faults) and a long
journal written as a worker would have (``long_journal``).

The conformance suites are modules of their own, imported by a backend's test module
(they need pytest, the ``agentd[testing]`` extra): ``agentd.testing.store_conformance``
and ``agentd.testing.shared_conformance``.
"""

from __future__ import annotations

from worker.testing.journals import long_journal
from worker.testing.messages_api import Fault, MessagesAPIServer, Reply, validate_request

__all__ = ["Fault", "MessagesAPIServer", "Reply", "long_journal", "validate_request"]
