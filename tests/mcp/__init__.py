"""MCP servers for the tests: the real ones from PyPI and npm, and ``fault_server.py``."""
