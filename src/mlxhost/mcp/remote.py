"""The check on an MCP server URL that a request names (not one the config names): refused unless the
server runs with `--mcp-allow-remote`, and then refused still when its host resolves to a private, loopback,
link-local or otherwise non-public address, by the same rule as media URLs (multimodal/fetch.py). The SDK
follows a redirect only within the URL's own origin, so a checked URL cannot bounce to an internal host; and
every connection resolves and checks the host again itself (mcp/guarded_http.py), so a second DNS answer
cannot either.
"""

from __future__ import annotations

import socket
from typing import Callable
from urllib.parse import urlsplit

from mlxhost.multimodal.fetch import is_public_address

# (host, port) -> its addresses; blocking. The manager holds one, so tests can answer as a rebinding DNS would.
Resolve = Callable[[str, int], list[str]]


class RemoteRefused(ValueError):
    """The request may not use this URL (a 400 naming why)."""


def resolve_host(host: str, port: int) -> list[str]:
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def public_addresses(host: str, port: int, resolve: Resolve = resolve_host) -> list[str]:
    """`host`'s addresses when every one is public (a name with one public and one private address could
    land on either); RemoteRefused otherwise. Blocking: callers on the event loop run it in a worker thread.
    Messages do not name the addresses: they would map the server's internal DNS."""
    try:
        addrs = resolve(host, port)
        public = bool(addrs) and all(is_public_address(a) for a in addrs)
    except (OSError, UnicodeError, ValueError) as exc:
        raise RemoteRefused(f"cannot resolve MCP server host {host!r}: {exc}") from None
    if not public:
        raise RemoteRefused(f"MCP server host {host!r} resolves to a private or local address; such "
                            "URLs are refused (configure the server in --mcp-config instead)")
    return addrs


def check_remote_url(url: str, allow_remote: bool, resolve: Resolve = resolve_host) -> None:
    """Blocking (a DNS lookup): callers on the event loop run it in a worker thread."""
    if not allow_remote:
        raise RemoteRefused("MCP servers named by URL in a request are refused on this server: use a server label "
                            "from its --mcp-config (GET /v1/mcp/servers), or start it with --mcp-allow-remote")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteRefused(f"MCP server_url must be an http(s) URL with a host, got {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise RemoteRefused(f"MCP server_url has a bad port: {exc}") from None
    public_addresses(parts.hostname, port, resolve)
