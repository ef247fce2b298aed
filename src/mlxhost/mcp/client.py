"""Connections to MCP servers through the official `mcp` SDK, each in its own asyncio task.

The SDK's client is an anyio context whose transport tasks must be entered and left by one task, so every
server gets a task that owns its connection: it connects, lists the tools, then runs the calls sent to it
through a queue. A server that dies (its process killed, its URL gone) fails the calls in flight with a
tool error, and the task reconnects with back-off (0.5 s doubling to 30 s). Every call is logged: server,
tool, duration, output size, never the arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mlxhost.mcp.config import McpConfig, McpServerConfig
from mlxhost.mcp.remote import Resolve, resolve_host

log = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 30.0
_PING_S = 30.0  # an idle connection is pinged this often, so a dead server is restarted before a call needs it


class McpCallError(Exception):
    """A call that produced no tool output: server down, timed out, unknown tool, protocol error."""


@dataclass(frozen=True)
class McpTool:
    server: str
    name: str
    description: str
    input_schema: dict

    def card(self) -> dict:
        return {"name": self.name, "server": self.server, "description": self.description,
                "input_schema": self.input_schema}


@dataclass(frozen=True)
class ToolOutput:
    text: str
    is_error: bool  # the tool itself reported an error (its text says what)


@dataclass
class _Job:
    tool: str
    arguments: dict
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Broken(Exception):
    """The connection failed under a call: leave it and reconnect."""


def result_text(result: Any, max_bytes: int) -> str:
    """A CallToolResult's content as text for a model: text parts joined, other parts named, structured
    content as JSON when there is no text; cut at `max_bytes` (UTF-8) with a note saying so."""
    parts = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind} content: {getattr(block, 'mime_type', None) or 'not shown'}]")
    text = "\n".join(parts)
    if not text and getattr(result, "structured_content", None) is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    return clip_output(text, max_bytes)


def clip_output(text: str, max_bytes: int) -> str:
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    kept = data[:max_bytes].decode(errors="ignore")
    return kept + f"\n[output cut at {max_bytes} of {len(data)} bytes]"


class McpServer:
    """One server's connection, owned by its own task (`start`); `call` from any task of the loop."""

    def __init__(self, config: McpServerConfig, limits: McpConfig, restart: bool = True,
                 resolve: Resolve | None = None) -> None:
        self.config, self.limits, self.restart = config, limits, restart
        # Set for a URL a request named: its connections go only to checked public addresses. None for
        # configured servers, which may be local.
        self.resolve = resolve
        self.tools: list[McpTool] = []
        self.state = "starting"  # starting, ready, restarting, stopped
        self.last_error: str | None = None
        self.num_restarts = 0
        self._jobs: asyncio.Queue[_Job] = asyncio.Queue()
        self._ready = asyncio.Event()
        self._connected = False
        self._task: asyncio.Task | None = None

    @property
    def label(self) -> str:
        return self.config.label

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"mcp-{self.label}")

    async def stop(self) -> None:
        self.state = "stopped"
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._fail_waiting("the MCP server was stopped")

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the server is ready within `timeout`; sooner False when its task has ended (a connection
        that is never restarted, refused or failed)."""
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait([ready, *([self._task] if self._task is not None else [])], timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        return self._ready.is_set()

    def status(self) -> dict:
        c = self.config
        return {"label": c.label, "transport": c.transport, "state": self.state, "num_tools": len(self.tools),
                "num_restarts": self.num_restarts, "last_error": self.last_error,
                "require_approval": c.require_approval, "allowed_tools": list(c.allowed_tools)
                if c.allowed_tools is not None else None, "description": c.description}

    async def call(self, tool: str, arguments: dict) -> ToolOutput:
        """Runs `tool`; raises McpCallError when it produced no output (the message says why)."""
        if not self._ready.is_set():  # restarting: a call waits for it, within the call's own time
            await self.wait_ready(min(self.limits.call_timeout_s, self.limits.connect_timeout_s))
        if not self.config.allows(tool) or all(t.name != tool for t in self.tools):
            raise McpCallError(f"MCP server {self.label!r} has no tool {tool!r}" + (
                "" if self._ready.is_set() else f" (the server is {self.state}: {self.last_error or 'starting'})"))
        job = _Job(tool, arguments)
        await self._jobs.put(job)
        started = time.monotonic()
        try:
            # The server's task cuts the call at the timeout; this bound only guards against a stuck task.
            output = await asyncio.wait_for(asyncio.shield(job.done), self.limits.call_timeout_s + 5)
        except asyncio.TimeoutError:
            job.done.cancel()
            raise McpCallError(f"MCP tool {tool!r} timed out after {self.limits.call_timeout_s:g} s") from None
        except asyncio.CancelledError:  # the request went away (its client left): the call stops too
            job.done.cancel()
            raise
        except McpCallError as exc:
            log.info("MCP call %s.%s failed after %.2f s: %s", self.label, tool, time.monotonic() - started, exc)
            raise
        log.info("MCP call %s.%s: %.2f s, %d bytes%s", self.label, tool, time.monotonic() - started,
                 len(output.text.encode()), " (tool error)" if output.is_error else "")
        return output

    # -- the connection's task -----------------------------------------------------------------------
    def _target(self) -> tuple[Any, Any]:
        """What the SDK's Client connects to, and an HTTP client to close afterwards (or None)."""
        c = self.config
        if c.command is not None:
            from mcp import StdioServerParameters  # optional: the mcp extra

            return StdioServerParameters(command=c.command, args=list(c.args), env=dict(c.env) or None,
                                         cwd=c.cwd), None
        import httpx2  # optional: the mcp extra
        from mcp.client.streamable_http import streamable_http_client  # optional: the mcp extra

        transport = None
        if self.resolve is not None:
            from mlxhost.mcp.guarded_http import GuardedTransport  # optional: needs httpcore2, of the mcp extra

            transport = GuardedTransport(self.resolve)
        # trust_env=False: no environment proxy or netrc credentials go to a server the config did not name.
        http = httpx2.AsyncClient(headers=dict(c.headers), trust_env=False, transport=transport,
                                  timeout=httpx2.Timeout(30.0, read=self.limits.call_timeout_s + 30))
        return streamable_http_client(c.url, http_client=http), http

    async def _run(self) -> None:
        delay = _FIRST_BACKOFF_S
        while True:
            try:
                await self._serve()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - anyio wraps failures in exception groups
                self.last_error = _describe(exc)
            if self._connected:  # it served for a while: a new failure starts the back-off again
                delay, self._connected = _FIRST_BACKOFF_S, False
            self._ready.clear()
            self._fail_waiting(f"MCP server {self.label!r} stopped: {self.last_error}")
            if not self.restart:
                self.state = "stopped"
                return
            self.state = "restarting"
            log.warning("MCP server %s is down (%s); restarting in %.1f s", self.label, self.last_error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF_S)
            self.num_restarts += 1

    async def _serve(self) -> None:
        import anyio  # lazy: anyio only when used
        from mcp import Client  # optional: the mcp extra

        target, http = self._target()
        try:
            # The handshake is bounded by read_timeout_seconds; no cancel scope may wrap the Client's entry,
            # as its transport's task group stays open after it.
            async with Client(target, read_timeout_seconds=self.limits.connect_timeout_s) as client:
                with anyio.fail_after(self.limits.connect_timeout_s):
                    self.tools = await self._list_tools(client)
                self.state, self.last_error, self._connected = "ready", None, True
                self._ready.set()
                log.info("MCP server %s ready: %d tools (%s)", self.label, len(self.tools),
                         ", ".join(t.name for t in self.tools))
                async with anyio.create_task_group() as group:
                    group.start_soon(self._ping, client)
                    while True:
                        job = await self._jobs.get()
                        group.start_soon(self._call, client, job)
        finally:
            if http is not None:
                await http.aclose()

    async def _list_tools(self, client: Any) -> list[McpTool]:
        tools, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools += [McpTool(self.label, t.name, t.description or "", dict(t.input_schema or {"type": "object"}))
                      for t in page.tools if self.config.allows(t.name)]
            cursor = page.next_cursor
            if not cursor:
                return tools

    async def _ping(self, client: Any) -> None:
        import anyio  # lazy: anyio only when used
        from mcp import MCPError  # optional: the mcp extra

        while True:
            await anyio.sleep(_PING_S)
            try:
                with anyio.fail_after(self.limits.call_timeout_s):
                    await client.send_ping()
            except MCPError as exc:
                # Any answer proves the server alive: servers of the 2026-07-28 protocol answer ping with
                # "method not found".
                if not _is_connection_error(exc):
                    continue
                self._broken()
                raise _Broken(f"ping failed: {_describe(exc)}") from exc
            except Exception as exc:
                self._broken()
                raise _Broken(f"ping failed: {_describe(exc)}") from exc

    async def _call(self, client: Any, job: _Job) -> None:
        import anyio  # lazy: anyio only when used
        from mcp import MCPError  # optional: the mcp extra

        if job.done.done():  # the caller gave up already
            return
        try:
            with anyio.fail_after(self.limits.call_timeout_s) as scope:
                # A caller that gives up cancels the call; the SDK then tells the server to stop it.
                job.done.add_done_callback(lambda _: scope.cancel())
                result = await client.call_tool(job.tool, job.arguments)
            if job.done.cancelled():
                return
        except TimeoutError:
            _settle(job, exc=McpCallError(f"MCP tool {job.tool!r} timed out after {self.limits.call_timeout_s:g} s"))
            return
        except MCPError as exc:
            if _is_connection_error(exc):
                _settle(job, exc=McpCallError(f"MCP server {self.label!r} went away during the call ({exc}); "
                                              "it is being restarted"))
                self._broken()
                raise _Broken(str(exc)) from exc
            _settle(job, exc=McpCallError(f"MCP server {self.label!r}: {exc}"))
            return
        except Exception as exc:  # the transport broke under the call (a killed process, a dropped socket)
            _settle(job, exc=McpCallError(f"MCP server {self.label!r} failed during the call: {_describe(exc)}"))
            self._broken()
            raise _Broken(_describe(exc)) from exc
        _settle(job, ToolOutput(result_text(result, self.limits.max_output_bytes), bool(result.is_error)))

    def _broken(self) -> None:
        # At once, before the task unwinds: calls arriving now wait for the restart instead of queueing here.
        self._ready.clear()
        self.state = "restarting"

    def _fail_waiting(self, message: str) -> None:
        while not self._jobs.empty():
            _settle(self._jobs.get_nowait(), exc=McpCallError(message))


def _settle(job: _Job, output: ToolOutput | None = None, exc: Exception | None = None) -> None:
    if not job.done.done():
        if exc is not None:
            job.done.set_exception(exc)
        else:
            job.done.set_result(output)


def _is_connection_error(exc: Exception) -> bool:
    from mcp_types.jsonrpc import CONNECTION_CLOSED  # optional: the mcp extra

    return getattr(exc, "code", None) == CONNECTION_CLOSED


def _describe(exc: BaseException) -> str:
    """The innermost useful message of an exception group (anyio wraps a task's failure in one)."""
    # An exception group by its `exceptions` tuple: Python 3.10 has no BaseExceptionGroup builtin.
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class McpManager:
    """The configured servers: started with the model server, stopped with it; and short-lived
    connections to the URLs requests name (`open_remote`)."""

    def __init__(self, config: McpConfig, resolve: Resolve = resolve_host) -> None:
        if importlib.util.find_spec("mcp") is None:
            raise RuntimeError('MCP servers need the mcp SDK: pip install "mlxhost[mcp]"')
        self.config = config
        self.resolve = resolve  # the DNS lookup for URLs requests name (checked, then checked per connection)
        self.servers = {s.label: McpServer(s, config) for s in config.servers}

    async def start(self) -> None:
        for server in self.servers.values():
            server.start()
        # Wait a little for the first listing, so the banner's first requests see the tools; a slow
        # server keeps starting in the background.
        await asyncio.gather(*(s.wait_ready(self.config.connect_timeout_s) for s in self.servers.values()))

    async def close(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()))

    def server(self, label: str) -> McpServer | None:
        return self.servers.get(label)

    def tools(self, labels: list[str] | None = None) -> list[McpTool]:
        return [t for s in self.servers.values() if labels is None or s.label in labels for t in s.tools]

    async def call(self, label: str, tool: str, arguments: dict) -> ToolOutput:
        server = self.servers.get(label)
        if server is None:
            raise McpCallError(f"no MCP server {label!r} is configured")
        return await server.call(tool, arguments)

    @contextlib.asynccontextmanager
    async def open_remote(self, label: str, url: str, headers: dict[str, str] | None = None):
        """A connection to a URL a request named, for that request only (never restarted). The caller
        checks the URL first (remote.check_remote_url)."""
        config = McpServerConfig(label=label, url=url, headers=tuple((headers or {}).items()))
        server = McpServer(config, self.config, restart=False, resolve=self.resolve)
        server.start()
        try:
            if not await server.wait_ready(self.config.connect_timeout_s):
                raise McpCallError(f"cannot connect to the MCP server at {url}: {server.last_error or 'timed out'}")
            yield server
        finally:
            await server.stop()
