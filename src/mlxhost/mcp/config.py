"""The MCP servers this server may use and the limits on every call.

`--mcp-config FILE` reads the `mcpServers` object desktop agents use:

    {"mcpServers": {
        "time": {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"], "env": {"TZ": "UTC"}},
        "docs": {"url": "http://127.0.0.1:9000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server entry may also name `cwd`, `allowed_tools` (only these are listed and callable) and
`require_approval` ("never" by default; "always" makes Responses clients approve each call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SERVER_KEYS = {"command", "args", "env", "cwd", "url", "headers", "allowed_tools", "require_approval", "type",
                "disabled", "description"}


@dataclass(frozen=True)
class McpServerConfig:
    """One server: a program talking MCP over stdin/stdout (`command`), or a streamable-HTTP `url`."""

    label: str
    command: str | None = None
    args: tuple[str, ...] = ()
    # The only variables the program gets beyond the MCP SDK's minimal set (PATH, HOME, USER, SHELL,
    # TERM, LOGNAME): none of this server's own environment (API keys, tokens) leaks to it.
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    allowed_tools: tuple[str, ...] | None = None  # None: every tool the server lists
    require_approval: str = "never"
    description: str | None = None

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.label!r}: give either `command` (stdio) or `url` (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.label!r}: url must be http:// or https://, got {self.url!r}")
        if self.require_approval not in ("never", "always"):
            raise ValueError(f"MCP server {self.label!r}: require_approval must be never or always")

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "streamable_http"

    def allows(self, tool: str) -> bool:
        return self.allowed_tools is None or tool in self.allowed_tools


@dataclass(frozen=True)
class McpConfig:
    servers: tuple[McpServerConfig, ...] = ()
    # Requests may name MCP server URLs of their own (Responses `server_url`, Anthropic `mcp_servers`);
    # even then a URL whose host is private or local is refused, as media URLs are.
    allow_remote: bool = False
    call_timeout_s: float = 60.0  # one tool call; a call past it is cut and reported as a tool error
    max_output_bytes: int = 64 * 1024  # of one call's output given to the model and the client
    max_num_rounds: int = 8  # model rounds per request, calls in between
    max_loop_s: float = 600.0  # one request's whole loop of rounds and calls
    connect_timeout_s: float = 60.0  # starting a server and listing its tools

    def __post_init__(self) -> None:
        labels = [s.label for s in self.servers]
        if len(labels) != len(set(labels)):
            raise ValueError(f"MCP server labels must be unique, got {labels}")
        for name in ("call_timeout_s", "max_loop_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_output_bytes < 1 or self.max_num_rounds < 1:
            raise ValueError("max_output_bytes and max_num_rounds must be >= 1")

    def server(self, label: str) -> McpServerConfig | None:
        return next((s for s in self.servers if s.label == label), None)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings")
    return tuple(value)


def _pairs(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where} must be an object of strings")
    return tuple(value.items())


def server_config(label: str, entry: Any) -> McpServerConfig:
    where = f"mcpServers.{label}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    unknown = set(entry) - _SERVER_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_SERVER_KEYS)})")
    allowed = entry.get("allowed_tools")
    return McpServerConfig(
        label=label, command=entry.get("command"), args=_strings(entry.get("args", []), f"{where}.args"),
        env=_pairs(entry.get("env", {}), f"{where}.env"), cwd=entry.get("cwd"), url=entry.get("url"),
        headers=_pairs(entry.get("headers", {}), f"{where}.headers"),
        allowed_tools=_strings(allowed, f"{where}.allowed_tools") if allowed is not None else None,
        require_approval=entry.get("require_approval", "never"), description=entry.get("description"))


def read_mcp_servers(path: str | Path) -> tuple[McpServerConfig, ...]:
    """The servers of an `mcpServers` file; entries with `"disabled": true` are left out."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the MCP config {path}: {exc}") from exc
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ValueError(f"{path}: expected an object with `mcpServers`")
    return tuple(server_config(label, entry) for label, entry in servers.items()
                 if not (isinstance(entry, dict) and entry.get("disabled")))
