"""A real MCP server for the server's --mcp flag (tests/test_rollout.py): the tools of
examples/mcp_arith.py, well-behaved, and misbehaving ones.

    python server.py --mcp 'arith=python tests/mcp_tools.py'                 # stdio
    python tests/mcp_tools.py --port 8123 & python server.py --mcp arith=http://127.0.0.1:8123/mcp
"""

import os
import sys
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)

from mcp_arith import main, mcp  # noqa: E402


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
def echo(name: str, session: str) -> str:
    """Both arguments: parameters named as the calling server's own (name, session)."""
    return f"{name} {session}"


@mcp.tool()
def getenv(variable: str) -> str:
    """This MCP server's environment variable `variable`, or "unset"."""
    return os.environ.get(variable, "unset")


@mcp.tool()
def dies() -> str:
    """End this MCP server mid-call."""
    os._exit(1)


if __name__ == "__main__":
    main()
