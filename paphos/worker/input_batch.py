"""Per-request state the model runner keeps between steps, and the flat batch built from it.

The scheduler tells the runner only what changed (scheduler_output.py); this module applies those
diffs to `RequestState`s and lays out one step's flat token batch: token ids, positions, slot
mapping, block tables and the rows whose logits are needed (sampling rows and prompt-logprob rows).
Index arithmetic is vectorised with numpy per request, never per token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from paphos.attention.metadata import AttentionMetadata
from paphos.core.protocol import SamplingInputs
from paphos.core.scheduler_output import SchedulerOutput
from paphos.sample.metadata import SamplerRow, sampler_row
from paphos.sampling_params import SamplingParams
from paphos.worker.lookahead import stateless


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sampling_inputs: SamplingInputs
    block_ids: list[int]
    num_computed_tokens: int
    position_bans: dict[int, list[int]]
    # Derived from the params once per request, not per step.
    sampler_row: SamplerRow
    # Its next token depends only on its logits and (seed, position) (lookahead.py).
    stateless: bool
    # Its adapter (0: the base model).
    lora_id: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Batch indices (into req_ids) of the requests that sample this step, and their hidden rows.
    sampling_reqs: list[int]
    sampling_rows: list[int]
    # Per batch index asking for prompt logprobs: (hidden rows, the prompt token each row predicts).
    prompt_logprob_rows: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # Host copies of positions and slot mapping [T] (the decode lookahead compares them).
    host_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def apply_scheduler_diffs(states: dict[str, RequestState], out: SchedulerOutput) -> None:
    for req_id in out.finished_req_ids | out.preempted_req_ids:
        states.pop(req_id, None)
    for new in out.scheduled_new_reqs:
        params = new.sampling_params
        states[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            sampling_inputs=new.sampling_inputs,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            position_bans=new.position_bans,
            sampler_row=sampler_row(params),
            stateless=stateless(params),
            lora_id=new.lora_id,
        )
    for cached in out.scheduled_cached_reqs:
        state = states[cached.req_id]
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens


def build_step_inputs(
    states: dict[str, RequestState], out: SchedulerOutput, block_size: int, uploader: DeviceUploader
) -> StepInputs:
    req_ids = list(out.num_scheduled_tokens)
    num_seqs = len(req_ids)
    seq_states = [states[r] for r in req_ids]
    counts = list(out.num_scheduled_tokens.values())
    starts = [s.num_computed_tokens for s in seq_states]
    # Host arrays built with list operations: at a few hundred decode rows a step, per-request
    # numpy calls would cost more than the data they move.
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    qsl = query_start.tolist()
    lens = [a + n for a, n in zip(starts, counts, strict=True)]
    max_blocks = max(len(s.block_ids) for s in seq_states)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for i, s in enumerate(seq_states):
        block_tables[i, : len(s.block_ids)] = s.block_ids
    if all(n == 1 for n in counts):  # decode only: one token per sequence
        input_ids = np.array([s.token_ids[a] for s, a in zip(seq_states, starts, strict=True)], dtype=np.int64)
        host_positions = np.array(starts, dtype=np.int64)
    else:
        input_ids = np.fromiter(
            itertools.chain.from_iterable(s.token_ids[a : a + n] for s, a, n in zip(seq_states, starts, counts,
                                                                                   strict=True)),
            dtype=np.int64, count=qsl[-1],
        )
        seq_of_token = np.repeat(np.arange(num_seqs), counts)
        host_positions = np.arange(qsl[-1], dtype=np.int64) - query_start[seq_of_token] + np.repeat(starts, counts)
    seq_of_row = np.repeat(np.arange(num_seqs), counts) if qsl[-1] != num_seqs else np.arange(num_seqs)
    host_slots = (
        block_tables[seq_of_row, host_positions // block_size].astype(np.int64) * block_size
        + host_positions % block_size
    )
    sampling_reqs: list[int] = []
    sampling_rows: list[int] = []
    prompt_rows: dict[int, tuple[list[int], list[int]]] = {}
    for i, (state, start, end) in enumerate(zip(seq_states, starts, lens, strict=True)):
        if end == len(state.token_ids):
            sampling_reqs.append(i)
            sampling_rows.append(qsl[i + 1] - 1)
        if state.sampling_params.prompt_logprobs is not None and start + 1 < state.num_prompt_tokens:
            # Row at position p predicts prompt token p + 1; stop before the last prompt token.
            last = min(end, state.num_prompt_tokens - 1)
            rows = list(range(qsl[i], qsl[i] + last - start))
            prompt_rows[i] = (rows, state.token_ids[start + 1 : last + 1])
    seq_lens = np.array(lens, dtype=np.int64)

    long_parts = uploader.upload((input_ids, host_positions, host_slots), np.int64)
    int_parts = uploader.upload((query_start, seq_lens, block_tables), np.int32)
    metadata = AttentionMetadata(
        num_tokens=int(query_start[-1]),
        query_start_loc=int_parts[0],
        seq_lens=int_parts[1],
        block_tables=int_parts[2],
        slot_mapping=long_parts[2],
        max_query_len=max(counts),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return StepInputs(
        req_ids=req_ids,
        input_ids=long_parts[0],
        positions=long_parts[1],
        attn_metadata=metadata,
        sampling_reqs=sampling_reqs,
        sampling_rows=sampling_rows,
        prompt_logprob_rows=prompt_rows,
        host_positions=host_positions,
        host_slots=host_slots,
    )


class DeviceUploader:
    """Moves a step's index arrays to the device in one copy per dtype through a pinned staging
    buffer that lives as long as the runner: a pageable `.to(device)` per array would cost one
    synchronous copy each. The copy is asynchronous, so before the buffer is rewritten the host
    waits for the previous copy out of it (already done in the common case, where the step was
    read back; not so after a step that sampled nothing, e.g. a long prompt's middle chunk)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: dict[type, torch.Tensor] = {}
        self._copied: dict[type, torch.cuda.Event] = {}

    def upload(self, arrays: tuple[np.ndarray, ...], dtype: type) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)) for a in arrays]
        sizes = [a.size for a in arrays]
        # Every array starts 16-byte aligned in the buffer: Triton specializes kernels on their
        # pointers' alignment, so views at batch-size-dependent offsets would compile new kernel
        # variants in the middle of serving (~1 s each, every stream stalled).
        align = max(1, 16 // np.dtype(dtype).itemsize)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum([-(-n // align) * align for n in sizes], out=offsets[1:])
        total = int(offsets[-1])
        previous_copy = self._copied.get(dtype)
        if previous_copy is not None:
            previous_copy.synchronize()
        staging = self._staging.get(dtype)
        if staging is None or staging.numel() < total:
            grown = max(total, 2 * staging.numel() if staging is not None else 0, 4096)
            staging = torch.from_numpy(np.zeros(grown, dtype=dtype)).pin_memory()
            self._staging[dtype] = staging
        host = staging.numpy()
        for a, start, n in zip(arrays, offsets.tolist(), sizes, strict=False):
            host[start : start + n] = a.ravel()
        flat = staging[:total].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[dtype] = event
        return [flat[start : start + n].view(a.shape) for a, start, n in zip(arrays, offsets.tolist(), sizes,
                                                                             strict=False)]
