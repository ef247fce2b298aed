"""The HTTP transport for MCP URLs a request names. Every connection resolves the host itself, refuses it
unless all its addresses are public (remote.public_addresses), and opens the socket to a checked address,
so a later DNS answer (rebinding) can never point a connection at a private one. TLS still verifies the
URL's host name: httpcore hands start_tls the origin's name, whatever address the socket went to.

Imported only where the mcp extra (httpx2, httpcore2) is installed: by client.py when it connects.
"""

from __future__ import annotations

import contextlib
import ssl
from typing import AsyncIterator, Iterable

import anyio
import httpcore2
import httpx2

from mlxhost.mcp.remote import RemoteRefused, Resolve, public_addresses

# httpcore's errors, raised again as httpx's of the same name (the SDK and our logs know those).
_HTTPCORE_ERRORS = (httpcore2.TimeoutException, httpcore2.NetworkError, httpcore2.ProtocolError,
                    httpcore2.ProxyError, httpcore2.UnsupportedProtocol)


class GuardedBackend(httpcore2.AsyncNetworkBackend):
    """Connects only to checked public addresses of the host, through `inner` (anyio's sockets by default)."""

    def __init__(self, resolve: Resolve, inner: httpcore2.AsyncNetworkBackend | None = None) -> None:
        self.resolve = resolve
        self.inner = inner or httpcore2.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable | None = None) -> httpcore2.AsyncNetworkStream:
        try:
            addrs = await anyio.to_thread.run_sync(public_addresses, host, port, self.resolve)
        except RemoteRefused as exc:
            raise httpcore2.ConnectError(str(exc)) from None
        error: Exception | None = None
        for addr in addrs:  # the checked addresses only: the socket never resolves the name again
            try:
                return await self.inner.connect_tcp(addr, port, timeout, local_address, socket_options)
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                error = exc
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable | None = None) -> httpcore2.AsyncNetworkStream:
        raise httpcore2.ConnectError("an MCP server named by URL is reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx2.AsyncBaseTransport):
    """httpx's transport over a connection pool whose every connection goes through GuardedBackend."""

    def __init__(self, resolve: Resolve, inner: httpcore2.AsyncNetworkBackend | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        # The default context verifies certificates and host names against the system's CAs.
        ssl_context = ssl_context or httpx2.create_ssl_context(trust_env=False)
        self._pool = httpcore2.AsyncConnectionPool(ssl_context=ssl_context,
                                                   network_backend=GuardedBackend(resolve, inner))

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        core_request = httpcore2.Request(
            method=request.method, headers=request.headers.raw, content=request.stream, extensions=request.extensions,
            url=httpcore2.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path))
        with _as_httpx_errors():
            response = await self._pool.handle_async_request(core_request)
        return httpx2.Response(status_code=response.status, headers=response.headers,
                               stream=_ResponseStream(response.stream), extensions=response.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()


class _ResponseStream(httpx2.AsyncByteStream):
    def __init__(self, stream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        if hasattr(self._stream, "aclose"):
            await self._stream.aclose()


@contextlib.contextmanager
def _as_httpx_errors():
    try:
        yield
    except _HTTPCORE_ERRORS as exc:
        mapped = getattr(httpx2, type(exc).__name__, None)
        if not (isinstance(mapped, type) and issubclass(mapped, httpx2.TransportError)):
            mapped = httpx2.TransportError
        raise mapped(str(exc)) from exc
