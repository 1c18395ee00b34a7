"""Tail-free sampling (contract §4.4.5).

On the probabilities sorted descending (ties: lower id first), d_i = |p_i - 2 p_{i+1} + p_{i+2}| for
i <= |F| - 3, normalised to sum 1; keep sorted positions 0..m, m the smallest i with cumsum(d)_i > z
(m = |F| - 1 if none). Rows whose d sums to 0 (or z = 1) are unchanged.
"""

import torch


def apply_tfs(logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    num_finite = torch.isfinite(sorted_logits).sum(dim=-1, keepdim=True)
    d = (probs[:, :-2] - 2 * probs[:, 1:-1] + probs[:, 2:]).abs()
    positions = torch.arange(d.shape[1], device=logits.device).unsqueeze(0)
    d = d.masked_fill(positions > num_finite - 3, 0.0)
    total = d.sum(dim=-1, keepdim=True)
    cdf = d.cumsum(dim=-1) / total.clamp(min=1e-30)
    over = cdf > z.unsqueeze(1)
    # m = first index over z, else |F| - 1; keep sorted positions <= m.
    first_over = torch.where(over.any(dim=-1, keepdim=True), over.float().argmax(dim=-1, keepdim=True),
                             num_finite - 1)
    all_positions = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    remove_sorted = (all_positions > first_over) & (total > 0) & (z < 1.0).unsqueeze(1)
    remove = torch.zeros_like(remove_sorted).scatter_(1, sorted_ids, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))
