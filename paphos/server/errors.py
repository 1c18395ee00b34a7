"""Error responses in the contract's superset shape (docs/api.md §2.3), used by every route.

Anything that goes wrong between the socket and the engine ends here: our own `APIError`,
`ParamError` from SamplingParams validation, pydantic validation errors (rewritten from 422 to 400
with a readable list of failing fields), unknown routes, oversized bodies and crashes. Clients of
both Aphrodite lines read this shape: the flat keys (0.6) and the nested `error` object (0.2x).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paphos.engine.async_engine import EngineOverloadedError, RequestTimeoutError
from paphos.sampling_params import ParamError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}

# Raw request bodies above this are refused before parsing: a 10 MB prompt is legitimate input
# (rejected later, by token count), but there is no reason to buffer arbitrarily large bodies.
MAX_BODY_BYTES = 32 * 1024 * 1024


class APIError(Exception):
    """An error to return to the client as-is: status, message, offending field."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type_: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        # Route-specific keys added to the body (Kobold tokencount's `"value": -1`).
        self.extra = extra or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    type_ = type_ or ERROR_TYPES.get(status, "InternalServerError")
    inner = {"message": message, "type": type_, "param": param, "code": status}
    return {"object": "error", **inner, "error": dict(inner)}


def api_error_body(exc: APIError) -> dict[str, Any]:
    return {**error_body(exc.status, exc.message, exc.param, exc.type), **exc.extra}


def route_path(scope: Scope) -> str:
    """The path the routes see: without the --root-path prefix when the proxy left it in."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def _with_detail(scope: Scope, body: dict[str, Any]) -> dict[str, Any]:
    """Kobold routes add `detail` (SillyTavern and Kobold Lite show `detail.msg`, contract §5)."""
    path = route_path(scope)
    if path == "/api" or path.startswith("/api/"):
        return {**body, "detail": {"msg": body["message"], "type": body["type"]}}
    return body


def _respond(request: Request, body: dict[str, Any], status: int) -> JSONResponse:
    return JSONResponse(_with_detail(request.scope, body), status_code=status)


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type_), status_code=status)


# Location parts pydantic appends for union members and validators (not field names).
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "function-plain"}


def _field_name(loc: tuple[Any, ...]) -> str:
    # FastAPI prefixes where the value came from; clients know the field by its name alone.
    parts = [str(p) for p in loc if p not in ("body", "query")]
    return ".".join(parts)


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """422-style error lists -> one 400 body whose message names every failing field."""
    if errors and errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
        return error_body(400, f"Malformed JSON body: {detail}")
    items = []
    for err in errors:
        # Union types report one error per member, with the member type appended to the
        # location; the field name is what the user needs.
        loc = tuple(p for p in err.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        items.append((_field_name(loc), msg))
    seen: dict[str, str] = {}
    for field, msg in items:
        seen.setdefault(field, msg)
    fields = [f for f in seen if f] or [""]
    message = "; ".join(f"{f}: {m}" if f else m for f, m in seen.items())
    count = len(seen)
    prefix = f"{count} invalid field{'s' if count != 1 else ''}: " if count else ""
    return error_body(400, f"{prefix}{message}", fields[0] or None)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _respond(request, api_error_body(exc), exc.status)


async def _param_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ParamError)
    return _respond(request, error_body(400, str(exc), exc.param), 400)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return _respond(request, validation_error_body(list(exc.errors())), 400)


# What a refused client is told to wait: about the time a queue that is draining takes to move.
OVERLOADED_RETRY_AFTER_S = 1


async def _overloaded_handler(request: Request, exc: Exception) -> JSONResponse:
    response = _respond(request, error_body(429, str(exc)), 429)
    response.headers["Retry-After"] = str(OVERLOADED_RETRY_AFTER_S)
    return response


async def _timeout_handler(request: Request, exc: Exception) -> JSONResponse:
    return _respond(request, error_body(504, str(exc)), 504)


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"The route {request.method} {request.url.path} does not exist."
    else:
        message = str(exc.detail)
    response = _respond(request, error_body(exc.status_code, message), exc.status_code)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request", exc_info=exc)
    return _respond(request, error_body(500, f"Internal server error: {type(exc).__name__}: {exc}"), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(ParamError, _param_error_handler)
    app.add_exception_handler(EngineOverloadedError, _overloaded_handler)
    app.add_exception_handler(RequestTimeoutError, _timeout_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unhandled_handler)


class _BodyTooLarge(APIError):
    """Raised from `receive`: the route's error handlers answer 413 if the body is being read there."""

    def __init__(self, max_bytes: int) -> None:
        size = f"{max_bytes // (1024 * 1024)} MB" if max_bytes >= 1024 * 1024 else f"{max_bytes} bytes"
        super().__init__(413, f"Request body larger than {size}.")
        self.max_bytes = max_bytes


class BodySizeLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413, by Content-Length or while streaming them in."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._send_413(scope, send)
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge as exc:
            # Limits nest (a smaller one for keyless public routes, auth.py): report the one hit.
            if not started:
                await self._send_413(scope, send, exc.max_bytes)

    async def _send_413(self, scope: Scope, send: Send, max_bytes: int | None = None) -> None:
        exc = _BodyTooLarge(self.max_bytes if max_bytes is None else max_bytes)
        response = JSONResponse(_with_detail(scope, api_error_body(exc)), status_code=413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
