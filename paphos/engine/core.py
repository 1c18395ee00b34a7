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
)
from paphos.core.scheduler import Scheduler
from paphos.engine.info import EngineInfo
from paphos.request import Request, RequestStatus
from paphos.worker.setup import load_worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        worker = load_worker(config)
        self.runner = worker.runner
        self.info = EngineInfo(
            config=worker.config, tokenizer=worker.tokenizer, vocab_size=worker.vocab_size,
            num_blocks=worker.num_blocks, eos_token_id=worker.eos_token_id,
            extra_eos_token_ids=worker.extra_eos_token_ids,
        )
        self.scheduler = Scheduler(worker.config.scheduler, worker.config.cache, worker.num_blocks)
        # Rollbacks applied since the last step's outputs, acknowledged in the next ones.
        self._rolled_back: list[str] = []
        logger.info(
            "engine ready: max_model_len=%d, %d KV blocks of %d tokens (%d tokens)",
            self.info.max_model_len, worker.num_blocks - 1, worker.config.cache.block_size,
            (worker.num_blocks - 1) * worker.config.cache.block_size,
        )

    def handle(self, message: CoreInput) -> None:
        if isinstance(message, AddRequests):
            for request in message.requests:
                self.add_request(request)
        elif isinstance(message, FinishRequests):
            status = RequestStatus.FINISHED_STOPPED if message.stopped else RequestStatus.FINISHED_ABORTED
            self.scheduler.finish_requests(message.request_ids, status)
        elif isinstance(message, RollbackRequest):
            if self.scheduler.rollback_request(message.req_id, message.num_output_tokens, message.banned_token_id):
                self._rolled_back.append(message.req_id)

    def add_request(self, request: EngineCoreRequest) -> None:
        """A request the core cannot take (the frontend validated it: a bug) finishes as aborted;
        the others carry on."""
        try:
            self.scheduler.add_request(Request(
                request.request_id, request.prompt_token_ids, request.sampling_params, self.info.eos_token_id,
                request.arrival_time, request.sampling_inputs, self.info.extra_eos_token_ids,
            ))
        except Exception:  # noqa: BLE001 - confined to this request
            logger.exception("request %s could not be added", request.request_id)
            self.scheduler.reject(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def idle_outputs(self) -> EngineCoreOutputs:
        """An outputs record with only the scheduler's gauges, for when no step runs."""
        return EngineCoreOutputs(stats=self.scheduler.stats(), timestamp=time.monotonic())

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.rolled_back, self._rolled_back = self._rolled_back, []
        outputs.timestamp = time.monotonic()
        return outputs
