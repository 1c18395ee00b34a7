"""API keys and the admin key (contract §2.1): the first thing a request meets after CORS.

An ASGI middleware in front of every route. It sorts the path into public (health, metrics,
version, docs, Kobold discovery), admin (adapter/model management) or protected (everything else,
`/v1/*` and `/api/*` included) and checks the credential, sent as `Authorization: Bearer KEY` or
`X-API-Key: KEY`. User auth is on when at least one API key is configured; admin routes need the
admin key and are closed (403) when none is configured. Keys are compared in constant time and never
logged. CORS sits outside this middleware, so preflights (`OPTIONS`) never need a key and 401s carry
CORS headers.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import Enum

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from paphos.server.errors import error_response, route_path

PUBLIC_PATHS = frozenset({
    "/health", "/ping", "/version", "/metrics", "/.well-known/serviceinfo", "/", "/docs", "/redoc",
    "/openapi.json", "/docs/oauth2-redirect",
    "/api/v1/info/version", "/api/latest/info/version", "/api/extra/version",
})
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
    return Access.USER


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
        # Only digests are kept: the keys themselves never reach a log or a traceback from here.
        self._user = tuple(_digest(k) for k in api_keys)
        self._admin = None if admin_key is None else _digest(admin_key)

    def _allowed(self, access: Access, given: str | None) -> JSONResponse | None:
        """None when the request may pass, else the response refusing it."""
        if access is Access.PUBLIC:
            return None
        admin = self._admin is not None and given is not None and _matches(given, (self._admin,))
        if access is Access.ADMIN:
            if self._admin is None:
                return error_response(
                    403, "Admin routes are disabled: start the server with --admin-key to enable them."
                )
            return None if admin else unauthorized()
        if not self._user or admin or (given is not None and _matches(given, self._user)):
            return None
        return unauthorized()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = classify(scope["method"], route_path(scope))
        refusal = self._allowed(access, credential(scope.get("headers", [])))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)
