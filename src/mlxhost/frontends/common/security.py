"""A shared server's front gate: API keys, CORS and a request-body limit, as plain ASGI middlewares.

Plain ASGI on purpose (not `@app.middleware("http")`, see metrics.py's `CountRequests`): they must answer
before FastAPI reads a body, and leave `receive` intact so disconnects still reach the handlers.
Refusals come in the shape a dialect registered for the path (errors.py: `register_error_shape`), else OpenAI's.
"""

from __future__ import annotations

import ipaddress
import json
import logging

from starlette.middleware.cors import CORSMiddleware

from mlxhost.config import SecurityConfig
from mlxhost.frontends.common.errors import ErrorShapes, error_shapes
from mlxhost.frontends.common.keys import KeyRing, current_grant

log = logging.getLogger(__name__)

# Paths answered without a key: load balancers and orchestrators probe /health unauthenticated.
_OPEN_PATHS = frozenset({"/health"})
# The web page's files (admin/web.py) hold no data and must load to ask for the key its API calls send.
_WEB_PAGE_PATHS, _WEB_STATIC_PREFIX = frozenset({"/"}), "/static/"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def _is_web_page(scope) -> bool:
    path = scope["path"]
    return scope["method"] in ("GET", "HEAD") and (path in _WEB_PAGE_PATHS or path.startswith(_WEB_STATIC_PREFIX))


async def send_json(send, status: int, body: dict, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` or `x-api-key: KEY` carries one of `keys` (or of `ring`'s, the
    keys with policies, keys.py); 429 when the key's limits refuse the request. The matched key's policy is
    `request.state.api_key` for the handlers, and its grant `keys.current_grant` for the gateway."""

    def __init__(self, app, keys: tuple[str, ...] = (), metrics_public: bool = False, web_page: bool = False,
                 shapes: ErrorShapes | None = None, ring: KeyRing | None = None, metrics=None) -> None:
        self.app, self._web_page = app, web_page
        self.shapes = shapes or ErrorShapes()
        self.ring = ring if ring is not None else KeyRing(plain_keys=keys)
        self.metrics = metrics  # common/metrics.py `Metrics`: counts by key name; None: not counted
        self._open = _OPEN_PATHS | ({"/metrics"} if metrics_public else set())

    def is_authorized(self, headers: list[tuple[bytes, bytes]]) -> bool | None:
        """True/False for a right/wrong key; None when the request carries none."""
        verdict = self._match(headers)
        return verdict if verdict is None or verdict is False else True

    def _match(self, headers: list[tuple[bytes, bytes]]):
        """The matched key's policy; False for a wrong key, None when the request carries none."""
        candidates = []
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    candidates.append(token.strip())
            elif name == b"x-api-key" and value.strip():
                candidates.append(value.strip())
        if not candidates:
            return None
        self.ring.reload_if_changed()
        policy = self.ring.match(candidates)
        return policy if policy is not None else False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or (self._web_page and _is_web_page(scope)):
            return await self.app(scope, receive, send)
        verdict = self._match(scope["headers"])
        if verdict:
            return await self._serve(verdict, scope, receive, send)
        message = ("Incorrect API key provided." if verdict is False else
                   "Missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`.")
        body = self.shapes.body(scope["path"], 401, message, code="invalid_api_key", gate=True)
        await send_json(send, 401, body, ((b"www-authenticate", b"Bearer"),))

    async def _serve(self, policy, scope, receive, send) -> None:
        grant = self.ring.grant(policy)
        shape = self.shapes.find(scope["path"], gate=True)
        anthropic = shape is not None and shape.name == "anthropic"
        # A read (a batch's status, a file, the model list) never waits for a generation's slot: a key limited to
        # one at a time could not look at its batch while the batch's own lines run.
        in_flight = scope.get("method") != "GET"
        refusal = grant.usage.admit(policy, in_flight)
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.key_refusals.labels(policy.name, refusal.limit).inc()
                self.metrics.key_requests.labels(policy.name, "429").inc()
            body = self.shapes.body(scope["path"], 429, refusal.message, code="rate_limit_exceeded", gate=True)
            headers = ((b"retry-after", str(refusal.retry_after_s).encode()),
                       *grant.usage.rate_headers(policy, anthropic))
            return await send_json(send, 429, body, headers)
        scope.setdefault("state", {})["api_key"] = policy
        status = "500"

        async def send_with_limits(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
                message = {**message, "headers": [*message.get("headers", ()),
                                                  *grant.usage.rate_headers(policy, anthropic)]}
            await send(message)

        token = current_grant.set(grant)
        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            current_grant.reset(token)
            if in_flight:
                grant.usage.release()
            if self.metrics is not None:
                self.metrics.key_requests.labels(policy.name, status).inc()


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: from Content-Length before reading anything, else (chunked
    bodies, or a Content-Length that lies) as soon as the bytes received pass the limit."""

    def __init__(self, app, max_bytes: int, shapes: ErrorShapes | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.shapes = shapes or ErrorShapes()

    async def _too_large(self, scope, send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        await send_json(send, 413, self.shapes.body(scope["path"], 413, message, code="request_too_large", gate=True))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                too_large = False  # the server's HTTP parser refuses a malformed length itself
            if too_large:
                return await self._too_large(scope, send)

        received, tripped, started = 0, False, False

        async def counting_receive():
            nonlocal received, tripped
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    tripped = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if tripped:
                return  # whatever the app made of the aborted read (FastAPI: a 400) is replaced below
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if tripped and not started:
            await self._too_large(scope, send)


def _host_name(value: bytes) -> str:
    """The name part of a Host header: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def allowed_hosts_for(config: SecurityConfig, host: str) -> tuple[str, ...]:
    """`--allowed-hosts`, or by default: bound to loopback, the loopback names and the bound address (a
    web page whose DNS name was rebound onto 127.0.0.1 still sends its own name, and is refused); bound
    elsewhere, any name (the clients of a shared box reach it by names the server cannot know)."""
    if config.allowed_hosts is not None:
        return config.allowed_hosts
    if not _is_loopback(host):
        return ("*",)
    return tuple(dict.fromkeys((*_LOOPBACK_NAMES, "127.0.0.1", "::1", host.strip("[]").lower())))


class TrustedHostMiddleware:
    """421 for a Host header not in `hosts` (`*` anything, `*.example.com` its subdomains)."""

    def __init__(self, app, hosts: tuple[str, ...], shapes: ErrorShapes | None = None) -> None:
        self.app = app
        self.shapes = shapes or ErrorShapes()
        self._any = "*" in hosts
        self._exact = frozenset(h.lower() for h in hosts if not h.startswith("*."))
        self._suffixes = tuple(h[1:].lower() for h in hosts if h.startswith("*."))

    def is_allowed(self, name: str) -> bool:
        return self._any or name in self._exact or name.endswith(self._suffixes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self._any:
            return await self.app(scope, receive, send)
        value = next((v for k, v in scope["headers"] if k == b"host"), None)
        # No Host at all (HTTP/1.0 tools) is no browser: rebinding always carries the page's name.
        if value is None or self.is_allowed(_host_name(value)):
            return await self.app(scope, receive, send)
        shown = value.decode("latin-1")[:100]
        message = f"the Host header {shown!r} is not served here; see --allowed-hosts"
        await send_json(send, 421, self.shapes.body(scope["path"], 421, message, code="invalid_host", gate=True))


_JSON_TYPES = (b"application/json",)
# OpenAI's audio and file uploads are multipart forms by protocol (frontends/audio/, frontends/batch/); no other
# route takes a form.
_FORM_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/files")


class JSONContentTypeMiddleware:
    """415 for a POST whose Content-Type is not JSON (the API takes no PUT or PATCH: those stay 405s).
    Browsers send `text/plain` and form types cross-origin without a CORS preflight; insisting on JSON
    makes every such request preflighted."""

    def __init__(self, app, routes: list, shapes: ErrorShapes | None = None) -> None:
        self.app, self._routes = app, routes  # the app's router's list: routes added later count too
        self.shapes = shapes or ErrorShapes()

    def _takes_post(self, scope) -> bool:
        # Only where a POST route matches: elsewhere the router's 404 or 405 (with `Allow`) is the answer.
        from starlette.routing import Match

        return any(route.matches(scope)[0] is Match.FULL for route in self._routes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        value = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
        media = value.split(b";", 1)[0].strip().lower()
        if media in _JSON_TYPES or (media.startswith(b"application/") and media.endswith(b"+json")):
            return await self.app(scope, receive, send)
        if media == b"multipart/form-data" and scope["path"] in _FORM_PATHS:
            return await self.app(scope, receive, send)
        if not self._takes_post(scope):
            return await self.app(scope, receive, send)
        message = "the request body must be JSON: send `Content-Type: application/json`"
        await send_json(send, 415, self.shapes.body(scope["path"], 415, message, code="unsupported_media_type",
                                                    gate=True))


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve anywhere


def install_security(app, config: SecurityConfig, host: str, web_page: bool = False) -> None:
    """Adds the middlewares to a FastAPI app before it starts. Outermost first: the Host check (a
    rebound page gets nothing, not even a preflight), CORS (a preflight is answered without a key, and
    401s carry CORS headers a browser can read), then the key check (a caller without one gets a 401
    before its body is read), the JSON content type, then the body limit."""
    shapes = error_shapes(app)  # read per refusal: dialects registered later count too
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes, shapes=shapes)
    app.add_middleware(JSONContentTypeMiddleware, routes=app.router.routes, shapes=shapes)
    if config.api_keys or config.api_key_file:
        # Kept on the app: the server reloads the file on SIGHUP (serve_command.py).
        ring = app.state.key_ring = KeyRing(config.api_key_file, config.api_keys, config.cache_isolation)
        app.add_middleware(APIKeyMiddleware, ring=ring, metrics_public=config.metrics_public,
                           web_page=web_page, shapes=shapes,  # the page's own files load without a key
                           metrics=getattr(app.state, "metrics", None))  # a bare app (tests) has none
    else:
        if config.cache_isolation != "none":
            log.warning("--cache-isolation %s without API keys: every request is in one group", config.cache_isolation)
        if not _is_loopback(host):
            log.warning("listening on %s without an API key: anyone who can reach this address can use the "
                        "models; pass --api-key (or set MLXHOST_API_KEY)", host)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           # Browser SDKs send their own headers (x-stainless-*, anthropic-version).
                           allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(TrustedHostMiddleware, hosts=allowed_hosts_for(config, host), shapes=shapes)
