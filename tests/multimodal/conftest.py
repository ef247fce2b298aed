"""A local HTTP server with good and bad media, and small media files built in memory."""

from __future__ import annotations

import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

SLOW_BYTES = 200


def png_bytes(img: Image.Image, **save_args) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **save_args)
    return buf.getvalue()


def jpeg_bytes(img: Image.Image, **save_args) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **save_args)
    return buf.getvalue()


def sample_image(width: int = 48, height: int = 32) -> Image.Image:
    """Asymmetric content, so rotations and flips change the pixels."""
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 5 % 256, y * 7 % 256, (x * y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(arr)


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow":
            return self._drip()
        if self.path == "/no-length":
            # HTTP/1.0 body without Content-Length: only counting while streaming can stop it.
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\x89PNG" + b"\0" * 5000)
            return
        status, headers, body = self.routes.get(self.path, (404, {"Content-Type": "text/plain"}, b"not found"))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drip(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(SLOW_BYTES))
        self.end_headers()
        try:
            for _ in range(SLOW_BYTES):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the client gave up, as it should
            pass


@pytest.fixture(scope="session")
def media_server():
    """Base URL of a 127.0.0.1 server; register bodies with `routes[path] = (status, headers, body)`."""
    img = sample_image()
    _Handler.routes = {
        "/img.png": (200, {"Content-Type": "image/png"}, png_bytes(img)),
        "/img.jpg": (200, {"Content-Type": "image/jpeg"}, jpeg_bytes(img)),
        "/text.txt": (200, {"Content-Type": "text/plain"}, b"hello, this is not an image\n" * 4),
        "/garbage.png": (200, {"Content-Type": "image/png"}, os.urandom(4096)),
        "/big.png": (200, {"Content-Type": "image/png"}, b"\0" * 5000),
        "/redirect": (302, {"Location": "/img.png"}, b""),
        "/redirect-loop": (302, {"Location": "/redirect-loop"}, b""),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def routes():
    return _Handler.routes
