"""Eta cutoff (contract §4.4.6): remove p < min(eta, sqrt(eta) e^-H); eta already in raw units."""

import torch

from paphos.sample.ops.common import entropy, remove_keep_max


def apply_eta_cutoff(logits: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    threshold = torch.minimum(eta, eta.sqrt() * torch.exp(-entropy(logits)))
    probs = logits.softmax(dim=-1)
    return remove_keep_max(logits, probs < threshold.unsqueeze(1))
