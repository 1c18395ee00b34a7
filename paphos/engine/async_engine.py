"""AsyncEngine: the API process's client of the engine core, which runs in a process of its own.

Data flow (design.md §2): a route calls `generate()` on the event loop: the `Frontend` validates
the request (a ParamError is raised at once, before anything streams) and turns it into one
`EngineCoreRequest` per sequence, sent to the core over ZMQ (core_process.py). A reader task
receives the core's `EngineCoreOutputs`, one per step, runs the frontend's output processing
(detokenization, stop strings, phrase bans), sends its follow-ups back to the core and puts each
RequestOutput on its request's asyncio queue; when the HTTP side lags, the outputs waiting on one
queue are merged into one. Closing a `generate()` iterator early (client gone) finishes the
request in the core at its next step, which frees its KV blocks.

Lifecycle: `start()` spawns the core and waits for it to load the model (the HTTP server answers
/health 503 meanwhile). If the core process dies, every pending request fails with
`EngineDeadError`, later ones are refused, and `on_dead` is called (the CLI exits non-zero so a
supervisor restarts the server). `shutdown()` stops the core: SIGTERM, then SIGKILL if it lingers.

Per-request timings (queue time, time to first token, inter-token gaps, end to end) are taken here:
the core stamps each step's outputs with one clock read, and the event-loop side turns the stamps
into a `RequestStats` per finished or aborted request, handed to the registered observers (the
server's Prometheus metrics). The core itself does no per-token bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from paphos.config import EngineConfig, ModelConfig
from paphos.core.protocol import (
    AddRequests,
    CoreInput,
    EngineCoreOutputs,
    FinishRequests,
    LoRARequest,
    SamplingInputs,
    SchedulerStats,
    UnloadAdapter,
)
from paphos.engine import core_process
from paphos.engine.frontend import Frontend
from paphos.engine.info import EngineInfo
from paphos.lora.registry import LoRARegistry
from paphos.outputs import RequestOutput, accumulate
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


STAT_NAMES = (
    "num_running", "num_waiting", "kv_usage", "num_used_blocks", "num_total_blocks", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens", "num_generation_tokens",
)


class EngineDeadError(RuntimeError):
    """The engine core died; every pending and future request fails with this."""


class EngineOverloadedError(RuntimeError):
    """The admission queue is full (`max_num_waiting` requests not yet scheduled): the server
    answers 429 with Retry-After instead of letting the queue, and every queued request's wait,
    grow without bound."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's request timeout (arrival to last token, queue included);
    the core has been told to abort it, which frees its KV blocks."""


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
        self.first_scheduled: float | None = None

    def observe(self, output: RequestOutput, stamp: float) -> None:
        if output.first_scheduled_time is not None and self.first_scheduled is None:
            self.first_scheduled = output.first_scheduled_time
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

    def stats(self) -> RequestStats:
        n = self.params.n
        reasons = [self.finished.get(i, "abort") for i in range(n)]
        return RequestStats(
            request_id=self.request_id, arrival_time=self.arrival, finished_time=time.monotonic(),
            first_scheduled_time=self.first_scheduled,
            first_token_time=self.first_token, num_prompt_tokens=self.prompt_len,
            num_generation_tokens=sum(self.generated.values()), n=n, max_tokens=self.params.max_tokens,
            finish_reasons=reasons, inter_token_latencies=self.itl,
        )


class AsyncEngine:
    def __init__(
        self, config: EngineConfig, on_dead: Callable[[BaseException], None] | None = None,
        max_num_waiting: int | None = None, request_timeout_s: float | None = None,
    ) -> None:
        """`on_dead(error)` runs on the event loop if the core process dies after it was ready.
        `max_num_waiting`: new requests are refused (EngineOverloadedError) while that many sent
        to the core have not been scheduled yet; None admits without bound. `request_timeout_s`:
        a request still running that long after it arrived ends with RequestTimeoutError."""
        self.config = config
        self.max_num_waiting = max_num_waiting
        self.request_timeout_s = request_timeout_s
        # Core request ids sent and not yet scheduled (first_scheduled) nor finished: the queue
        # as the API process knows it, current to the last step's outputs.
        self._unscheduled: set[str] = set()
        self.is_ready = False
        self.errored = False
        self.error: BaseException | None = None
        self._on_dead = on_dead
        self._frontend: Frontend | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._socket_dir: tempfile.TemporaryDirectory[str] | None = None
        self._context: zmq.asyncio.Context | None = None
        self._to_core: zmq.Socket | None = None
        self._from_core: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[tuple[RequestOutput | BaseException, float]]] = {}
        self._observers: list[RequestObserver] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._scheduler_stats = SchedulerStats()
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the core process and waits for it to load the model; raises if loading fails."""
        self._socket_dir = tempfile.TemporaryDirectory(prefix="paphos-")
        to_core = f"ipc://{Path(self._socket_dir.name) / 'in'}"
        from_core = f"ipc://{Path(self._socket_dir.name) / 'out'}"
        self._context = zmq.asyncio.Context()
        # A plain (blocking-API) socket for sends: they never wait (no high-water mark), so
        # routes and cleanup code send without awaiting.
        self._to_core = zmq.Context.instance().socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(to_core)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.bind(from_core)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=core_process.run_engine_core, args=(self.config, to_core, from_core, os.getpid()),
            name="paphos-engine-core",
        )
        self._process.start()
        logger.info("engine core process %d started", self._process.pid)
        try:
            info = await self._await_ready()
        except BaseException as exc:
            self._fail(exc)
            await self._stop_process()
            raise
        frontend = Frontend(info)
        try:
            await asyncio.to_thread(frontend.register_startup_adapters)
        except BaseException as exc:
            self._fail(exc)
            await self._stop_process()
            raise
        self._frontend = frontend
        self._reader = asyncio.create_task(self._read_outputs(), name="paphos-core-outputs")
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._core_exited)
        self.is_ready = True

    async def _await_ready(self) -> EngineInfo:
        assert self._from_core is not None and self._process is not None
        while True:
            if await self._from_core.poll(500):
                kind, body = await self._from_core.recv_multipart()
                if kind == core_process.READY:
                    return pickle.loads(body)
                raise RuntimeError(body.decode(errors="replace"))
            if not self._process.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._process.exitcode} while loading")

    async def shutdown(self) -> None:
        self._stopping = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._stop_process()

    async def _stop_process(self) -> None:
        process = self._process
        if process is not None:
            try:
                asyncio.get_running_loop().remove_reader(process.sentinel)
            except (ValueError, OSError):
                pass
            if process.is_alive():
                process.terminate()
                await asyncio.to_thread(process.join, 10)
            if process.is_alive():
                logger.warning("the engine core did not stop within 10 s; killing it")
                process.kill()
                await asyncio.to_thread(process.join, 5)
        for sock in (self._to_core, self._from_core):
            if sock is not None:
                sock.close(linger=0)
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
            self._socket_dir = None

    def _core_exited(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._stopping:
            return
        self._process.join(0)
        self._dead(RuntimeError(f"the engine core process exited with code {self._process.exitcode}"))

    def _dead(self, exc: BaseException) -> None:
        if self.errored:
            return
        logger.error("the engine core died: %s", exc)
        self._fail(exc)
        if self._on_dead is not None:
            self._on_dead(exc)

    def _fail(self, exc: BaseException) -> None:
        self.errored = True
        self.error = exc
        self.is_ready = False
        dead = EngineDeadError(f"the engine has stopped: {exc}")
        now = time.monotonic()
        for stream in self._streams.values():
            stream.put_nowait((dead, now))

    # ---- what the routes use ----------------------------------------------------------------------

    @property
    def frontend(self) -> Frontend:
        if self._frontend is None:
            raise EngineDeadError("the model is not loaded yet")
        return self._frontend

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.frontend.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.frontend.info.vocab_size

    @property
    def model_config(self) -> ModelConfig:
        """The resolved model config once loaded; before that, the one given (model path known)."""
        if self._frontend is None:
            return self.config.model
        return self._frontend.info.config.model

    def stats(self) -> dict[str, float]:
        if self._frontend is None:
            return dict.fromkeys(STAT_NAMES, 0)
        core = self._scheduler_stats
        processor = self._frontend.output_processor
        return {
            "num_running": core.num_running,
            "num_waiting": core.num_waiting,
            "kv_usage": core.kv_usage,
            "num_used_blocks": core.num_used_blocks,
            "num_total_blocks": self._frontend.info.num_blocks - 1,  # block 0 is reserved
            "num_preemptions": core.num_preemptions,
            "prefix_cache_queries": core.prefix_cache_queries,
            "prefix_cache_hits": core.prefix_cache_hits,
            "num_prompt_tokens": processor.num_prompt_tokens,
            "num_generation_tokens": processor.num_generation_tokens,
        }

    def lora_info(self) -> dict[str, str] | None:
        """Adapters in use (vLLM's lora_requests_info labels), or None when LoRA is off."""
        if self._frontend is None or not self._frontend.loras.enabled:
            return None
        core = self._scheduler_stats
        return {
            "running_lora_adapters": ",".join(core.running_loras),
            "waiting_lora_adapters": ",".join(core.waiting_loras),
            "max_lora": str(self._frontend.info.config.lora.max_loras),
        }

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache settings, as strings (Prometheus info metric)."""
        cache = self.config.cache if self._frontend is None else self._frontend.info.config.cache
        info = {
            "block_size": str(cache.block_size),
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        }
        if self._frontend is not None:
            info["num_gpu_blocks"] = str(self._frontend.info.num_blocks - 1)
        return info

    @property
    def lora_registry(self) -> LoRARegistry:
        return self.frontend.loras

    async def add_lora(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        """Validates and registers an adapter (LoRAError / LoRANotFoundError otherwise); the file
        reads run off the event loop. Replacing one releases the old adapter once unused."""
        registry = self.lora_registry
        previous = registry.get(name)
        request = await asyncio.to_thread(registry.register, name, path, base_model_name, replace)
        if previous is not None:
            self._send(UnloadAdapter(previous.lora_id))
        return request

    async def remove_lora(self, name: str) -> None:
        """Unregisters now; requests already running with the adapter finish with it."""
        self._send(UnloadAdapter(self.lora_registry.unregister(name).lora_id))

    def add_request_observer(self, observer: RequestObserver) -> None:
        """`observer(stats)` runs on the event loop once per finished or aborted request."""
        self._observers.append(observer)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: LoRARequest | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validates at once (raising ParamError), then streams the request's outputs."""
        if self.errored:
            raise EngineDeadError(f"the engine has stopped: {self.error}")
        inputs = self.frontend.validate(prompt_token_ids, params)
        if self.max_num_waiting is not None and len(self._unscheduled) >= self.max_num_waiting:
            raise EngineOverloadedError(
                f"The server is at capacity: {len(self._unscheduled)} requests are waiting to start "
                f"(--max-num-waiting {self.max_num_waiting}). Retry later."
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self._stream(request_id, prompt_token_ids, params, inputs, lora)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    # ---- internals ------------------------------------------------------------------------------

    async def _stream(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, inputs: SamplingInputs,
        lora: LoRARequest | None,
    ) -> AsyncIterator[RequestOutput]:
        stream: asyncio.Queue[tuple[RequestOutput | BaseException, float]] = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = time.monotonic()
        tracker = _Tracker(request_id, len(prompt_token_ids), params, arrival)
        requests = self.frontend.add_request(request_id, prompt_token_ids, params, inputs, arrival, lora)
        self._send(AddRequests(requests))
        self._unscheduled.update(r.request_id for r in requests)
        finished = False
        failed = False
        pending_error: BaseException | None = None
        try:
            while not finished:
                item, stamp = (pending_error, 0.0) if pending_error is not None else await self._next(stream, arrival)
                if isinstance(item, BaseException):
                    failed = True
                    raise item
                # Outputs that piled up while this client was being served go out as one.
                while not item.finished and not stream.empty():
                    later, stamp = stream.get_nowait()
                    if isinstance(later, BaseException):
                        pending_error = later
                        break
                    item = accumulate(item, later)
                tracker.observe(item, stamp)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort(request_id)
            if not failed:
                self._notify(tracker.stats())

    async def _next(
        self, stream: asyncio.Queue[tuple[RequestOutput | BaseException, float]], arrival: float
    ) -> tuple[RequestOutput | BaseException, float]:
        if self.request_timeout_s is None:
            return await stream.get()
        # Checked before waiting too: while outputs keep arriving, get() never suspends, and a
        # timeout only fires at a suspension.
        remaining = arrival + self.request_timeout_s - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                return await stream.get()
        except TimeoutError:
            raise RequestTimeoutError(
                f"The request did not finish within the server's request timeout ({self.request_timeout_s:g} s, "
                "--request-timeout); it was aborted."
            ) from None

    def _abort(self, request_id: str) -> None:
        if self._frontend is None or self.errored:
            return
        child_ids = self._frontend.abort_request(request_id)
        self._unscheduled.difference_update(child_ids)
        if child_ids:
            self._send(FinishRequests(child_ids))

    def _send(self, message: CoreInput) -> None:
        assert self._to_core is not None
        self._to_core.send(self._encoder.encode(message), copy=False)

    async def _read_outputs(self) -> None:
        assert self._from_core is not None
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        frontend = self.frontend
        try:
            while True:
                kind, body = await self._from_core.recv_multipart(copy=False)
                if kind.bytes != core_process.OUTPUTS:
                    self._dead(RuntimeError(body.bytes.decode(errors="replace")))
                    return
                outputs = decoder.decode(body.buffer)
                if outputs.stats is not None:
                    self._scheduler_stats = outputs.stats
                if self._unscheduled:
                    self._unscheduled.difference_update(outputs.first_scheduled)
                    self._unscheduled.difference_update(outputs.finish_reasons)
                request_outputs, followups = frontend.process(outputs)
                for message in followups:
                    self._send(message)
                for output in request_outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put_nowait((output, outputs.timestamp))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the API side of the engine is broken: stop serving
            logger.exception("processing the engine core's outputs failed")
            self._dead(exc)

    def _notify(self, stats: RequestStats) -> None:
        for observer in self._observers:
            try:
                observer(stats)
            except Exception:  # noqa: BLE001 - metrics must never break a request
                logger.exception("a request observer failed")
