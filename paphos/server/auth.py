"""API keys and the admin key (contract §2.1): the first thing a request meets after CORS.

An ASGI middleware in front of every route. It sorts the path into public (health, metrics,
version, docs, Kobold discovery), admin (adapter/model management) or protected (everything else,
`/v1/*` and `/api/*` included) and checks the credential, sent as `Authorization: Bearer KEY` or
`X-API-Key: KEY`. User auth is on when at least one API key is configured; admin routes need the
admin key and are closed (403) when none is configured. Keys are compared in constant time and never
logged. CORS sits outside this middleware, so preflights (`OPTIONS`) never need a key and 401s carry
CORS headers.

Kobold status routes are public too, as KoboldCpp keeps them under `--password`: SillyTavern's
Kobold-classic type sends no key when it asks for the model name, the context size, a token count or
a bodiless abort. They reveal only what `/v1/models` would (the model and its limits) or cost a
tokenization. Keyless POSTs to them get a small body limit, and the middleware records in the
request's state whether the caller proved a key, so that abort can refuse strangers (kobold/extra.py).
"""

from __future__ import annotations

import hashlib
import hmac
from enum import Enum

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from paphos.server.errors import BodySizeLimitMiddleware, error_response, route_path

PUBLIC_PATHS = frozenset({
    "/health", "/ping", "/version", "/metrics", "/.well-known/serviceinfo", "/", "/docs", "/redoc",
    "/openapi.json", "/docs/oauth2-redirect",
    "/api/v1/info/version", "/api/latest/info/version", "/api/extra/version",
    # Kobold status: the model name and its limits (what SillyTavern polls without a key).
    "/api/v1/model", "/api/latest/model", "/api/v1/config/max_length", "/api/latest/config/max_length",
    "/api/v1/config/max_context_length", "/api/latest/config/max_context_length",
    "/api/extra/true_max_context_length",
})
# Kobold POST routes open without a key: token counts (tokenize returns the same ids as tokencount)
# and abort, which without a key stops only a generation the caller can name (kobold/extra.py).
PUBLIC_POST_PATHS = frozenset({"/api/extra/tokencount", "/api/extra/tokenize", "/api/extra/abort"})
# Keyless bodies on those routes: a token count of a 128K-token context is about 0.5 MB of text, and
# a stranger should not make the server buffer and tokenize more than that per request.
PUBLIC_MAX_BODY_BYTES = 1024 * 1024
# Key of the request state (scope["state"]) saying whether the caller sent a valid key (or auth is off).
AUTHENTICATED = "paphos_authenticated"
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
ADMIN_PREFIXES = ("/v1/lora/", "/v1/model/", "/v1/soft_prompt/")


class Access(Enum):
    PUBLIC = "public"
    USER = "user"
    ADMIN = "admin"


def classify(method: str, path: str) -> Access:
    """Which credential a route needs (contract §2.1)."""
    if method == "OPTIONS":
        return Access.PUBLIC
    path = path.rstrip("/") or "/"
    if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES):
        return Access.ADMIN
    if method in ("GET", "HEAD") and path in PUBLIC_PATHS:
        return Access.PUBLIC
    if method == "POST" and path in PUBLIC_POST_PATHS:
        return Access.PUBLIC
    return Access.USER


def is_authenticated(scope: Scope) -> bool:
    """Whether AuthMiddleware saw a valid key (or auth is off); False when it did not run."""
    return bool(scope.get("state", {}).get(AUTHENTICATED, False))


def credential(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key of `Authorization: Bearer KEY` (scheme case-insensitive) or of `X-API-Key: KEY`."""
    api_key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key":
            api_key = value.decode("latin-1").strip() or None
    return api_key


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison time independent of the keys' lengths.
    return hashlib.sha256(key.encode()).digest()


def _matches(given: str, digests: tuple[bytes, ...]) -> bool:
    # Every key is compared (no early exit), each in constant time.
    given_digest = _digest(given)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(given_digest, digest)
    return found


def unauthorized() -> JSONResponse:
    """The exact 401 body Aphrodite sends (contract §2.1), not the §2.3 superset."""
    return JSONResponse({"error": "Unauthorized"}, status_code=401)


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], admin_key: str | None) -> None:
        self.app = app
        self._public_app = BodySizeLimitMiddleware(app, PUBLIC_MAX_BODY_BYTES)
        # Only digests are kept: the keys themselves never reach a log or a traceback from here.
        self._user = tuple(_digest(k) for k in api_keys)
        self._admin = None if admin_key is None else _digest(admin_key)

    def _is_admin(self, given: str | None) -> bool:
        return self._admin is not None and given is not None and _matches(given, (self._admin,))

    def _is_user(self, given: str | None) -> bool:
        """A user-level caller: auth is off, or the key is a user key or the admin key."""
        return not self._user or self._is_admin(given) or (given is not None and _matches(given, self._user))

    def _allowed(self, access: Access, given: str | None) -> JSONResponse | None:
        """None when the request may pass, else the response refusing it."""
        if access is Access.PUBLIC:
            return None
        if access is Access.ADMIN:
            if self._admin is None:
                return error_response(
                    403, "Admin routes are disabled: start the server with --admin-key to enable them."
                )
            return None if self._is_admin(given) else unauthorized()
        return None if self._is_user(given) else unauthorized()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = classify(scope["method"], route_path(scope))
        given = credential(scope.get("headers", []))
        refusal = self._allowed(access, given)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        authenticated = self._is_user(given)
        # A new dict: the server's per-request state may be shared with the lifespan state.
        scope["state"] = {**scope.get("state", {}), AUTHENTICATED: authenticated}
        if access is Access.PUBLIC and not authenticated and scope["method"] == "POST":
            await self._public_app(scope, receive, send)
            return
        await self.app(scope, receive, send)
