"""Quadratic / cubic smoothing (contract §4.4.9).

With m = max l, d = l - m, k = f(3 - c)/2 and s = f(c - 1)/2: l' = m - k d^2 + s d^3; -inf stays
-inf. factor f = 0 is the identity.
"""

import torch


def apply_quadratic(logits: torch.Tensor, factor: torch.Tensor, curve: torch.Tensor) -> torch.Tensor:
    m = logits.amax(dim=-1, keepdim=True)
    d = logits - m
    k = (factor * (3 - curve) / 2).unsqueeze(1)
    s = (factor * (curve - 1) / 2).unsqueeze(1)
    smoothed = m - k * d * d + s * d * d * d
    keep = (factor == 0).unsqueeze(1) | ~torch.isfinite(logits)
    return torch.where(keep, logits, smoothed)
