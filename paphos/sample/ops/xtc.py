"""Exclude Top Choices (contract §4.4.16).

A row applies XTC this step when its coin u (drawn from the request's RNG stream, see rng.py) is
below xtc_probability: with c = |{p_i >= threshold}|, if c >= 2 the c - 1 most probable of them are
removed, keeping the least probable one (on equal p, the higher id, i.e. the last in the
descending order with lower ids first).
"""

import torch


def apply_xtc(
    logits: torch.Tensor, threshold: torch.Tensor, probability: torch.Tensor, coin: torch.Tensor
) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    above = probs >= threshold.unsqueeze(1)
    active = (coin < probability) & (above.sum(dim=-1) >= 2)
    least = probs.masked_fill(~above, float("inf")).amin(dim=-1, keepdim=True)
    ids = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    kept_id = torch.where(above & (probs == least), ids, -1).amax(dim=-1, keepdim=True)
    remove = above & (ids != kept_id) & active.unsqueeze(1)
    return logits.masked_fill(remove, float("-inf"))
