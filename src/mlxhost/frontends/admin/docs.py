"""`/docs` and `/redoc` without the internet: Swagger UI's and ReDoc's files come from the `fastapi-offline`
package and are served under /docs/static, where FastAPI's default pages would fetch them from a CDN (a
blank page on an offline laptop or an air-gapped server). Its Swagger UI is 5.x, which reads the OpenAPI
3.1 schema FastAPI writes (the 4.x of `swagger-ui-bundle` drew only "Unable to render this definition")."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, Response

STATIC_PREFIX = "/docs/static"
# Only what the pages load: the rest of the package stays unserved.
_FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png",
          "redoc.standalone.js": "text/javascript"}
_MISSING = "API docs need fastapi-offline: pip install fastapi-offline. The API's schema is at /openapi.json."


def docs_assets_dir() -> Path | None:
    try:
        folder = Path(str(files("fastapi_offline") / "static"))
    except ImportError:
        return None
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def install_docs(app: FastAPI) -> None:
    """GET /docs, /redoc and their assets; with the assets missing, each page says what to install."""
    folder = docs_assets_dir()

    @app.get("/docs", include_in_schema=False)
    async def docs():
        if folder is None:
            return Response(_MISSING, status_code=404, media_type="text/plain")
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - API",
                                   swagger_js_url=f"{STATIC_PREFIX}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{STATIC_PREFIX}/swagger-ui.css",
                                   swagger_favicon_url=f"{STATIC_PREFIX}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc():
        if folder is None:
            return Response(_MISSING, status_code=404, media_type="text/plain")
        # No Google Fonts: the page would ask fonts.googleapis.com for them.
        return get_redoc_html(openapi_url=app.openapi_url, title=f"{app.title} - API",
                              redoc_js_url=f"{STATIC_PREFIX}/redoc.standalone.js",
                              redoc_favicon_url=f"{STATIC_PREFIX}/favicon.png", with_google_fonts=False)

    @app.get(STATIC_PREFIX + "/{name}", include_in_schema=False)
    async def docs_asset(name: str):
        if folder is None or name not in _FILES:
            return Response(status_code=404)
        # A week: the files change only with the package's version.
        return FileResponse(folder / name, media_type=_FILES[name], headers={"Cache-Control": "max-age=604800"})
