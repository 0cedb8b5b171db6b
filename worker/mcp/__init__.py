"""MCP tool servers (docs/design.md section 11): any MCP server's tools in a task.

The parts that need no SDK are imported by every worker, the CLI and the daemon:
``naming`` (the names the model sees, the globs of ``--tools``), ``catalog`` (the list of
tools a task is offered, recorded in its journal, and where each effect class comes from),
``settings`` (``[mcp.servers.NAME]``). The parts on the ``mcp`` SDK (the ``agentd[mcp]``
extra) are imported only by a process that talks to a server: ``session`` (one server's
process or endpoint and its client session), ``servers`` (a worker's servers on a thread of
their own, supervised, called synchronously by the loop) and ``results`` (a tool result as
the model gets it).
"""
