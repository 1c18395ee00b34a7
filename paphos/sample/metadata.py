"""SamplingMetadata: the per-row sampling parameters of one step as batched tensors.

Built by the model runner from the `SamplingParams` of the rows that sample this step, consumed by
`Sampler`. A field is None when no row of the batch uses that sampler, so the sampler skips it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paphos.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    num_rows: int
    # float32 [R]; greedy rows hold 1.0 (they take the argmax and never divide).
    temperature: torch.Tensor | None
    greedy_rows: torch.Tensor  # bool [R]
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # int64 [R]; vocab size where off
    top_p: torch.Tensor | None  # float32 [R]; 1.0 where off
    min_p: torch.Tensor | None  # float32 [R]; 0.0 where off
    # Per row generator for seeded requests; rows without one draw from the shared stream.
    generators: dict[int, torch.Generator]
    # Sparse additive bias: flat (row, token id, value) triples.
    bias_rows: torch.Tensor | None
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    # Flat (row, token id) pairs masked to -inf: stop tokens while output < min_tokens.
    mask_rows: torch.Tensor | None
    mask_token_ids: torch.Tensor | None
    # Largest `logprobs` asked by any row (None when no row asks).
    max_num_logprobs: int | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        num_output_tokens: Sequence[int],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        rows = len(params)
        greedy = [p.is_greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size
                 for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for row, (p, n_out) in enumerate(zip(params, num_output_tokens, strict=True)):
            if p.logit_bias:
                bias_rows.extend([row] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias.keys())
                bias_vals.extend(p.logit_bias.values())
            if n_out < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | set(p.extra_eos_token_ids)
                if eos_token_id is not None:
                    stop_ids.add(eos_token_id)
                mask_rows.extend([row] * len(stop_ids))
                mask_ids.extend(stop_ids)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=rows,
            temperature=tensor(temperature, torch.float32) if any(t != 1.0 for t in temperature) else None,
            greedy_rows=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=tensor(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=tensor(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            generators={row: g for row, g in enumerate(generators) if g is not None},
            bias_rows=tensor(bias_rows, torch.int64) if bias_rows else None,
            bias_token_ids=tensor(bias_ids, torch.int64) if bias_rows else None,
            bias_values=tensor(bias_vals, torch.float32) if bias_rows else None,
            mask_rows=tensor(mask_rows, torch.int64) if mask_rows else None,
            mask_token_ids=tensor(mask_ids, torch.int64) if mask_rows else None,
            max_num_logprobs=max(logprobs) if logprobs else None,
        )
