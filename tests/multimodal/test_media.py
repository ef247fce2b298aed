"""load_image: every source kind, normalization, and each way media can be refused."""

from __future__ import annotations

import base64
import os
import socket
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from mlxhost.config import MediaConfig
from mlxhost.multimodal import fetch
from mlxhost.multimodal.hashing import image_hash
from mlxhost.multimodal.media import MediaError, load_image
from tests.multimodal.conftest import jpeg_bytes, png_bytes, sample_image

LOCAL = MediaConfig(allow_private_media_urls=True)


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refused(source: str, config: MediaConfig, *words: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        load_image(source, config)
    message = str(info.value).lower()
    for word in words:
        assert word.lower() in message, message
    assert info.value.param == "image_url"
    return info.value


def png_claiming(width: int, height: int, idat: bytes) -> bytes:
    """A 1-bit grayscale PNG whose header says width x height, with the given IDAT payload."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# --- one picture, one hash --------------------------------------------------------------------------

def test_same_image_from_url_base64_and_file_has_one_hash(media_server, tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes(sample_image()))
    config = MediaConfig(allow_private_media_urls=True, allowed_local_media_paths=(str(tmp_path),))
    images = [
        load_image(f"{media_server}/img.png", config),
        load_image(f"{media_server}/redirect", config),
        load_image(data_uri(path.read_bytes()), config),
        load_image(str(path), config),
        load_image(path.as_uri(), config),
        load_image(sample_image().save(tmp_path / "other.png", compress_level=0) or str(tmp_path / "other.png"),
                   config),
    ]
    assert {img.mode for img in images} == {"RGB"}
    assert len({image_hash(img) for img in images}) == 1
    assert np.array_equal(np.asarray(images[0]), np.asarray(sample_image()))


def test_jpeg_from_url(media_server):
    img = load_image(f"{media_server}/img.jpg", LOCAL)
    assert img.size == (48, 32) and img.mode == "RGB"


def test_exif_orientation_is_applied(tmp_path):
    base = sample_image()
    plain = jpeg_bytes(base)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    tagged = jpeg_bytes(base, exif=exif.tobytes())
    config = MediaConfig()
    decoded = load_image(data_uri(plain, "image/jpeg"), config)
    rotated = load_image(data_uri(tagged, "image/jpeg"), config)
    assert rotated.size == (32, 48)
    # The same decoded pixels, rotated beforehand and stored losslessly, give the same hash.
    pre_rotated = load_image(data_uri(png_bytes(decoded.transpose(Image.Transpose.ROTATE_270))), config)
    assert image_hash(rotated) == image_hash(pre_rotated)
    assert image_hash(rotated) != image_hash(decoded)


def test_rgba_is_composited_on_white():
    rgb = sample_image()
    opaque = rgb.convert("RGBA")
    config = MediaConfig()
    assert image_hash(load_image(data_uri(png_bytes(opaque)), config)) == \
        image_hash(load_image(data_uri(png_bytes(rgb)), config))
    arr = np.asarray(opaque).copy()
    arr[0, 0, 3] = 0  # one transparent pixel becomes white
    arr[0, 1, :] = (0, 0, 0, 128)  # half-transparent black becomes mid grey
    out = np.asarray(load_image(data_uri(png_bytes(Image.fromarray(arr))), config))
    assert tuple(out[0, 0]) == (255, 255, 255)
    assert all(abs(int(v) - 127) <= 1 for v in out[0, 1])
    assert np.array_equal(out[1:], np.asarray(rgb)[1:])


def test_other_modes_become_rgb():
    config = MediaConfig()
    la = Image.fromarray(np.array([[[10, 0], [20, 255]]], dtype=np.uint8), "LA")
    assert np.asarray(load_image(data_uri(png_bytes(la)), config))[0].tolist() == [[255] * 3, [20] * 3]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 255, 255, 0, 0])
    palette.putdata([0, 1])
    out = load_image(data_uri(png_bytes(palette, transparency=0)), config)
    assert np.asarray(out)[0].tolist() == [[255, 255, 255], [255, 0, 0]]
    deep = Image.fromarray(np.array([[0, 256, 65535]], dtype=np.uint16))  # 16-bit grey scales, not clips
    assert np.asarray(load_image(data_uri(png_bytes(deep)), config))[0, :, 0].tolist() == [0, 1, 255]


# --- refusals -----------------------------------------------------------------------------------------

def test_http_errors(media_server):
    refused(f"{media_server}/missing.png", LOCAL, "HTTP 404")
    refused(f"{media_server}/text.txt", LOCAL, "not an image", "text/plain")
    refused(f"{media_server}/garbage.png", LOCAL, "image")
    refused(f"{media_server}/redirect-loop", LOCAL, "redirected more than 5")


def test_refused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused(f"http://127.0.0.1:{port}/img.png", LOCAL, "cannot connect")


def test_size_limits(media_server):
    small = MediaConfig(allow_private_media_urls=True, max_media_bytes=1000)
    refused(f"{media_server}/big.png", small, "too large", "5000")  # declared Content-Length
    refused(f"{media_server}/no-length", small, "too large", "more than 1000")  # counted while streaming
    refused(data_uri(b"\0" * 2000), small, "too large")


def test_slow_drip_hits_the_deadline(media_server):
    config = MediaConfig(allow_private_media_urls=True, fetch_timeout_s=5, fetch_deadline_s=0.3)
    refused(f"{media_server}/slow", config, "timed out")


def test_private_urls_refused_by_default(media_server):
    refused(f"{media_server}/img.png", MediaConfig(), "private", "127.0.0.1")
    refused("http://localhost:1/x.png", MediaConfig(), "private")


def test_the_checked_address_is_the_one_connected_to(media_server, monkeypatch):
    # DNS rebinding: a second lookup could answer differently from the checked one, so there is none.
    # "rebind.test" has no DNS at all: the fetch works only if it connects to the address it checked.
    port = media_server.rsplit(":", 1)[1]
    monkeypatch.setattr(fetch, "_resolve_addresses", lambda host, p: ["127.0.0.1"])
    monkeypatch.setattr(fetch, "is_public_address", lambda addr: True)  # pretend loopback is public
    media = fetch.read_media_bytes(f"http://rebind.test:{port}/img.png", MediaConfig(), "image_url")
    assert media.data == png_bytes(sample_image())


def test_peer_address_is_checked_too(media_server, monkeypatch):
    # Defence in depth: should a connection still land on a private address, the response is dropped.
    port = media_server.rsplit(":", 1)[1]
    monkeypatch.setattr(fetch, "_resolve_addresses", lambda host, p: ["127.0.0.1"])
    monkeypatch.setattr(fetch, "_check_host", lambda url, param: "127.0.0.1")
    err = refused(f"http://rebind.test:{port}/img.png", MediaConfig(), "connected to a private")
    assert "127.0.0.1" not in str(err)  # the client learns nothing about internal addresses


def test_every_redirect_hop_is_checked(media_server, routes, monkeypatch):
    port = media_server.rsplit(":", 1)[1]
    routes["/to-private"] = (302, {"Location": f"http://127.0.0.1:{port}/img.png"}, b"")
    answers = iter([True])  # the first hop passes as public, every later check is real
    real, real_resolve = fetch.is_public_address, fetch._resolve_addresses
    monkeypatch.setattr(fetch, "_resolve_addresses",
                        lambda host, p: ["127.0.0.1"] if host == "localhost" else real_resolve(host, p))
    monkeypatch.setattr(fetch, "is_public_address", lambda addr: next(answers, None) or real(addr))
    monkeypatch.setattr(fetch, "_check_peer", lambda *args: None)
    refused(f"http://localhost:{port}/to-private", MediaConfig(), "resolves to a private", "127.0.0.1")


@pytest.mark.parametrize("addr,public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("240.0.0.1", False), ("::1", False), ("fe80::1", False),
    ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::", False), ("ff02::1", False),
])
def test_is_public_address(addr, public):
    assert fetch.is_public_address(addr) is public


def test_bad_sources():
    config = MediaConfig()
    refused("ftp://example.com/a.png", config, "unsupported", "ftp")
    refused("javascript:alert(1)", config, "unsupported")
    refused("", config, "empty")
    refused("data:image/png;base64,@@not*base64@@", config, "invalid base64")
    refused("data:image/png,rawbytes", config, "base64")
    refused("data:image/png;base64", config, "malformed")
    refused(data_uri(b"plain text", "image/png"), config, "not an image")


def test_local_paths(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(sample_image()))
    (allowed / "link.png").symlink_to(outside)
    (allowed / "sub").mkdir()
    config = MediaConfig(allowed_local_media_paths=(str(allowed),))
    refused(str(outside), MediaConfig(), "disabled")
    refused(str(outside), config, "outside the allowed")
    refused(outside.as_uri(), config, "outside the allowed")
    refused(str(allowed / "link.png"), config, "outside the allowed")  # symlinks are resolved
    refused(str(allowed / ".." / "outside.png"), config, "outside the allowed")
    refused(str(allowed / "missing.png"), config, "does not exist")
    refused(str(allowed / "sub"), config, "cannot read")
    refused("file://otherhost/etc/passwd", config, "remote host")
    (allowed / "ok.png").write_bytes(png_bytes(sample_image()))
    assert load_image(f"file://localhost{allowed / 'ok.png'}", config).size == (48, 32)
    small = MediaConfig(allowed_local_media_paths=(str(allowed),), max_media_bytes=100)
    refused(str(allowed / "ok.png"), small, "too large")


def test_decompression_bomb_checked_from_header():
    # 8000x8000 = 64 MP: under Pillow's own guard, over ours; the truncated data is never decoded.
    header_only = png_claiming(8000, 8000, zlib.compress(b"\0" * 1001))
    refused(data_uri(header_only), MediaConfig(), "too many pixels", "8000x8000")
    small_limit = MediaConfig(max_image_pixels=1000)
    refused(data_uri(png_bytes(sample_image())), small_limit, "too many pixels", "48x32")


def test_decompression_bomb_20000_square():
    # A real 20000x20000 one-colour PNG is a few kB on disk and 400 MP decoded.
    comp = zlib.compressobj(9)
    row = b"\0" * (1 + 20000 // 8)
    idat = b"".join(comp.compress(row) for _ in range(20000)) + comp.flush()
    bomb = png_claiming(20000, 20000, idat)
    assert len(bomb) < 200_000
    refused(data_uri(bomb), MediaConfig(), "too many pixels")


def test_truncated_image_is_undecodable():
    data = png_bytes(sample_image())
    refused(data_uri(data[: len(data) // 2]), MediaConfig(), "cannot decode")


def test_nul_bytes_and_fifos_in_allowed_folders_are_refused_without_hanging(tmp_path):
    config = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    refused(str(tmp_path / "a\x00b.png"), config, "NUL")
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # no writer: a blocking open would never return
    refused(str(fifo), config, "not a regular file")


def test_compressed_bodies_are_refused(media_server, routes):
    body = zlib.compress(png_bytes(sample_image()))
    routes["/deflated.png"] = (200, {"Content-Type": "image/png", "Content-Encoding": "deflate"}, body)
    refused(f"{media_server}/deflated.png", LOCAL, "compressed")


def test_serve_flags_reach_the_media_config(tmp_path):
    from mlxhost.server.cli import make_parser
    from mlxhost.server.serve_command import _engine_config, _media_config

    args = make_parser().parse_args([
        "serve", "--allowed-local-media-path", str(tmp_path), "--allowed-local-media-path", "/srv/media",
        "--allow-private-media-urls", "--media-fetch-timeout", "3", "--max-image-pixels", "1000",
        "--video-max-frames-cap", "64", "--max-media-per-request", "4", "--vision-cache-memory", "64MB",
    ])
    media = _media_config(args)
    assert media.allowed_local_media_paths == (str(tmp_path), "/srv/media")
    assert media.allow_private_media_urls and media.fetch_timeout_s == 3 and media.max_image_pixels == 1000
    assert media.video_max_frames_cap == 64 and media.max_media_per_request == 4
    assert _engine_config(args).vision_cache_bytes == 64 * 10**6
