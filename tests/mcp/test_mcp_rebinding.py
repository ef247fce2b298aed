"""MCP URLs a request names, against DNS rebinding: every connection resolves and checks the host itself and
opens its socket to a checked address (mcp/guarded_http.py), while TLS still verifies the URL's host name.
A fake resolver answers a public address to the first lookup and 127.0.0.1 to later ones; where a test needs a
server, the innermost network backend maps the checked public address onto one on 127.0.0.1."""

from __future__ import annotations

import asyncio
import datetime
import http.server
import socket
import ssl
import threading

import httpcore2
import httpx2
import pytest

from mlxhost.mcp.config import McpConfig
from mlxhost.mcp.guarded_http import GuardedBackend, GuardedTransport
from mlxhost.mcp.remote import RemoteRefused, check_remote_url
from tests.mcp.conftest import SLOW_SERVER

PUBLIC = "93.184.216.34"


class Rebinding:
    """A DNS that answers `first` once, then `then`: what an attacker's name server does."""

    def __init__(self, first: str = PUBLIC, then: str = "127.0.0.1") -> None:
        self.first, self.then, self.lookups = first, then, []

    def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        return [self.first if len(self.lookups) == 1 else self.then]


class Recording(httpcore2.AsyncNetworkBackend):
    """A network backend that records where it is asked to connect, and refuses (or hands it to `then`)."""

    def __init__(self, then: httpcore2.AsyncNetworkBackend | None = None, to: tuple[str, int] | None = None):
        self.connects, self.then, self.to = [], then, to

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.connects.append((host, port))
        if self.then is None:
            raise httpcore2.ConnectError("refused by the test backend")
        return await self.then.connect_tcp(*self.to, timeout, local_address, socket_options)

    async def sleep(self, seconds):
        await asyncio.sleep(seconds)


@pytest.fixture
def listener():
    """A TCP port on 127.0.0.1 that counts the connections it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1], accepted
    server.close()


def test_a_rebound_name_is_refused_at_connect_time_and_never_reaches_loopback(mcp_app, listener):
    port, accepted = listener
    dns = Rebinding()
    client, _ = mcp_app(["hi"], McpConfig(servers=(SLOW_SERVER,), allow_remote=True, connect_timeout_s=30), dns)
    # localhost: without the connection's own check the system resolver would reach the listener.
    r = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [
        {"type": "mcp", "server_label": "x", "server_url": f"http://localhost:{port}/mcp",
         "require_approval": "never"}]})
    assert r.status_code == 400, r.text
    assert "private or local address" in r.json()["error"]["message"]
    assert len(dns.lookups) >= 2  # the URL check, then the connection's own lookup
    assert accepted == []


def test_the_url_check_uses_the_managers_resolver():
    with pytest.raises(RemoteRefused, match="private or local"):
        check_remote_url("http://mcp.example.com/mcp", True, Rebinding(first="10.1.2.3"))
    with pytest.raises(RemoteRefused, match="private or local"):
        check_remote_url("http://mcp.example.com/mcp", True, lambda host, port: [PUBLIC, "127.0.0.1"])
    check_remote_url("http://mcp.example.com/mcp", True, Rebinding())


def test_the_backend_connects_to_the_checked_address_only():
    async def run():
        inner = Recording()
        backend = GuardedBackend(Rebinding(then=PUBLIC), inner)
        with pytest.raises(httpcore2.ConnectError, match="refused by the test backend"):
            await backend.connect_tcp("mcp.example.com", 443)
        assert inner.connects == [(PUBLIC, 443)]  # the address, never the name (a second lookup)
        inner = Recording()
        backend = GuardedBackend(lambda host, port: ["127.0.0.1"], inner)
        with pytest.raises(httpcore2.ConnectError, match="private or local"):
            await backend.connect_tcp("mcp.example.com", 443)
        with pytest.raises(httpcore2.ConnectError):
            await backend.connect_unix_socket("/tmp/mcp.sock")
        assert inner.connects == []

    asyncio.run(run())


@pytest.fixture
def http_mcp_server():
    """A streamable-HTTP MCP server of the SDK on 127.0.0.1 that answers to the Host mcp.example.com; its port."""
    import uvicorn
    from mcp.server.mcpserver import MCPServer
    from mcp.server.transport_security import TransportSecuritySettings

    app = MCPServer("calc")

    @app.tool()
    def add(a: int, b: int) -> str:
        """Adds two integers."""
        return str(a + b)

    security = TransportSecuritySettings(allowed_hosts=["mcp.example.com"])
    server = uvicorn.Server(uvicorn.Config(app.streamable_http_app(transport_security=security), host="127.0.0.1",
                                           port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(6000):  # a bound against hangs
        if server.started:
            break
        threading.Event().wait(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(30)


def test_an_mcp_session_runs_through_the_guarded_transport(http_mcp_server):
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def run():
        inner = Recording(then=httpcore2.AnyIOBackend(), to=("127.0.0.1", http_mcp_server))
        http = httpx2.AsyncClient(transport=GuardedTransport(lambda host, port: [PUBLIC], inner))
        async with http, Client(streamable_http_client("http://mcp.example.com/mcp", http_client=http),
                                read_timeout_seconds=60) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            result = await client.call_tool("add", {"a": 2, "b": 3})
        return names, result.content[0].text, inner.connects

    names, text, connects = asyncio.run(run())
    assert names == ["add"] and text == "5"
    assert connects and set(connects) == {(PUBLIC, 80)}


def _certificate(hostname: str, ca=None):
    """(PEM certificate, PEM key) for `hostname`, signed by `ca` (itself a CA when None)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    issuer_cert, issuer_key = (None, key) if ca is None else ca
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(name if issuer_cert is None else issuer_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1)))
    if ca is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert, key, cert.public_bytes(serialization.Encoding.PEM), pem_key


@pytest.fixture
def tls_server(tmp_path):
    """serve(cert_hostname) -> (port, CA file): an HTTPS server on 127.0.0.1 whose certificate names
    `cert_hostname`, signed by a CA of the test's own."""
    ca_cert, ca_key, ca_pem, _ = _certificate("mlxhost test CA")
    (tmp_path / "ca.pem").write_bytes(ca_pem)
    servers = []

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    def serve(cert_hostname: str):
        _, _, cert_pem, key_pem = _certificate(cert_hostname, (ca_cert, ca_key))
        (tmp_path / "cert.pem").write_bytes(cert_pem)
        (tmp_path / "key.pem").write_bytes(key_pem)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1], str(tmp_path / "ca.pem")

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("cert_hostname, ok", [("mcp.example.com", True), ("other.example.net", False)])
def test_tls_verifies_the_urls_host_name_on_the_pinned_address(tls_server, cert_hostname, ok):
    port, ca_file = tls_server(cert_hostname)

    async def get():
        # The checked public address is mapped onto the local test server by the innermost backend.
        inner = Recording(then=httpcore2.AnyIOBackend(), to=("127.0.0.1", port))
        transport = GuardedTransport(lambda host, port: [PUBLIC], inner, ssl.create_default_context(cafile=ca_file))
        async with httpx2.AsyncClient(transport=transport) as http:
            try:
                return (await http.get("https://mcp.example.com/mcp")).text, inner.connects
            except httpx2.ConnectError as exc:
                return exc, inner.connects

    answer, connects = asyncio.run(get())
    assert connects == [(PUBLIC, 443)]
    if ok:
        assert answer == "ok"
    else:
        assert isinstance(answer, httpx2.ConnectError) and "certificate" in str(answer).lower(), answer
