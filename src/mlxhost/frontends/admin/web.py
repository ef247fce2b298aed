"""The web page at `/`: static files shipped in the package (mlxhost/web/), no build step, no CDN.

The page is a client of the public API like any other: everything it shows comes from /v1/... and
/metrics, sent with the key the user types (kept in the browser's localStorage). The files themselves
hold no data, so common/security.py lets them through without a key (the page must load to ask for one).
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_PREFIX = "/static"
# No inline script or style and nothing from elsewhere; images may be data: URIs (attached pictures).
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def web_dir():
    return files("mlxhost") / "web"


def add_web_routes(app: FastAPI, enabled: bool = True) -> None:
    """`/` (index.html) and `/static/...` (its script and style); nothing when `enabled` is False."""
    if not enabled:
        return
    root = web_dir()
    index = root / "index.html"

    @app.get("/", include_in_schema=False)
    async def web_page():
        return FileResponse(str(index), media_type="text/html", headers=_HEADERS)

    app.mount(STATIC_PREFIX, StaticFiles(directory=str(root)), name="web-static")
