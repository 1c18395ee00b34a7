"""Engine output plumbing shared by the generation routes: merge, SSE framing, disconnects.

Between `AsyncEngine.generate` and the route bodies. `MergedOutputs` runs one engine request per
prompt and interleaves their RequestOutputs; closing it closes every engine iterator, which aborts
the engine requests and frees their KV blocks. Client disconnects reach that close in both modes:
`SSEResponse` watches the socket while streaming, `run_until_disconnect` while a non-streaming
request is being generated.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from paphos.core.protocol import LoRARequest
from paphos.engine.async_engine import RequestTimeoutError
from paphos.outputs import RequestOutput
from paphos.sampling_params import ParamError, SamplingParams
from paphos.server.errors import APIError, api_error_body, error_body
from paphos.server.state import EngineClient

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One event: exactly `data: <compact JSON>\\n\\n` (§3.5)."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_event(exc: BaseException) -> str:
    """The §2.3 error object as one SSE event, for failures after the stream started."""
    if isinstance(exc, APIError):
        return sse(api_error_body(exc))
    if isinstance(exc, ParamError):
        return sse(error_body(400, str(exc), exc.param))
    if isinstance(exc, RequestTimeoutError):
        return sse(error_body(504, str(exc)))
    return sse(error_body(500, f"{type(exc).__name__}: {exc}"))


class EngineRequestError(APIError):
    """A failure the engine confined to one request (`RequestOutput.error`): a 500 for that request."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message)


_END = object()


class MergedOutputs:
    """Interleaves the outputs of one engine request per prompt: yields (prompt_index, output).

    Every prompt runs with `lora` (None: the base model), the adapter the request's `model` named.
    """

    def __init__(
        self, engine: EngineClient, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
        lora: LoRARequest | None = None,
    ) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._open = len(prompts)
        self._tasks = [
            asyncio.create_task(self._pump(i, engine, f"{request_id}-{i}", ids, p, lora))
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]

    async def _pump(
        self, index: int, engine: EngineClient, request_id: str, prompt: list[int], params: SamplingParams,
        lora: LoRARequest | None,
    ) -> None:
        generator = None
        try:
            generator = engine.generate(request_id, prompt, params, lora=lora)
            async for output in generator:
                self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            self._queue.put_nowait((index, exc))
        finally:
            # Closing the engine's iterator is what aborts the request (cancellation reaches it the
            # same way); an exhausted one ignores this.
            aclose = getattr(generator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - closing must not mask the real outcome
                    pass
            self._queue.put_nowait((index, _END))

    def __aiter__(self) -> MergedOutputs:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                if self._engine.errored:
                    # The step loop died: that is the server being unavailable, not this request.
                    raise APIError(503, f"The engine is not running: {self._engine.error}") from item
                raise item
            if item.error:
                raise EngineRequestError(item.error)
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Shielded: this runs from cancelled scopes too, and the aborts must still happen.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body has been read already, so the next message is the disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
    """Runs `work` until it finishes or the client goes away (then cancels it)."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class SSEResponse(StreamingResponse):
    """text/event-stream that stops (and closes its generator) as soon as the client disconnects.

    Starlette only notices a disconnect when a write fails (ASGI >= 2.4), which never happens
    while the engine is still computing; this watches `receive` for the whole stream instead.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._iterator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self._iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
