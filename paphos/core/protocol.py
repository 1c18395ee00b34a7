"""The records that cross the engine-core boundary (design.md §2, rule 5).

Data flow: the API process turns a client request into one `EngineCoreRequest` per sequence and
sends it to the engine core; the core answers every step with one `EngineCoreOutputs` for all of
that step's rows. Both are msgspec structs, encoded as msgpack arrays over ZMQ by the core process
(paphos/engine/core_process.py) and handed over as they are when the core runs in-process
(`paphos.LLM`). Outputs are columns: the step's rows share flat token and logprob lists, and
what only some rows have (a finish, logprobs asked for, prompt logprobs, first admission) sits in
sparse maps keyed by request id, so a decode step of 256 rows is a handful of lists, not 256
objects.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from paphos.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one position: the chosen token's and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class SamplingInputs(msgspec.Struct, frozen=True):
    """What a request's samplers need beyond its SamplingParams, derived once at admission in the
    API process with the tokenizer (paphos/engine/sampling_prep.py)."""

    dry_breaker_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # The compiled guided-decoding grammar, serialized by xgrammar (tokenizer info left out).
    grammar: str | None = None


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The adapter a request runs with, as registered in the API process (paphos/lora/registry.py).

    `lora_id` is unique for the server's lifetime, never reused: an adapter unloaded and loaded
    again under the same name gets a new id, so KV blocks, cached weights and device slots of the
    old one can never be mistaken for it."""

    name: str
    lora_id: int
    path: str


class EngineCoreRequest(msgspec.Struct, frozen=True, array_like=True):
    """One sequence to generate. A client request with n / best_of > 1 becomes several, each with
    its own id, seed and params (n = best_of = 1)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_inputs: SamplingInputs
    arrival_time: float
    lora: LoRARequest | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    """The scheduler's gauges and counters after a step (the server's /metrics and stats line)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Adapter names of the running and the waiting requests (LoRA enabled only), for the
    # lora_requests_info metric.
    running_loras: list[str] = msgspec.field(default_factory=list)
    waiting_loras: list[str] = msgspec.field(default_factory=list)


class EngineOutput(msgspec.Struct, frozen=True):
    """One row of an `EngineCoreOutputs`, as the output processor and tests read it."""

    req_id: str
    new_token_ids: list[int]
    new_sampled_logprobs: list[float]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """Everything one step produced. Rows are the requests with news (tokens, a finish or prompt
    logprobs); `token_ids[offsets[i]:offsets[i + 1]]` are row i's new tokens."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    offsets: list[int] = msgspec.field(default_factory=lambda: [0])
    token_ids: list[int] = msgspec.field(default_factory=list)
    # Logprob of each new token under the raw model distribution, parallel to token_ids.
    sampled_logprobs: list[float] = msgspec.field(default_factory=list)
    finish_reasons: dict[str, str] = msgspec.field(default_factory=dict)
    stop_reasons: dict[str, int | str] = msgspec.field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    # Prompt tokens served from the prefix cache, for rows that got their first token this step.
    num_cached_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # When requests were first scheduled (time.monotonic(), a system-wide clock on Linux).
    first_scheduled: dict[str, float] = msgspec.field(default_factory=dict)
    # Phrase-ban rollbacks applied before this step: these rows' earlier outputs that the API side
    # received after asking for the rollback were produced before it, and are stale.
    rolled_back: list[str] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
    # Rows the core finished because their own sampling state failed (`finish_reasons` says
    # "abort"): the error for that request's client.
    errors: dict[str, str] = msgspec.field(default_factory=dict)
    # time.monotonic() when the step's results were ready.
    timestamp: float = 0.0

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        sampled_logprobs: list[float],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> None:
        self.req_ids.append(req_id)
        self.token_ids += token_ids
        self.sampled_logprobs += sampled_logprobs
        self.offsets.append(len(self.token_ids))
        if finish_reason is not None:
            self.finish_reasons[req_id] = finish_reason
            if stop_reason is not None:
                self.stop_reasons[req_id] = stop_reason

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self) -> Iterator[EngineOutput]:
        offsets = self.offsets
        for i, req_id in enumerate(self.req_ids):
            start, end = offsets[i], offsets[i + 1]
            yield EngineOutput(
                req_id=req_id,
                new_token_ids=self.token_ids[start:end],
                new_sampled_logprobs=self.sampled_logprobs[start:end],
                new_logprobs=self.logprobs.get(req_id),
                new_prompt_logprobs=self.prompt_logprobs.get(req_id),
                finish_reason=self.finish_reasons.get(req_id),
                stop_reason=self.stop_reasons.get(req_id),
                num_cached_tokens=self.num_cached_tokens.get(req_id),
            )


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """The sequences of one client request (n / best_of), in one message: the core drains its
    input between steps, and sequences sent one by one could land in different steps."""

    requests: list[EngineCoreRequest]


class FinishRequests(msgspec.Struct, tag=True, array_like=True):
    """Finish these sequences now and free their blocks: aborted by the client, or stopped by a
    stop string the API process found. Unknown or finished ids are ignored."""

    request_ids: list[str]
    stopped: bool = False


class RollbackRequest(msgspec.Struct, tag=True, array_like=True):
    """Phrase ban (contract §4.4.12): drop the output from token `num_output_tokens` on and ban
    `banned_token_id` at that position."""

    req_id: str
    num_output_tokens: int
    banned_token_id: int


class UnloadAdapter(msgspec.Struct, tag=True, array_like=True):
    """The adapter was unregistered: requests already sent with it finish with it; its host copy and
    device slot are released once none is left."""

    lora_id: int


CoreInput = AddRequests | FinishRequests | RollbackRequest | UnloadAdapter
