"""agentd's worker: the durable agent harness that runs one task (``python -m worker``)."""

__version__ = "0.1.0"
