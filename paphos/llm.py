"""paphos.LLM: offline batch generation on top of the synchronous engine.

    llm = LLM()                                   # the bundled default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text

Keyword arguments are the CLI flags in Python spelling (max_model_len=..., dtype=...).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from paphos.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from paphos.engine.llm_engine import LLMEngine
from paphos.outputs import RequestOutput, accumulate
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer

_MODEL_FIELDS = {f for f in ModelConfig.__dataclass_fields__} - {"model"}
_CACHE_FIELDS = set(CacheConfig.__dataclass_fields__)
_SCHEDULER_FIELDS = set(SchedulerConfig.__dataclass_fields__) - {"max_model_len"}


def build_engine_config(model: str | None = None, **kwargs: object) -> EngineConfig:
    """An EngineConfig from flag-named keyword arguments; unknown names are an error."""
    unknown = set(kwargs) - _MODEL_FIELDS - _CACHE_FIELDS - _SCHEDULER_FIELDS
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
    if model is None:
        from paphos.default_model import default_model_path

        model = str(default_model_path())
    pick = lambda names: {k: v for k, v in kwargs.items() if k in names}  # noqa: E731
    return EngineConfig(
        model=ModelConfig(model=model, **pick(_MODEL_FIELDS)),
        cache=CacheConfig(**pick(_CACHE_FIELDS)),
        scheduler=SchedulerConfig(**pick(_SCHEDULER_FIELDS)),
    )


class LLM:
    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns full (not delta) outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        order: list[str] = []
        for prompt, params in zip(prompts, params_list, strict=True):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, params)
            order.append(request_id)
        results = {rid: None for rid in order}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                results[delta.request_id] = accumulate(results[delta.request_id], delta)
        return [results[rid] for rid in order]

