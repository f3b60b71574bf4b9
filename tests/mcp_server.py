"""A tiny MCP server over stdio, for the RolloutEngine tests: `python tests/mcp_server.py`."""

import asyncio

from mcp.server.mcpserver import MCPServer

server = MCPServer("test-tools")


@server.tool()
def reverse(text: str) -> str:
    """Reverse a string."""
    return text[::-1]


@server.tool()
def shout(text: str) -> str:
    """Upper-case a string."""
    return text.upper() + "!"


@server.tool()
async def slow(seconds: str) -> str:
    """Answer after `seconds` seconds (to test tool timeouts)."""
    await asyncio.sleep(float(seconds))
    return "done"


if __name__ == "__main__":
    server.run("stdio")
