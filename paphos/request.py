"""Request: the engine's mutable record of one sequence being generated.

The scheduler owns these objects; it is the only place request state changes. A client request
with `n` > 1 (or `best_of`) becomes several `Request`s sharing the prompt (their prompt blocks are
shared through the prefix cache); the output layer merges them back into one response.
What the engine derives per request lives here, never on the client's `SamplingParams`: the
tokenizer-derived sampler inputs, the ids that stop it, and the phrase-ban rollback state.
"""

from __future__ import annotations

import enum
import time

from paphos.core.protocol import LoRARequest, SamplingInputs
from paphos.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        sampling_inputs: SamplingInputs | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        lora: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.sampling_inputs = sampling_inputs or SamplingInputs()
        self.lora = lora
        # 0 = the base model; adapter ids start at 1 and are never reused.
        self.lora_id = lora.lora_id if lora is not None else 0
        # Ids that stop it like EOS (the model's other end-of-generation ids), unless ignore_eos.
        self.eos_token_ids = frozenset(
            () if sampling_params.ignore_eos else (*extra_eos_token_ids, *(() if eos_token_id is None else (eos_token_id,)))
        )
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # Phrase-ban rollbacks (Scheduler.rollback_request): output position -> ids banned there.
        self.position_bans: dict[int, list[int]] = {}
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens served from the prefix cache when the request was (re)admitted.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Block hashes of this request's full blocks, computed incrementally by the KV manager.
        self.block_hashes: list[int] = []
        # EOS is stop_reason None; a stop token id or stop string otherwise.
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
