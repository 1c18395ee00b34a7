"""Records leaving the engine.

`EngineOutput` is what the scheduler reports per sequence per step (token ids, no text).
`RequestOutput` is what the output processor makes of it for the API layer: one record per client
request, carrying for each choice that changed the *delta* since its previous record (committed
text only: text that might still turn into a stop string is held back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paphos.core.scheduler_output import TokenLogprobs


@dataclass
class EngineOutput:
    req_id: str
    new_token_ids: list[int]
    new_sampled_logprobs: list[float]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    # Deltas since the previous RequestOutput of this choice.
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    # Totals so far.
    cumulative_logprob: float
    num_generated_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Set once, on the first record after the whole prompt was scored; entry 0 is None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # A failure confined to this request (the engine carries on with the others).
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
