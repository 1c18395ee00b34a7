"""EngineCore: schedule -> execute -> update, and nothing else (design.md §2, rule 5).

It owns the scheduler and the model runner. Inputs are `EngineCoreRequest`s and the follow-ups
the API side sends (finish, rollback: `paphos.core.protocol.CoreInput`); every step yields one
`EngineCoreOutputs` of token ids, logprobs and finish reasons. It never sees text: tokenization,
detokenization, stop strings and HTTP are the API side's (`Frontend`). The server runs it in its
own process (core_process.py); `paphos.LLM` runs it in-process (llm_engine.py).
"""

from __future__ import annotations

import logging
import time

from paphos.config import EngineConfig
from paphos.core.protocol import (
    AddRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    RollbackRequest,
    UnloadAdapter,
)
from paphos.core.scheduler import Scheduler
from paphos.engine.info import EngineInfo
from paphos.request import Request, RequestStatus
from paphos.worker.setup import load_worker

logger = logging.getLogger(__name__)

# How long a step with nothing to run but adapter loads waits for one to finish.
_ADAPTER_WAIT_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        worker = load_worker(config)
        self.runner = worker.runner
        self.info = EngineInfo(
            config=worker.config, tokenizer=worker.tokenizer, vocab_size=worker.vocab_size,
            num_blocks=worker.num_blocks, eos_token_id=worker.eos_token_id,
            extra_eos_token_ids=worker.extra_eos_token_ids, lora_spec=worker.lora_spec,
        )
        lora_config = worker.config.lora
        self.scheduler = Scheduler(
            worker.config.scheduler, worker.config.cache, worker.num_blocks,
            max_loras=lora_config.max_loras if lora_config.enable_lora else None,
        )
        # Adapters' weights in host memory (None when LoRA is off); the runner's slots read them.
        self.adapters = worker.adapters
        # With -tp N: the other ranks' processes (worker/tensor_parallel.py), stopped by close().
        self._tp = worker.tp
        # Requests whose adapter is still loading from disk, by adapter id; the scheduler gets
        # them once it is in host memory (add_request, _admit_loaded).
        self._awaiting_adapter: dict[int, list[Request]] = {}
        # Requests whose adapter is being copied into a device slot beside the steps
        # (lora/slots.py, prefetch); the scheduler gets them once the copy is done.
        self._awaiting_slot: dict[int, list[Request]] = {}
        # The adapter of every unfinished request that has one (its host-cache reference).
        self._request_adapter: dict[str, int] = {}
        # Requests the core finished itself with an error (an adapter that failed to load).
        self._errors: dict[str, str] = {}
        # Rollbacks applied since the last step's outputs, acknowledged in the next ones.
        self._rolled_back: list[str] = []
        logger.info(
            "engine ready: max_model_len=%d, %d KV blocks of %d tokens (%d tokens)",
            self.info.max_model_len, worker.num_blocks - 1, worker.config.cache.block_size,
            (worker.num_blocks - 1) * worker.config.cache.block_size,
        )

    def check_health(self) -> None:
        """Raises if a part of the engine outside this process died (a tensor-parallel rank);
        steps check it themselves, the idle loop calls this."""
        if self._tp is not None:
            self._tp.check_alive()

    def close(self) -> None:
        """Stops what the core started beside itself (tensor-parallel ranks); idempotent."""
        if self._tp is not None:
            self._tp.close()

    def handle(self, message: CoreInput) -> None:
        if isinstance(message, AddRequests):
            for request in message.requests:
                self.add_request(request)
        elif isinstance(message, FinishRequests):
            status = RequestStatus.FINISHED_STOPPED if message.stopped else RequestStatus.FINISHED_ABORTED
            self.scheduler.finish_requests(message.request_ids, status)
            self._drop_awaiting(message.request_ids)
            for req_id in message.request_ids:
                self._release_adapter(req_id)
        elif isinstance(message, RollbackRequest):
            if self.scheduler.rollback_request(message.req_id, message.num_output_tokens, message.banned_token_id):
                self._rolled_back.append(message.req_id)
        elif isinstance(message, UnloadAdapter) and self.adapters is not None:
            self.adapters.unload(message.lora_id)
            self.runner.unload_adapter(message.lora_id)

    def add_request(self, request: EngineCoreRequest) -> None:
        """A request the core cannot take (the frontend validated it: a bug) finishes as aborted;
        the others carry on."""
        try:
            req = Request(
                request.request_id, request.prompt_token_ids, request.sampling_params, self.info.eos_token_id,
                request.arrival_time, request.sampling_inputs, self.info.extra_eos_token_ids, request.lora,
            )
            if request.lora is None:
                self.scheduler.add_request(req)
                return
            if self.adapters is None:
                raise ValueError("a LoRA adapter was requested, but LoRA is not enabled")
            self.adapters.acquire(request.lora)
            self._request_adapter[req.request_id] = req.lora_id
            if self.adapters.is_ready(req.lora_id):
                self._to_device_slot(req.lora_id, [req])
            else:
                self._awaiting_adapter.setdefault(req.lora_id, []).append(req)
        except Exception:  # noqa: BLE001 - confined to this request
            logger.exception("request %s could not be added", request.request_id)
            self._release_adapter(request.request_id)
            self.scheduler.reject(request.request_id)

    def _admit_loaded(self) -> None:
        """Requests whose adapter finished loading go to the scheduler (in arrival order); those
        whose adapter failed to load finish with the error."""
        assert self.adapters is not None
        ready, failed = self.adapters.poll()
        for lora_id in ready:
            if lora_id in self._awaiting_adapter:
                self._to_device_slot(lora_id, self._awaiting_adapter.pop(lora_id))
        slots = self.runner.adapter_slots
        for lora_id in list(self._awaiting_slot):
            if slots is None or slots.is_ready(lora_id) or not slots.is_resident(lora_id):
                # copied, or evicted meanwhile by a step that needed every slot: then the step
                # that schedules them loads it
                for req in self._awaiting_slot.pop(lora_id):
                    self.scheduler.add_request(req)
        for failure in failed:
            for req in self._awaiting_adapter.pop(failure.lora_id, []):
                self._errors[req.request_id] = failure.message
                self._release_adapter(req.request_id)
                self.scheduler.reject(req.request_id)

    def _to_device_slot(self, lora_id: int, reqs: list[Request]) -> None:
        """Requests whose adapter is in host memory: to the scheduler when the adapter is in a
        device slot or none is free (the step then loads it), else held while it is copied into
        one beside the steps."""
        slots = self.runner.adapter_slots
        if slots is not None and slots.prefetch(lora_id, set(self._request_adapter.values())):
            if lora_id in self._awaiting_slot or not slots.is_ready(lora_id):
                self._awaiting_slot.setdefault(lora_id, []).extend(reqs)
                return
        for req in reqs:
            self.scheduler.add_request(req)

    def _drop_awaiting(self, req_ids: list[str]) -> None:
        ids = set(req_ids)
        for held in (self._awaiting_adapter, self._awaiting_slot):
            for lora_id, reqs in list(held.items()):
                kept = [r for r in reqs if r.request_id not in ids]
                if kept:
                    held[lora_id] = kept
                else:
                    del held[lora_id]
                    if held is self._awaiting_slot and self.runner.adapter_slots is not None:
                        self.runner.adapter_slots.release_reservation(lora_id)

    def _release_adapter(self, req_id: str) -> None:
        lora_id = self._request_adapter.pop(req_id, None)
        if lora_id is not None and self.adapters is not None:
            self.adapters.release(lora_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_adapter or self._awaiting_slot)

    def idle_outputs(self) -> EngineCoreOutputs:
        """An outputs record with only the scheduler's gauges, for when no step runs."""
        return EngineCoreOutputs(stats=self.scheduler.stats(), timestamp=time.monotonic())

    def step(self) -> EngineCoreOutputs:
        if self.adapters is not None:
            if not self.scheduler.has_unfinished_requests():
                # Only requests waiting for their adapter: sleep on the load or the copy, not in a
                # busy loop.
                if self._awaiting_slot and self.runner.adapter_slots is not None:
                    self.runner.adapter_slots.wait_ready(next(iter(self._awaiting_slot)))
                elif self.adapters.loading:
                    self.adapters.wait(_ADAPTER_WAIT_S)
            self._admit_loaded()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.rolled_back, self._rolled_back = self._rolled_back, []
        if self._errors:
            outputs.errors.update(self._errors)
            self._errors = {}
        if self._request_adapter:
            for req_id in outputs.finish_reasons:
                # A held request (phrase bans) may still be rolled back and run again.
                if not self.scheduler.is_held(req_id):
                    self._release_adapter(req_id)
        outputs.timestamp = time.monotonic()
        return outputs
