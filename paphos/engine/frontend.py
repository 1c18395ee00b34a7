"""Frontend: the API side of the engine core: validation, fan-out, text (design.md §2, rule 5).

Data flow: a client request (prompt token ids + SamplingParams) -> `validate` (what only the
loaded model can judge; tokenizer-derived sampler inputs once per request) -> `add_request`: one
`EngineCoreRequest` per sequence (n / best_of) for the core -> the core's `EngineCoreOutputs` ->
`process` (OutputProcessor: detokenization, stop strings, phrase bans) -> RequestOutputs, plus
the follow-ups the core must apply. The server runs it in the API process, next to HTTP, and the
core in a process of its own; `paphos.LLM` runs both in one process.
"""

from __future__ import annotations

import dataclasses
import time

from paphos.core.protocol import CoreInput, EngineCoreOutputs, EngineCoreRequest, LoRARequest, SamplingInputs
from paphos.engine.info import EngineInfo
from paphos.engine.output_processor import OutputProcessor
from paphos.engine.sampling_prep import SamplingPreparer
from paphos.lora.errors import LoRAError
from paphos.lora.registry import LoRARegistry
from paphos.outputs import RequestOutput
from paphos.sampling_params import ParamError, SamplingParams


class Frontend:
    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.output_processor = OutputProcessor(info.tokenizer)
        self.sampling_preparer = SamplingPreparer(info.tokenizer, info.vocab_size, info.stop_token_ids)
        self.loras = LoRARegistry(info.config.lora, info.lora_spec, info.config.model.served_names)

    def register_startup_adapters(self) -> None:
        """`--lora-modules`, validated like runtime loads; a bad one stops the start-up, named."""
        for module in self.info.config.lora.lora_modules:
            try:
                self.loras.register(module.name, module.path, module.base_model_name)
            except LoRAError as exc:
                raise LoRAError(f"--lora-modules {module.name}={module.path}: {exc}") from None

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingInputs:
        """Raises ParamError for what only the loaded model can judge; the core never sees it."""
        if not prompt_token_ids:
            raise ParamError("prompt", "the prompt is empty")
        vocab_size = self.info.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary (size {vocab_size})")
        params.validate_against(vocab_size, self.info.config.model.max_logprobs)
        prompt_len = len(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if prompt_len + max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens" if prompt_len < self.max_model_len else "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                "for the completion). Please reduce the length of the prompt or completion.",
            )
        blocks_needed = -(-(prompt_len + max_tokens) // self.info.config.cache.block_size)
        if blocks_needed > self.info.num_blocks - 1:
            raise ParamError(
                "prompt",
                f"the request needs {blocks_needed} KV blocks but the cache holds {self.info.num_blocks - 1}",
            )
        return self.sampling_preparer.prepare(params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sampling_inputs: SamplingInputs,
        arrival_time: float | None = None,
        lora: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Registers a validated client request; returns what to send to the core."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = self.output_processor.add_request(request_id, prompt_token_ids, params)
        return [
            EngineCoreRequest(child_id, prompt_token_ids, _child_params(params, index), sampling_inputs, arrival, lora)
            for index, child_id in enumerate(child_ids)
        ]

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a client request; returns its sequences' ids for the core to finish."""
        child_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort_request(request_id)
        return child_ids

    def process(self, outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[CoreInput]]:
        return self.output_processor.process(outputs)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each sequence of an n / best_of request gets its own seed; only the first scores the prompt."""
    if params.best_of == 1:
        return params
    return dataclasses.replace(
        params, n=1, best_of=1, seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )
