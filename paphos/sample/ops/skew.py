"""Skew (contract §4.4.11), after the chain: on the sorted p, c_j = cumsum, c'_j = c_j^(e^skew),
p'_j = c'_j - c'_{j-1}, logits = ln p'. skew = 0 is the identity; positive skew moves mass toward
less likely tokens."""

import torch


def apply_skew(logits: torch.Tensor, skew: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    # float64: the tail probabilities are differences of cdf values close to 1.
    cdf = sorted_logits.double().softmax(dim=-1).cumsum(dim=-1).clamp(0.0, 1.0)
    skewed = cdf.pow(torch.exp(skew.double()).unsqueeze(1))
    new_p = torch.diff(skewed, dim=-1, prepend=torch.zeros_like(skewed[:, :1])).clamp(min=0.0)
    new_sorted = torch.log(new_p).float().masked_fill(~torch.isfinite(sorted_logits), float("-inf"))
    out = torch.empty_like(logits).scatter_(1, order, new_sorted)
    return torch.where((skew == 0).unsqueeze(1), logits, out)
