"""paphos.LLM: offline batch generation on top of the synchronous engine.

    llm = LLM()                                   # the bundled default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text

Keyword arguments are the CLI flags in Python spelling (max_model_len=..., dtype=...).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from paphos.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    LoRAModule,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from paphos.core.protocol import LoRARequest
from paphos.engine.llm_engine import LLMEngine
from paphos.lora.errors import LoRANotFoundError
from paphos.outputs import RequestOutput, accumulate
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer

_MODEL_FIELDS = {f for f in ModelConfig.__dataclass_fields__} - {"model"}
_CACHE_FIELDS = set(CacheConfig.__dataclass_fields__)
_SCHEDULER_FIELDS = set(SchedulerConfig.__dataclass_fields__) - {"max_model_len"}
_LORA_FIELDS = set(LoRAConfig.__dataclass_fields__)
_PARALLEL_FIELDS = set(ParallelConfig.__dataclass_fields__)


def build_engine_config(model: str | None = None, **kwargs: object) -> EngineConfig:
    """An EngineConfig from flag-named keyword arguments; unknown names are an error."""
    unknown = set(kwargs) - _MODEL_FIELDS - _CACHE_FIELDS - _SCHEDULER_FIELDS - _LORA_FIELDS - _PARALLEL_FIELDS
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
    if model is None:
        from paphos.default_model import default_model_path

        model = str(default_model_path())
    pick = lambda names: {k: v for k, v in kwargs.items() if k in names}  # noqa: E731
    lora = pick(_LORA_FIELDS)
    if "lora_modules" in lora:
        # name -> path, like --lora-modules name=path.
        modules = lora["lora_modules"]
        if not isinstance(modules, dict):
            raise TypeError("lora_modules must be a dict of adapter name -> path")
        lora["lora_modules"] = tuple(LoRAModule(str(k), str(v)) for k, v in modules.items())
    return EngineConfig(
        model=ModelConfig(model=model, **pick(_MODEL_FIELDS)),
        cache=CacheConfig(**pick(_CACHE_FIELDS)),
        scheduler=SchedulerConfig(**pick(_SCHEDULER_FIELDS)),
        parallel=ParallelConfig(**pick(_PARALLEL_FIELDS)),
        lora=LoRAConfig(**lora),
    )


class LLM:
    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel ranks of `tensor_parallel_size > 1` (also done at exit)."""
        self.engine.close()

    def add_lora(self, name: str, path: str) -> None:
        """Registers a PEFT adapter (needs enable_lora=True); `generate(..., lora=name)` uses it."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns full (not delta) outputs in prompt order.
        `lora`: an adapter name for every prompt, or one name (or None: the base) per prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        names = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(names) != len(prompts):
            raise ValueError("lora must be one name or one per prompt")
        adapters = [self._adapter(name) for name in names]
        order: list[str] = []
        for prompt, params, adapter in zip(prompts, params_list, adapters, strict=True):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, params, lora=adapter)
            order.append(request_id)
        results = {rid: None for rid in order}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                results[delta.request_id] = accumulate(results[delta.request_id], delta)
        return [results[rid] for rid in order]

    def _adapter(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        adapter = self.engine.frontend.loras.get(name)
        if adapter is None:
            raise LoRANotFoundError(f"no adapter named {name!r} is loaded")
        return adapter

