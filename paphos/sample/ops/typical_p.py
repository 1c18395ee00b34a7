"""Locally typical sampling (contract §4.4.7, Hugging Face convention).

Tokens ordered by |-ln p_i - H| ascending; accumulate p in that order and keep every token up to and
including the one where the sum first reaches typical_p. typical_p = 1 is the identity.
"""

import torch

from paphos.sample.ops.common import entropy


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    logp = logits.log_softmax(dim=-1)
    deviation = (-logp - entropy(logits).unsqueeze(1)).abs().nan_to_num(posinf=float("inf"))
    sorted_dev, order = deviation.sort(dim=-1, stable=True)
    sorted_p = logp.gather(1, order).exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    remove_sorted = (mass_before >= typical_p.unsqueeze(1)) & (typical_p < 1.0).unsqueeze(1)
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))
