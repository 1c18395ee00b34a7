"""build_app: the FastAPI application around one AsyncEngine (design.md §9).

The app is up before the model: the lifespan starts `engine.start()` as a background task, so
`GET /health` answers 503 while the weights load and 200 once the engine is ready; every route
that needs the model answers 503 until then (`ServerState.ready_engine`). Shutdown stops the
engine. A request passes CORS, then auth (`auth.py`), then the body-size limit, then its route:
OpenAI routes in `paphos.server.openai.*`, Kobold routes in `paphos.server.kobold`, /metrics in
`metrics.py`; the error shape is in `paphos.server.errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from paphos.config import ServerConfig
from paphos.server import kobold, metrics, web
from paphos.server.auth import AuthMiddleware
from paphos.server.errors import BodySizeLimitMiddleware, error_response, install_error_handlers
from paphos.server.kobold.jobs import KoboldJobs
from paphos.server.metrics import build_registry, log_stats_forever
from paphos.server.openai import chat, completions, lora, models, tokenize
from paphos.server.openapi import install_openapi
from paphos.server.state import EngineClient, ServerState, get_state
from paphos.version import __version__

logger = logging.getLogger("paphos.server")


async def _start_engine(state: ServerState, on_failure: Callable[[BaseException], None] | None) -> None:
    try:
        await state.engine.start()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported through /health and the callback
        state.start_error = exc
        logger.exception("the engine failed to start")
    else:
        # An engine may also report a failed load by flagging itself instead of raising.
        if state.engine.errored:
            state.start_error = state.engine.error or RuntimeError("the engine failed to start")
    if state.start_error is not None and on_failure is not None:
        on_failure(state.start_error)


def build_app(
    engine: EngineClient,
    server_config: ServerConfig,
    served_model_names: Sequence[str],
    *,
    on_engine_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The HTTP app serving `engine` under `served_model_names` (the first is echoed in responses).

    `on_engine_failure` is called if `engine.start()` raises (the CLI uses it to exit non-zero).
    """
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    state = ServerState(engine, server_config, tuple(served_model_names))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_start_engine(state, on_engine_failure))]
        if not server_config.disable_log_stats:
            tasks.append(asyncio.create_task(log_stats_forever(engine, server_config.stats_interval_s)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await engine.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("error while shutting the engine down")

    docs: dict[str, Any] = {}
    if server_config.disable_fastapi_docs:
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Paphos", version=__version__, lifespan=lifespan, **docs)
    app.state.paphos = state
    app.state.kobold_jobs = KoboldJobs()
    install_error_handlers(app)
    # The last added middleware runs first: CORS (so preflights and 401s carry CORS headers), auth,
    # then the body-size limit.
    app.add_middleware(BodySizeLimitMiddleware)
    app.add_middleware(AuthMiddleware, api_keys=server_config.api_keys, admin_key=server_config.admin_key)
    app.add_middleware(
        CORSMiddleware, allow_origins=list(server_config.allowed_origins),
        allow_methods=list(server_config.allowed_methods), allow_headers=list(server_config.allowed_headers),
        allow_credentials=server_config.allow_credentials,
    )

    for module in (completions, chat, models, tokenize, lora, kobold, metrics):
        app.include_router(module.router)
    if not server_config.disable_web_ui:
        app.include_router(web.router)
    app.state.metrics_registry = build_registry(engine, state.model_name)
    install_openapi(app)

    @app.get("/health")
    @app.get("/ping")
    async def health(request: Request) -> Response:
        current = get_state(request)
        if current.engine.errored or current.start_error is not None:
            return error_response(503, f"The engine is not running: {current.engine.error or current.start_error}")
        if not current.engine.is_ready:
            return error_response(503, "The model is still loading.")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/.well-known/serviceinfo")
    async def serviceinfo() -> dict[str, Any]:
        # The AI Horde / KoboldAI service discovery document (contract §3.7).
        return {
            "version": 0.2,
            "software": {"name": "Paphos", "version": __version__},
            "api": {
                "openai": {"name": "OpenAI API", "rel_url": "/v1", "documentation": "/docs", "version": 1},
                "koboldai": {
                    "name": "KoboldAI API", "rel_url": "/api", "documentation": "https://lite.koboldai.net/koboldcpp_api",
                    "version": kobold.info.KOBOLD_API_VERSION,
                },
            },
        }

    return app
