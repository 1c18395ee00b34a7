"""AsyncEngine: the server's view of the engine.

The HTTP layer calls `generate()` from the event loop (uvicorn's thread); `run_step_loop()` runs
`LLMEngine.step()` in the process's main thread and hands each RequestOutput to the asyncio queue of its request. Only plain records
cross the boundary (request id, token ids, SamplingParams in; RequestOutput out; abort by id), so
the loop can move to its own process later without changing callers. Closing a `generate()`
iterator early (client gone) aborts the request, which frees its KV blocks in the next step.

Per-request timings (queue time, time to first token, inter-token gaps, end to end) are taken here:
the step loop stamps each step's outputs with one clock read, and the event-loop side turns the
stamps into a `RequestStats` per finished or aborted request, handed to the registered observers
(the server's Prometheus metrics). The step loop itself does no per-token bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from paphos.config import EngineConfig, ModelConfig
from paphos.engine.llm_engine import LLMEngine
from paphos.engine.output_processor import child_request_id
from paphos.outputs import RequestOutput
from paphos.request import Request
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


STAT_NAMES = (
    "num_running", "num_waiting", "kv_usage", "num_used_blocks", "num_total_blocks", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens", "num_generation_tokens",
)


class EngineDeadError(RuntimeError):
    """The step loop died; every pending and future request fails with this."""


@dataclass
class RequestStats:
    """What the engine saw of one client request, once it finished or was aborted.

    Times are `time.monotonic()` seconds; `first_scheduled_time` / `first_token_time` are None
    when the request never got that far.
    """

    request_id: str
    arrival_time: float
    finished_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    n: int
    max_tokens: int | None
    # One per sequence (n of them): stop, length or abort.
    finish_reasons: list[str]
    # Gaps between successive outputs that carried tokens (one per decode step).
    inter_token_latencies: list[float] = field(default_factory=list)


RequestObserver = Callable[[RequestStats], None]


class _Tracker:
    """Builds the RequestStats of one request from its stamped outputs (event-loop side)."""

    def __init__(self, request_id: str, prompt_len: int, params: SamplingParams, arrival: float) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.params = params
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.itl: list[float] = []
        self.generated: dict[int, int] = {}
        self.finished: dict[int, str] = {}

    def observe(self, output: RequestOutput, stamp: float) -> None:
        has_tokens = False
        for choice in output.outputs:
            if choice.token_ids:
                has_tokens = True
            self.generated[choice.index] = choice.num_generated_tokens
            if choice.finish_reason is not None:
                self.finished[choice.index] = choice.finish_reason
        if has_tokens:
            if self.first_token is None:
                self.first_token = stamp
            elif self.last_token is not None:
                self.itl.append(stamp - self.last_token)
            self.last_token = stamp

    def stats(self, first_child: Request | None) -> RequestStats:
        n = self.params.n
        reasons = [self.finished.get(i, "abort") for i in range(n)]
        return RequestStats(
            request_id=self.request_id, arrival_time=self.arrival, finished_time=time.monotonic(),
            first_scheduled_time=None if first_child is None else first_child.first_scheduled_time,
            first_token_time=self.first_token, num_prompt_tokens=self.prompt_len,
            num_generation_tokens=sum(self.generated.values()), n=n, max_tokens=self.params.max_tokens,
            finish_reasons=reasons, inter_token_latencies=self.itl,
        )


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
        self._streams: dict[str, asyncio.Queue[tuple[RequestOutput | BaseException, float]]] = {}
        self._stopping = threading.Event()
        # First scheduler Request of each client request (set by the step loop when it adds the
        # request), read once when the request ends for its queue time.
        self._first_child: dict[str, Request] = {}
        self._observers: list[RequestObserver] = []

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
        """The resolved model config once loaded; before that, the one given (model path known)."""
        if self._engine is None:
            return self.config.model
        return self._engine.config.model

    def stats(self) -> dict[str, float]:
        if self._engine is None:
            return dict.fromkeys(STAT_NAMES, 0)
        scheduler = self._engine.scheduler
        processor = self._engine.output_processor
        return {
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "kv_usage": scheduler.kv_usage,
            "num_used_blocks": scheduler.num_used_blocks,
            "num_total_blocks": self._engine.num_blocks - 1,  # block 0 is reserved
            "num_preemptions": scheduler.num_preemptions_total,
            "prefix_cache_queries": scheduler.prefix_cache_queries,
            "prefix_cache_hits": scheduler.prefix_cache_hits,
            "num_prompt_tokens": processor.num_prompt_tokens,
            "num_generation_tokens": processor.num_generation_tokens,
        }

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache settings, as strings (Prometheus info metric)."""
        cache = self.config.cache if self._engine is None else self._engine.config.cache
        info = {
            "block_size": str(cache.block_size),
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        }
        if self._engine is not None:
            info["num_gpu_blocks"] = str(self._engine.num_blocks - 1)
        return info

    def add_request_observer(self, observer: RequestObserver) -> None:
        """`observer(stats)` runs on the event loop once per finished or aborted request."""
        self._observers.append(observer)

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
        stream: asyncio.Queue[tuple[RequestOutput | BaseException, float]] = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = time.monotonic()
        tracker = _Tracker(request_id, len(prompt_token_ids), params, arrival)
        self._inbox.put(("add", (request_id, prompt_token_ids, params, arrival)))
        finished = False
        failed = False
        try:
            while not finished:
                item, stamp = await stream.get()
                if isinstance(item, BaseException):
                    failed = True
                    raise item
                tracker.observe(item, stamp)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            first_child = self._first_child.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))
            if not failed:
                self._notify(tracker.stats(first_child))

    def _notify(self, stats: RequestStats) -> None:
        for observer in self._observers:
            try:
                observer(stats)
            except Exception:  # noqa: BLE001 - metrics must never break a request
                logger.exception("a request observer failed")

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
                    outputs = engine.step()
                    stamp = time.monotonic()
                    for output in outputs:
                        self._deliver(output.request_id, output, stamp)
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
                request_id, prompt_token_ids, params, arrival = payload
                try:
                    engine.add_request(request_id, prompt_token_ids, params, arrival)
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    self._deliver(request_id, exc, time.monotonic())
                    continue
                first_child = engine.scheduler.requests.get(child_request_id(request_id, 0))
                if first_child is not None and request_id in self._streams:
                    self._first_child[request_id] = first_child
            elif kind == "abort":
                engine.abort_request([payload])
                self._first_child.pop(payload, None)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, stamp: float) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put, request_id, item, stamp)

    def _put(self, request_id: str, item: RequestOutput | BaseException, stamp: float) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait((item, stamp))

    def _fail(self, exc: BaseException) -> None:
        self.errored = True
        self.error = exc
        self.is_ready = False
        dead = EngineDeadError(f"the engine has stopped: {exc}")
        if self._loop is not None:
            for request_id in list(self._streams):
                self._deliver(request_id, dead, time.monotonic())
