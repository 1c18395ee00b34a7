"""Sampler: logits of the sampling rows -> sampled token ids and logprobs (design.md §8).

Pipeline, per row and independent of batch companions:
  raw logits -> logprobs of the raw distribution (what `logprobs` reports, `raw_logprobs` mode)
  -> fixed pre-chain: logit_bias, then masks (stop tokens while output < min_tokens)
  -> ordered chain: temperature -> top-k/top-p -> min-p   (the contract's default relative order)
  -> select: greedy rows take the argmax; the others draw from softmax with their own generator.
Greedy rows skip the truncation stages (they cannot change the argmax). Each stage runs only when
some row enables it, so a plain batch pays for nothing it does not use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paphos.sample.metadata import SamplingMetadata
from paphos.sample.ops.logits_processors import apply_logit_bias, apply_token_mask
from paphos.sample.ops.min_p import apply_min_p
from paphos.sample.ops.temperature import apply_temperature
from paphos.sample.ops.top_k_top_p import apply_top_k_top_p


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [R]
    sampled_logprobs: torch.Tensor  # float32 [R], under the raw distribution
    sampled_ranks: torch.Tensor  # int64 [R], 1 = most probable
    # [R, K] when some row asked for logprobs, K = the largest request.
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1)
        logits = self._pre_chain(logits.clone(), metadata)
        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, metadata)
        sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > sampled_logprobs.unsqueeze(1)).sum(dim=-1) + 1
        top_ids = top_lps = None
        if metadata.max_num_logprobs is not None and metadata.max_num_logprobs > 0:
            top_lps, top_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)
        return SamplerOutput(sampled, sampled_logprobs, ranks, top_ids, top_lps)

    @staticmethod
    def _pre_chain(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.bias_rows is not None:
            logits = apply_logit_bias(logits, md.bias_rows, md.bias_token_ids, md.bias_values)
        if md.mask_rows is not None:
            logits = apply_token_mask(logits, md.mask_rows, md.mask_token_ids)
        return logits

    @staticmethod
    def _chain(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.temperature is not None:
            logits = apply_temperature(logits, md.temperature)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        return logits

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1) if not md.all_random else None
        probs = self._chain(logits, md).softmax(dim=-1)
        # Inverse-CDF sampling: one uniform number per row (a seeded row draws it from its own
        # generator), so a row costs a cumsum and a binary search, not a random number per token.
        uniform = torch.rand(md.num_rows, 1, device=probs.device)
        for row, generator in md.generators.items():
            uniform[row] = torch.rand(1, generator=generator, device=probs.device)
        cdf = probs.cumsum_(dim=-1)
        # right=True: a token of zero probability repeats its predecessor's cdf and is never hit.
        sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
        sampled = sampled.clamp_(max=probs.shape[-1] - 1)
        if greedy is not None:
            sampled = torch.where(md.greedy_rows, greedy, sampled)
        return sampled
