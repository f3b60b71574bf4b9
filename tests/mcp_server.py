"""A tiny MCP server over stdio, for the RolloutEngine tests: `python tests/mcp_server.py`."""
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


if __name__ == "__main__":
    server.run("stdio")
