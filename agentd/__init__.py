"""agentd's public face: the names a user imports, from one stable place.

* ``agentd.tools``: declaring a tool (``tool``, ``ToolContext``, ``ToolError``,
  ``Effect``, ``OutcomeUnknown``, ``ToolResult``, ``Reconcile``);
* ``agentd.testing``: the local Messages API (``MessagesAPIServer``, ``Reply``,
  ``Fault``), a long journal for tests (``long_journal``), and the conformance suites a
  store backend runs (``agentd.testing.store_conformance``,
  ``agentd.testing.shared_conformance``; they need pytest: ``agentd[testing]``).

This package re-exports and holds no logic of its own: the names are the same objects as
under ``worker``, whose paths (``worker.tools.registry``, ``worker.testing``) keep working.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("agentd")
except PackageNotFoundError:  # (run from a checkout that was never installed)
    __version__ = "0+unknown"

__all__ = ["__version__"]
