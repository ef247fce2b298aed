"""`/docs` without the internet: Swagger UI's script, stylesheet and icon come from the
`swagger-ui-bundle` package and are served under /docs/static, where FastAPI's default page would
fetch them from a CDN (a blank page on an offline laptop or an air-gapped server). ReDoc stays off:
it has no packaged copy."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, Response

STATIC_PREFIX = "/docs/static"
# Only what the page loads: the rest of the package (source maps, its own index page) stays unserved.
_FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "favicon-32x32.png": "image/png"}


def swagger_ui_dir() -> Path | None:
    try:
        import swagger_ui_bundle
    except ImportError:
        return None
    return Path(swagger_ui_bundle.swagger_ui_path)


def install_docs(app: FastAPI) -> None:
    """GET /docs and its assets; with swagger-ui-bundle missing, /docs is a page that says so."""
    folder = swagger_ui_dir()

    @app.get("/docs", include_in_schema=False)
    async def docs():
        if folder is None:
            return Response("Swagger UI is not installed: pip install swagger-ui-bundle. The API's schema is at"
                            " /openapi.json.", status_code=404, media_type="text/plain")
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - API",
                                   swagger_js_url=f"{STATIC_PREFIX}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{STATIC_PREFIX}/swagger-ui.css",
                                   swagger_favicon_url=f"{STATIC_PREFIX}/favicon-32x32.png")

    @app.get(STATIC_PREFIX + "/{name}", include_in_schema=False)
    async def docs_asset(name: str):
        if folder is None or name not in _FILES:
            return Response(status_code=404)
        # A week: the files change only with the package's version.
        return FileResponse(folder / name, media_type=_FILES[name], headers={"Cache-Control": "max-age=604800"})
