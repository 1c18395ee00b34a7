"""LLMEngine: the synchronous step loop (offline use, and the body of the async engine's thread).

One step: Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update_from_output() ->
OutputProcessor.process() -> RequestOutputs; sequences finished by stop strings are handed back to
the scheduler in the same step so their blocks are freed at once, and sequences in which a banned
phrase appeared are rolled back (Scheduler.rollback_request) before the next step.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from paphos.config import EngineConfig
from paphos.core.scheduler import Scheduler
from paphos.engine.output_processor import OutputProcessor
from paphos.engine.sampling_prep import SamplingPreparer
from paphos.outputs import RequestOutput
from paphos.request import Request, RequestStatus
from paphos.sampling_params import ParamError, SamplingParams
from paphos.worker.setup import load_worker

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        worker = load_worker(config)
        self.config = worker.config
        self.tokenizer = worker.tokenizer
        self.runner = worker.runner
        self.eos_token_id = worker.eos_token_id
        self.extra_eos_token_ids = worker.extra_eos_token_ids
        self.vocab_size = worker.vocab_size
        self.num_blocks = worker.num_blocks
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, worker.num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        stop_ids = sorted({*self.extra_eos_token_ids, *([self.eos_token_id] if self.eos_token_id is not None else [])})
        self.sampling_preparer = SamplingPreparer(self.tokenizer, self.vocab_size, stop_ids)
        logger.info(
            "engine ready: max_model_len=%d, %d KV blocks of %d tokens (%d tokens)",
            self.max_model_len, self.num_blocks - 1, self.config.cache.block_size,
            (self.num_blocks - 1) * self.config.cache.block_size,
        )

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ParamError for what only the loaded model can judge; the engine never sees it."""
        if not prompt_token_ids:
            raise ParamError("prompt", "the prompt is empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        params.validate_against(self.vocab_size, self.config.model.max_logprobs)
        self.sampling_preparer.prepare(params)
        prompt_len = len(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if prompt_len + max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens" if prompt_len < self.max_model_len else "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                "for the completion). Please reduce the length of the prompt or completion.",
            )
        blocks_needed = -(-(prompt_len + max_tokens) // self.config.cache.block_size)
        if blocks_needed > self.num_blocks - 1:
            raise ParamError(
                "prompt",
                f"the request needs {blocks_needed} KV blocks but the cache holds {self.num_blocks - 1}",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.validate_request(prompt_token_ids, params)
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = self.output_processor.add_request(request_id, prompt_token_ids, params)
        for index, child_id in enumerate(child_ids):
            self.scheduler.add_request(
                Request(child_id, prompt_token_ids, self._child_params(params, index), self.eos_token_id, arrival)
            )

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Each sequence of an n/best_of request gets its own seed and params object; only the first
        scores the prompt."""
        return dataclasses.replace(
            params,
            n=1,
            best_of=1,
            seed=None if params.seed is None else params.seed + index,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            extra_eos_token_ids=list(self.extra_eos_token_ids),
            # Each sequence's own phrase-ban rollback state (the scheduler mutates it).
            position_bans={},
        )

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        engine_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(engine_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for rollback in self.output_processor.take_rollbacks():
            self.scheduler.rollback_request(rollback.req_id, rollback.num_output_tokens, rollback.banned_token_id)
        return outputs
