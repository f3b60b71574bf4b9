"""An MCP server of arithmetic tools, written with the `mcp` package: the `power` tool that
`train.py --task power` trains with, and an example of an MCP server for the server's --mcp flag.

    python server.py --mcp 'arith=python examples/mcp_arith.py'                          # stdio
    python examples/mcp_arith.py --port 8123 & python server.py --mcp arith=http://127.0.0.1:8123/mcp
"""

import argparse

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


def main():
    """Serve the tools registered on `mcp` (tests/mcp_tools.py adds its own first)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # without: stdio
    p.add_argument("--port", type=int, help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    port = p.parse_args().port
    if port:
        mcp.run("streamable-http", port=port)
    else:
        mcp.run("stdio")


if __name__ == "__main__":
    main()
