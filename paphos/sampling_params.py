"""SamplingParams: what one request asks of the sampler and of stop handling.

Built by the HTTP layer (or by the user of `paphos.LLM`) and validated here, once; the engine
trusts it afterwards. Field names and defaults follow the Aphrodite contract
(`shared/reference/aphrodite-api.md` §3-§4). A violation raises `ParamError` naming the field, which
the server turns into a 400 with `param` set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5
MIN_SAMPLING_TEMPERATURE = 0.01


class ParamError(ValueError):
    """A request parameter is invalid; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Engine-filled: stop on these ids besides EOS (generation-config EOS ids), not user-visible.
    extra_eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.seed is not None and self.seed == -1:
            self.seed = None
        if self.best_of is None:
            self.best_of = self.n
        if self.logit_bias:
            self.logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE and self.temperature >= GREEDY_TEMPERATURE:
            self.temperature = MIN_SAMPLING_TEMPERATURE
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ParamError("n", f"n must be at least 1, got {self.n}")
        if self.best_of < self.n:
            raise ParamError("best_of", f"best_of must be >= n, got best_of={self.best_of}, n={self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        if any(not s for s in self.stop):
            raise ParamError("stop", "stop strings must not be empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ParamError("logprobs", f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ParamError("prompt_logprobs", f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.is_greedy and self.best_of > 1:
            raise ParamError("n", "n and best_of must be 1 under greedy sampling (temperature 0)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def validate_against(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids within the vocabulary and the logprobs cap."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            for token_id in ids:
                if not 0 <= token_id < vocab_size:
                    raise ParamError(name, f"token id {token_id} is outside the vocabulary (size {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ParamError(name, f"{name} must be <= {max_logprobs} (--max-logprobs), got {value}")
