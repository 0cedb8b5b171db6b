"""A Streamable HTTP MCP server for the tests: ``python http_server.py PORT``.

Built on the SDK's own server (``MCPServer``, served by uvicorn on 127.0.0.1:PORT at
``/mcp``). Its tool ``authorization`` returns the ``Authorization`` header of the last
request it was sent: what the tests check a ``headers`` value (``${cred:NAME}``) by.
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

seen: dict[str, str] = {}
server = MCPServer("agentd-test-http")


@server.tool()
def authorization() -> str:
    """The Authorization header of the last request."""
    return seen.get("authorization", "none")


app = server.streamable_http_app()


async def recording(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        for name, value in scope["headers"]:
            if name == b"authorization":
                seen["authorization"] = value.decode()
    await app(scope, receive, send)


if __name__ == "__main__":
    uvicorn.run(recording, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
