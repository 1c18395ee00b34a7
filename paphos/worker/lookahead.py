"""Decode lookahead: the GPU starts step N+1 of a decode-only batch before the host has read step N.

Data flow: model runner, right after sampling a decode-only step through the CUDA graphs -> here.
Without it the GPU idles while the host reads the sampled ids back, runs the output processor,
schedules and builds the next step's inputs (~0.5 ms a step at batch 1 on an H200, 10% of an 8B
model's step). When the next step is fully determined on the device, its graph is replayed at
once with the sampled ids as input, and sampled; the host work of step N then overlaps the GPU
work of step N+1.

"Fully determined" means, for every row: a token that depends only on this step's logits and
the row's (seed, position) — greedy, or sampled by any chain of the stateless samplers
(temperature incl. dynamic, top-k/p/a, min-p, tfs, typical, eta/epsilon, top-nσ, smoothing, XTC,
skew; the next step's metadata is this one's with every position one on, computed on the device)
— but nothing that reads the token history or host state (penalties, DRY, n-gram bans, mirostat,
grammars, phrase bans); `min_tokens` no longer masking, the row not at its last allowed token,
and the next token's KV block already allocated (the scheduler allocates a decoding request's
next block one step early while the pool has blocks to spare). The next `execute` takes the
result only if the scheduler asked for exactly that step (same requests, positions and slots);
otherwise it is dropped. Dropping is safe: the dropped step wrote K/V only into slots the same
requests held at positions they had not reached (never into a full, hashed block, which nothing
else could share yet), and the real step at that position rewrites them before anything reads
them; a block freed meanwhile is written by its next owner only after the dropped step has run,
in stream order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from paphos.sample.metadata import SamplingMetadata
from paphos.sample.sampler import SamplerOutput
from paphos.sampling_params import SamplingParams

# Fields that may differ from their defaults without making a row's next token depend on
# anything but its logits and (seed, position) (plus `min_tokens`, checked against the output length).
_STATELESS_FIELDS = frozenset({
    "n", "best_of", "seed", "max_tokens", "min_tokens", "ignore_eos", "stop", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "logprobs",
    "prompt_logprobs", "logit_bias", "allowed_token_ids", "custom_token_bans",
    "ban_eos_token", "order", "sampler_priority", "sampler_order", "temperature", "temperature_last",
    "dynatemp_min", "dynatemp_max", "dynatemp_exponent", "top_k", "top_p", "top_a", "min_p", "tfs",
    "typical_p", "eta_cutoff", "epsilon_cutoff", "nsigma", "smoothing_factor", "smoothing_curve",
    "xtc_threshold", "xtc_probability", "skew",
})
_DEFAULTS = SamplingParams()


def stateless(params: SamplingParams) -> bool:
    """Once per request (the runner keeps the answer on its state)."""
    for f in dataclasses.fields(params):
        if f.name not in _STATELESS_FIELDS and getattr(params, f.name) != getattr(_DEFAULTS, f.name):
            return False
    return True


def next_step_metadata(metadata: SamplingMetadata) -> SamplingMetadata:
    """The sampling metadata of the rows' next decode step: stateless rows change only their
    output position (the key of their random draws), advanced here on the device."""
    return dataclasses.replace(metadata, positions=metadata.positions + 1)


@dataclass
class Readback:
    """A sampler result on its way to the host: copied into pinned memory without blocking, so
    the host can queue more GPU work before it waits."""

    sampled: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, result: SamplerOutput) -> Readback:
        tensors = (result.sampled_token_ids, result.sampled_logprobs, result.sampled_ranks,
                   result.top_token_ids, result.top_logprobs)
        if result.sampled_token_ids.device.type != "cuda":
            return cls(*tensors, event=None)
        pinned = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(pinned, tensors, strict=True):
            if host is not None:
                host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(*pinned, event=event)

    def wait(self) -> Readback:
        if self.event is not None:
            self.event.synchronize()
        return self


@dataclass
class Lookahead:
    """A launched next step: the rows it computed and its sampler result (still on the GPU)."""

    req_ids: list[str]
    positions: np.ndarray
    slots: np.ndarray
    result: SamplerOutput
    metadata: SamplingMetadata

    def matches(self, req_ids: list[str], positions: np.ndarray, slots: np.ndarray) -> bool:
        return (
            req_ids == self.req_ids
            and np.array_equal(positions, self.positions)
            and np.array_equal(slots, self.slots)
        )


def next_slots_if_allocated(
    positions: np.ndarray, block_ids: list[list[int]], block_size: int, max_model_len: int
) -> np.ndarray | None:
    """The KV slot of every row's next token, or None when some row's next token would need a
    block the scheduler has not allocated yet or would pass max_model_len."""
    following = positions + 1
    index = following // block_size
    if np.any(following >= max_model_len) or any(i >= len(ids) for i, ids in zip(index.tolist(), block_ids,
                                                                                  strict=True)):
        return None
    blocks = np.fromiter((ids[i] for i, ids in zip(index.tolist(), block_ids, strict=True)), dtype=np.int64,
                         count=len(block_ids))
    return blocks * block_size + following % block_size
