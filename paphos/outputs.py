"""Records leaving the engine for its users.

`RequestOutput` is what the output processor makes of the engine core's token ids for the API
layer and `paphos.LLM`: one record per client request, carrying for each choice that changed the
*delta* since its previous record (committed text only: text that might still turn into a stop
string is held back).
"""

from __future__ import annotations

from dataclasses import dataclass

from paphos.core.protocol import TokenLogprobs


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
    # When the engine first scheduled the request (time.monotonic()), once known.
    first_scheduled_time: float | None = None


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """`total` (a new record when None) extended by the later `delta` of the same request."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt_token_ids, [], False)
    by_index = {c.index: c for c in total.outputs}
    for choice in delta.outputs:
        acc = by_index.get(choice.index)
        if acc is None:
            acc = CompletionOutput(choice.index, "", [], [] if choice.logprobs is not None else None, 0.0, 0)
            by_index[choice.index] = acc
        acc.text += choice.text
        acc.token_ids.extend(choice.token_ids)
        if choice.logprobs is not None and acc.logprobs is not None:
            acc.logprobs.extend(choice.logprobs)
        acc.cumulative_logprob = choice.cumulative_logprob
        acc.num_generated_tokens = choice.num_generated_tokens
        acc.finish_reason, acc.stop_reason = choice.finish_reason, choice.stop_reason
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.prompt_logprobs = delta.prompt_logprobs or total.prompt_logprobs
    total.num_cached_tokens = delta.num_cached_tokens
    total.error = delta.error or total.error
    total.first_scheduled_time = total.first_scheduled_time or delta.first_scheduled_time
    return total
