"""A stdio MCP server for the tests: its process id, a tool that sleeps, one that answers n bytes."""

import os

import anyio
from mcp.server.mcpserver import MCPServer

app = MCPServer("slow")


@app.tool()
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


@app.tool()
async def sleep(seconds: float) -> str:
    """Sleeps, then says so."""
    await anyio.sleep(seconds)
    return "slept"


@app.tool()
def big(n: int) -> str:
    """n bytes of x."""
    return "x" * n


if __name__ == "__main__":
    app.run()
