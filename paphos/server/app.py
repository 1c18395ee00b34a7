"""build_app: the FastAPI application around one AsyncEngine (design.md §9).

The app is up before the model: the lifespan starts `engine.start()` as a background task, so
`GET /health` answers 503 while the weights load and 200 once the engine is ready; every route
that needs the model answers 503 until then (`ServerState.ready_engine`). Shutdown stops the
engine. Routes live in `paphos.server.openai.*`; the error shape in `paphos.server.errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from paphos.config import ServerConfig
from paphos.server import metrics
from paphos.server.errors import BodySizeLimitMiddleware, error_response, install_error_handlers
from paphos.server.metrics import build_registry
from paphos.server.openai import chat, completions, models, tokenize
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
        task = asyncio.create_task(_start_engine(state, on_engine_failure))
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            try:
                await engine.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("error while shutting the engine down")

    app = FastAPI(title="Paphos", version=__version__, lifespan=lifespan)
    app.state.paphos = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware)
    # Contract §2.2 defaults: any origin, method and header (no credentials).
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    for module in (completions, chat, models, tokenize):
        app.include_router(module.router)
    app.state.metrics_registry = build_registry(engine.stats, state.model_name)
    app.include_router(metrics.router)

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

    return app
