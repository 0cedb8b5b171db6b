"""Test helpers shipped with agentd, for its own tests and benchmarks and for users who
test their own tools and deployments against a model that is not the real service.

* ``worker.testing.messages_api``: ``MessagesAPIServer``, a local stand-in for the
  Anthropic Messages API on 127.0.0.1 that the official SDK (and so an agentd worker)
  talks to unchanged: it validates every request as the API does, serves scripted
  replies and injects faults (429, 5xx, 529, dropped or cut streams, hangs) on demand.
* ``worker.testing.store_conformance`` and ``worker.testing.shared_conformance``: the
  conformance suites of the ``TaskStore`` and ``SharedStore`` Protocols, for any
  backend to run (pytest needed; docs/development.md says how).

Nothing in agentd itself imports this package: it is for tests.
"""
