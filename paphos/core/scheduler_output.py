"""Typed records between the scheduler (pure Python) and the model runner (torch).

Data flow: Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput
-> Scheduler.update_from_output(). The runner keeps a persistent per-request state and is told
only the differences: a request it has not seen (new, or resumed after preemption) arrives whole
in `scheduled_new_reqs`; a request it already holds arrives in `scheduled_cached_reqs` with the
blocks appended since the last step. The runner itself appends the tokens it sampled.
A request rolled back by a phrase ban (Scheduler.rollback_request) is sent like a resumed one: its
id in `preempted_req_ids` and its whole state in `scheduled_new_reqs` of the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paphos.core.protocol import SamplingInputs, TokenLogprobs
from paphos.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Output produced before a preemption (empty for a request seen for the first time).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_inputs: SamplingInputs
    block_ids: list[int]
    num_computed_tokens: int
    # Phrase-ban rollbacks so far: output position -> token ids banned there only (a copy).
    position_bans: dict[int, list[int]] = field(default_factory=dict)
    # The adapter it runs with (0: the base model); its weights are in the core's host cache.
    lora_id: int = 0


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step per request id, in the order the flat batch lays them out.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget: finished/aborted since the last step, and preempted ones.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    # Every request scheduled this step, in batch order.
    req_ids: list[str]
    # Per request: [] when the step did not reach the end of its known tokens (partial prefill),
    # else the sampled token ids (one today; several with speculative decoding later).
    sampled_token_ids: list[list[int]]
    # Per request: logprob of each sampled token under the raw model distribution (for best_of and
    # cumulative_logprob), parallel to sampled_token_ids.
    sampled_logprobs: list[list[float]]
    # Per request id, only for requests that asked for `logprobs`: one entry per sampled token.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request id, only for requests that asked for `prompt_logprobs`: one entry per prompt
    # position scored in this step's chunk (the first prompt token has no entry).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests whose own sampling state failed this step (a grammar matcher raising): request id
    # -> what went wrong. The scheduler finishes them aborted and drops their token; the other
    # rows of the step are unaffected.
    failed: dict[str, str] = field(default_factory=dict)
