"""Media bytes from an http(s) URL, a data: URI, a file:// URL or a local path, behind the MediaConfig limits.

Everything a client can point us at is hostile until checked: URLs may aim at the server's own network
(SSRF), downloads may be endless or drip slowly, base64 may be huge, paths may escape the allowed folders.
Each refusal is a MediaError whose message tells the client what to fix; the API layer answers 400.

Synchronous (httpx streaming): callers on the event loop run it in a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
import stat
import time
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from mlxhost.config import MediaConfig

_USER_AGENT = "mlxhost-media-fetch/0.1"
_REDIRECTS = (301, 302, 303, 307, 308)


class MediaError(ValueError):
    """A media source the client named cannot be used; `param` names the request field (400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class MediaBytes:
    data: bytes
    content_type: str | None  # from the HTTP header or the data: URI; None for files
    origin: str  # short description for error messages ("https://host/...", "data: URI", "file ...")


def read_media_bytes(source: str, config: MediaConfig, param: str | None = None) -> MediaBytes:
    """Dispatch on the source kind; every failure is a MediaError."""
    if not isinstance(source, str) or not source.strip():
        raise MediaError("empty media source: expected an http(s) URL, a data: URI or a file path", param)
    source = source.strip()
    scheme = urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _download(source, config, param)
    if scheme == "data":
        return _decode_data_uri(source, config, param)
    if scheme == "file":
        return MediaBytes(_read_file(_file_url_path(source, param), config, param), None, "file")
    if scheme == "":
        return MediaBytes(_read_file(source, config, param), None, "file")
    raise MediaError(f"unsupported media URL scheme '{scheme}:' (use http, https, data or file)", param)


# --- data: URIs -------------------------------------------------------------------------------------

def _decode_data_uri(uri: str, config: MediaConfig, param: str | None) -> MediaBytes:
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise MediaError("malformed data: URI (no ',' before the payload)", param)
    parts = [p.strip().lower() for p in header.split(";")]
    if "base64" not in parts[1:]:
        raise MediaError("data: URI must be base64-encoded (data:<mime>;base64,<data>)", param)
    # Whitespace and line breaks are common in pasted base64; missing padding too.
    payload = "".join(unquote(payload).split())
    if len(payload) * 3 // 4 > config.max_media_bytes:
        raise MediaError(f"media too large: the data: URI holds more than {config.max_media_bytes} bytes", param)
    payload += "=" * (-len(payload) % 4)
    altchars = b"-_" if ("-" in payload or "_" in payload) else None
    try:
        data = base64.b64decode(payload, altchars=altchars, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid base64 in data: URI ({exc})", param) from None
    if not data:
        raise MediaError("empty data: URI", param)
    return MediaBytes(data, parts[0] or None, "data: URI")


# --- local files ------------------------------------------------------------------------------------

def _file_url_path(url: str, param: str | None) -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL names a remote host '{parts.netloc}'; only local files are allowed", param)
    return unquote(parts.path)


def _read_file(path: str, config: MediaConfig, param: str | None) -> bytes:
    if not config.allowed_local_media_paths:
        raise MediaError("local media files are disabled on this server (see --allowed-local-media-path)", param)
    if "\x00" in path:
        raise MediaError("media path contains a NUL byte", param)
    real = os.path.realpath(os.path.expanduser(path))
    roots = [os.path.realpath(os.path.expanduser(d)) for d in config.allowed_local_media_paths]
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise MediaError(f"media path '{path}' is outside the allowed local media folders", param)
    try:
        # Open the resolved path and check the opened file itself: a FIFO or a device would never end.
        # O_NONBLOCK: opening a FIFO with no writer would otherwise block before that check.
        with os.fdopen(os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise MediaError(f"media path '{path}' is not a regular file", param)
            if st.st_size > config.max_media_bytes:
                raise MediaError(
                    f"media too large: '{path}' has {st.st_size} bytes, the limit is {config.max_media_bytes}", param)
            data = f.read(config.max_media_bytes + 1)
    except FileNotFoundError:
        raise MediaError(f"media file '{path}' does not exist", param) from None
    except (IsADirectoryError, PermissionError, OSError) as exc:
        raise MediaError(f"cannot read media file '{path}': {exc.strerror or exc}", param) from None
    if len(data) > config.max_media_bytes:
        raise MediaError(f"media too large: '{path}' exceeds {config.max_media_bytes} bytes", param)
    return data


# --- http(s) ----------------------------------------------------------------------------------------

def is_public_address(addr: str) -> bool:
    """False for private, loopback, link-local, reserved, multicast, unspecified and CGNAT addresses."""
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 reached through IPv6 (mapped ::ffff:a.b.c.d, 6to4 2002:a.b.c.d::, Teredo): judge the IPv4.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            ip = embedded
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified
                                 or ip.is_loopback or ip.is_link_local or ip.is_private)


def _resolve_addresses(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def _check_host(url: httpx.URL, param: str | None) -> str:
    """Refuse a hop whose host resolves to any non-public address (checked before connecting);
    returns the checked address to connect to, so a second lookup cannot answer differently (DNS
    rebinding). Messages do not name the address: they would map the server's internal DNS."""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addrs = _resolve_addresses(url.host, port)
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaError(f"cannot resolve media URL host '{url.host}': {exc}", param) from None
    for addr in addrs:
        if not is_public_address(addr):
            raise MediaError(
                f"media URL host '{url.host}' resolves to a private or local address; "
                "such URLs are refused (see --allow-private-media-urls)", param)
    if not addrs:
        raise MediaError(f"cannot resolve media URL host '{url.host}'", param)
    return addrs[0]


def _pinned(url: httpx.URL, addr: str) -> tuple[httpx.URL, dict, dict]:
    """(URL with the checked address as host, headers, extensions): the request goes to that address
    while the Host header and TLS (SNI and certificate check) still use the name."""
    host = url.host if url.port is None else f"{url.host}:{url.port}"
    return url.copy_with(host=addr.split("%", 1)[0]), {"Host": host}, {"sni_hostname": url.host}


def _check_peer(response: httpx.Response, host: str, param: str | None) -> None:
    # The address actually connected to: DNS may answer differently than in _check_host (rebinding).
    stream = response.extensions.get("network_stream")
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if peer is None:
        raise MediaError(f"cannot verify the address of media URL host '{host}'", param)
    if not is_public_address(peer[0]):
        raise MediaError(f"media URL host '{host}' connected to a private or local address; "
                         "such URLs are refused (see --allow-private-media-urls)", param)


def _download(url: str, config: MediaConfig, param: str | None) -> MediaBytes:
    deadline = time.monotonic() + config.fetch_deadline_s
    t = config.fetch_timeout_s
    # trust_env=False: an environment proxy would hide the peer address that the private-address check reads.
    with httpx.Client(timeout=httpx.Timeout(t, connect=t), follow_redirects=False, trust_env=False,
                      headers={"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}) as client:
        for _ in range(config.max_redirects + 1):
            try:
                target = httpx.URL(url)
            except (httpx.InvalidURL, ValueError) as exc:
                raise MediaError(f"invalid media URL '{url}': {exc}", param) from None
            if target.scheme not in ("http", "https") or not target.host:
                raise MediaError(f"invalid or unsupported media URL '{url}' (http or https only)", param)
            request_url, headers, extensions = target, {}, {}
            if not config.allow_private_media_urls:
                request_url, headers, extensions = _pinned(target, _check_host(target, param))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MediaError(f"fetching media URL '{url}' timed out (over {config.fetch_deadline_s:g} s)", param)
            try:
                with client.stream("GET", request_url, headers=headers, extensions=extensions,
                                   timeout=httpx.Timeout(min(t, remaining))) as response:
                    if not config.allow_private_media_urls:
                        _check_peer(response, target.host, param)
                    if response.status_code in _REDIRECTS and "location" in response.headers:
                        url = urljoin(str(target), response.headers["location"])
                        continue
                    if response.status_code >= 400:
                        raise MediaError(f"fetching media URL '{url}' failed: HTTP {response.status_code} "
                                         f"{response.reason_phrase}".rstrip(), param)
                    encoding = response.headers.get("content-encoding", "identity").strip().lower()
                    if encoding not in ("", "identity"):
                        # Decoded in one piece per read, a compressed body could blow far past the size cap.
                        raise MediaError(f"media URL '{url}' sent a compressed body ({encoding}); "
                                         "media must be sent uncompressed", param)
                    data = _read_body(response, url, config, deadline, param)
                    ctype = response.headers.get("content-type", "").split(";")[0].strip().lower() or None
                    return MediaBytes(data, ctype, url)
            except httpx.TimeoutException:
                raise MediaError(f"fetching media URL '{url}' timed out", param) from None
            except httpx.ConnectError as exc:
                raise MediaError(f"cannot connect to media URL '{url}': {exc}", param) from None
            except httpx.HTTPError as exc:
                raise MediaError(f"fetching media URL '{url}' failed: {exc}", param) from None
    raise MediaError(f"media URL redirected more than {config.max_redirects} times", param)


def _read_body(response: httpx.Response, url: str, config: MediaConfig, deadline: float,
               param: str | None) -> bytes:
    limit = config.max_media_bytes
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise MediaError(f"media too large: '{url}' declares {declared} bytes, the limit is {limit}", param)
    chunks, total = [], 0
    # Decoded bytes are counted, so a gzip bomb hits the same limit as a plain large body.
    # No chunk size: httpx would buffer up to it, and a slow drip would dodge the deadline check.
    for chunk in response.iter_bytes():
        total += len(chunk)
        if total > limit:
            raise MediaError(f"media too large: '{url}' sent more than {limit} bytes", param)
        if time.monotonic() > deadline:
            raise MediaError(f"fetching media URL '{url}' timed out (over {config.fetch_deadline_s:g} s)", param)
        chunks.append(chunk)
    if total == 0:
        raise MediaError(f"media URL '{url}' returned an empty body", param)
    return b"".join(chunks)
