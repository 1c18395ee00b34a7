"""AsyncEngine: the server's view of the engine.

The HTTP layer calls `generate()` from the event loop (uvicorn's thread); `run_step_loop()` runs
`LLMEngine.step()` in the process's main thread and hands each RequestOutput to the asyncio queue of its request. Only plain records
cross the boundary (request id, token ids, SamplingParams in; RequestOutput out; abort by id), so
the loop can move to its own process later without changing callers. Closing a `generate()`
iterator early (client gone) aborts the request, which frees its KV blocks in the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from paphos.config import EngineConfig, ModelConfig
from paphos.engine.llm_engine import LLMEngine
from paphos.outputs import RequestOutput
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


STAT_NAMES = (
    "num_running", "num_waiting", "kv_usage", "num_used_blocks", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits",
)


class EngineDeadError(RuntimeError):
    """The step loop died; every pending and future request fails with this."""


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """The owner runs `run_step_loop()` in a thread of its choice (the CLI: the main thread)."""
        self.config = config
        self._loaded = threading.Event()
        self.is_ready = False
        self.errored = False
        self.error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stopping = threading.Event()

    async def start(self) -> None:
        """Loads the model off the event loop (the HTTP server answers /health meanwhile)."""
        self._loop = asyncio.get_running_loop()
        try:
            self._engine = await asyncio.to_thread(LLMEngine, self.config)
        except Exception as exc:
            logger.exception("loading the model failed")
            self._fail(exc)
            return
        self._loaded.set()
        self.is_ready = True

    def run_step_loop(self) -> None:
        """Runs the step loop in the calling thread until shutdown() or an engine failure.

        The CLI gives it the process's main thread: torch's OpenMP kernels driven from another
        thread ran up to 1.5-2x slower per decode step on a 2-core machine.
        """
        while not self._loaded.wait(0.2):
            if self._stopping.is_set() or self.errored:
                return
        self._run()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("the model is not loaded yet")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config.model

    def stats(self) -> dict[str, float]:
        if self._engine is None:
            return dict.fromkeys(STAT_NAMES, 0)
        scheduler = self._engine.scheduler
        return {
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "kv_usage": scheduler.kv_usage,
            "num_used_blocks": scheduler.num_used_blocks,
            "num_preemptions": scheduler.num_preemptions_total,
            "prefix_cache_queries": scheduler.prefix_cache_queries,
            "prefix_cache_hits": scheduler.prefix_cache_hits,
        }

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Validates at once (raising ParamError), then streams the request's outputs."""
        if self.errored:
            raise EngineDeadError(f"the engine has stopped: {self.error}")
        self.engine.validate_request(prompt_token_ids, params)
        return self._stream(request_id, prompt_token_ids, params)

    async def _stream(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._inbox.put(("add", (request_id, prompt_token_ids, params)))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def shutdown(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._drain_inbox(engine, block=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        self._deliver(output.request_id, output)
        except Exception as exc:
            logger.exception("the engine step loop died")
            self._fail(exc)

    def _drain_inbox(self, engine: LLMEngine, block: bool) -> None:
        while True:
            try:
                # A bounded wait keeps the loop responsive to shutdown and to signals.
                kind, payload = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                request_id, prompt_token_ids, params = payload
                try:
                    engine.add_request(request_id, prompt_token_ids, params)
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    self._deliver(request_id, exc)
            elif kind == "abort":
                engine.abort_request([payload])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put, request_id, item)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _fail(self, exc: BaseException) -> None:
        self.errored = True
        self.error = exc
        self.is_ready = False
        dead = EngineDeadError(f"the engine has stopped: {exc}")
        if self._loop is not None:
            for request_id in list(self._streams):
                self._deliver(request_id, dead)
