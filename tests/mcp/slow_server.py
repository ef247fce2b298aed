"""A stdio MCP server for the tests: its process id, its environment, a tool that sleeps, one that answers n bytes, one that
waits for a file (a call the test holds, then lets go or abandons)."""

import os
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer

app = MCPServer("slow")


@app.tool()
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


@app.tool()
def env(name: str) -> str:
    """The value of an environment variable, or "unset"."""
    return os.environ.get(name, "unset")


@app.tool()
async def sleep(seconds: float) -> str:
    """Sleeps, then says so."""
    await anyio.sleep(seconds)
    return "slept"


@app.tool()
def big(n: int) -> str:
    """n bytes of x."""
    return "x" * n


@app.tool()
async def wait_file(path: str) -> str:
    """Writes this server's process id to `path`.started, waits until the file `path` exists, then answers
    its text; a call cancelled meanwhile writes `path`.cancelled."""
    Path(path + ".started").write_text(str(os.getpid()))
    try:
        while not os.path.exists(path):
            await anyio.sleep(0.02)
    except anyio.get_cancelled_exc_class():
        Path(path + ".cancelled").write_text("cancelled")
        raise
    return Path(path).read_text()


if __name__ == "__main__":
    app.run()
