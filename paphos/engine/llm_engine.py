"""LLMEngine: the engine core and its frontend in one process (offline use: `paphos.LLM`).

One step: EngineCore.step() (schedule -> execute -> update) -> Frontend.process() (text, stop
strings, phrase bans) -> RequestOutputs; the follow-ups it returns (sequences finished by stop
strings, phrase-ban rollbacks) go back to the core before the next step, so their blocks are
freed then. The server runs the same two halves in two processes (async_engine.py).
"""

from __future__ import annotations

import time

from paphos.config import EngineConfig
from paphos.core.protocol import FinishRequests, LoRARequest, UnloadAdapter
from paphos.core.scheduler import Scheduler
from paphos.engine.core import EngineCore
from paphos.engine.frontend import Frontend
from paphos.engine.output_processor import OutputProcessor
from paphos.outputs import RequestOutput
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer
from paphos.worker.model_runner import ModelRunner


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.frontend = Frontend(self.core.info)
        self.frontend.register_startup_adapters()
        self.config = self.core.info.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def output_processor(self) -> OutputProcessor:
        return self.frontend.output_processor

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Raises ParamError for a request the model cannot take."""
        inputs = self.frontend.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for request in self.frontend.add_request(request_id, prompt_token_ids, params, inputs, arrival, lora):
            self.core.add_request(request)

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        return self.frontend.loras.register(name, path, base_model_name)

    def remove_lora(self, name: str) -> None:
        self.core.handle(UnloadAdapter(self.frontend.loras.unregister(name).lora_id))

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.core.handle(FinishRequests(self.frontend.abort_request(request_id)))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any (also done at interpreter exit)."""
        self.core.close()

    def step(self) -> list[RequestOutput]:
        outputs, followups = self.frontend.process(self.core.step())
        for message in followups:
            self.core.handle(message)
        return outputs
