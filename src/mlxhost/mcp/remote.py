"""The check on an MCP server URL that a request names (not one the config names): refused unless the
server runs with `--mcp-allow-remote`, and then refused still when its host resolves to a private, loopback,
link-local or otherwise non-public address, by the same rule as media URLs (multimodal/fetch.py). The SDK
follows a redirect only within the URL's own origin, so a checked URL cannot bounce to an internal host.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from mlxhost.multimodal.fetch import is_public_address


class RemoteRefused(ValueError):
    """The request may not use this URL (a 400 naming why)."""


def check_remote_url(url: str, allow_remote: bool) -> None:
    """Blocking (a DNS lookup): callers on the event loop run it in a worker thread."""
    if not allow_remote:
        raise RemoteRefused("MCP servers named by URL in a request are refused on this server: use a server label "
                            "from its --mcp-config (GET /v1/mcp/servers), or start it with --mcp-allow-remote")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteRefused(f"MCP server_url must be an http(s) URL with a host, got {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addrs = [info[4][0] for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError, ValueError) as exc:
        raise RemoteRefused(f"cannot resolve MCP server host {parts.hostname!r}: {exc}") from None
    # Every address: a name that resolves to one public and one private address could land on either.
    if not addrs or not all(is_public_address(a) for a in addrs):
        raise RemoteRefused(f"MCP server host {parts.hostname!r} resolves to a private or local address; such "
                            "URLs are refused (configure the server in --mcp-config instead)")
