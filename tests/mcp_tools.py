"""A real MCP server, written with the `mcp` package, for the server's --mcp flag
(tests/test_rollout.py): well-behaved tools and misbehaving ones.

    python server.py --mcp 'arith=python tests/mcp_tools.py'                 # stdio
    python tests/mcp_tools.py --port 8123 & python server.py --mcp arith=http://127.0.0.1:8123/mcp
"""

import argparse
import os
import time

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("arith")


@mcp.tool()
def add(a: int, b: int) -> str:
    """The sum of two integers."""
    return str(a + b)


@mcp.tool()
def power(base: int, exponent: int = 2) -> str:
    """base to the power `exponent` (at most 64)."""
    return str(base ** min(exponent, 64))


@mcp.tool()
def fails(reason: str) -> str:
    """Raise: the call answers an error."""
    raise ValueError(reason)


@mcp.tool()
def hangs() -> str:
    """Never answer (for ten minutes)."""
    time.sleep(600)
    return "woke up"


@mcp.tool()
def dies() -> str:
    """End this MCP server mid-call."""
    os._exit(1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    # without: stdio
    p.add_argument("--port", type=int, help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    port = p.parse_args().port
    if port:
        mcp.run("streamable-http", port=port)
    else:
        mcp.run("stdio")
