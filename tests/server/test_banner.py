"""The start-up banner names every front door and the web page, and each path it names is a route of the app."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from mlxhost.frontends.admin.web import add_web_routes
from mlxhost.frontends.app import create_app
from mlxhost.server.banner import ENDPOINTS, BannerModel, format_banner
from tests.frontends.fake_models import FakeModels

URL = "http://127.0.0.1:8000"


def _banner(**kw) -> str:
    return format_banner("0", URL, [BannerModel("q", "q", "loaded")], "m", needs_key=False, **kw)


def _named_paths() -> set[str]:
    """Each path the banner names; `/api/* (chat, generate)` names /api/chat and /api/generate."""
    paths = set()
    for _, text in ENDPOINTS:
        wild = re.match(r"(/\S+)/\* \((.+)\)", text)
        if wild:
            paths |= {f"{wild[1]}/{name.strip()}" for name in wild[2].split(",")}
        else:
            paths |= {p.strip() for p in text.split(",")}
    return paths


def test_every_front_door_the_docs_and_the_web_page_are_listed():
    text = _banner()
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/*", "/docs", "/redoc", "/health",
                 "/metrics"):
        assert path in text, path
    assert f"web page   {URL}/  (chat and dashboard)" in text
    assert "web page" not in _banner(web_ui=False)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  endpoints  "))
    # One line per front door, aligned under the first.
    assert [line[:13] for line in lines[at:at + len(ENDPOINTS)]] == ["  endpoints  "] + ["             "] * (
        len(ENDPOINTS) - 1)
    assert max(len(line) for line in lines[:at + len(ENDPOINTS)]) <= 110


def test_every_named_path_is_a_route():
    app = create_app(FakeModels())
    add_web_routes(app)
    client = TestClient(app, raise_server_exceptions=False)  # the fake models lack what /v1/status reads
    assert {"/api/chat", "/api/tags", "/redoc", "/v1/messages"} <= _named_paths()
    for path in sorted(_named_paths()) + ["/"]:
        assert client.get(path).status_code != 404, path  # a POST route answers GET with 405
    assert client.get("/no-such-path").status_code == 404


def test_a_cpu_user_without_openblas_is_told_how_to_get_it():
    from mlxhost.platform.blas import INSTALL_HINT, BlasChoice
    from mlxhost.server.banner import blas_hint

    slow = BlasChoice(None, "no OpenBLAS on this machine")
    assert INSTALL_HINT in _banner(speed_hint=blas_hint(slow))
    for fine in (None, BlasChoice("/lib/libopenblas.so.0", "system OpenBLAS"), BlasChoice(None, "not Linux")):
        assert blas_hint(fine) is None
    assert "speed" not in _banner()
