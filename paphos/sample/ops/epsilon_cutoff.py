"""Epsilon cutoff (contract §4.4.6): remove p < epsilon (raw units); 0 is the identity."""

import torch

from paphos.sample.ops.common import remove_keep_max


def apply_epsilon_cutoff(logits: torch.Tensor, epsilon: torch.Tensor) -> torch.Tensor:
    return remove_keep_max(logits, logits.softmax(dim=-1) < epsilon.unsqueeze(1))
