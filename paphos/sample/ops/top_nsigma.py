"""Top-n-sigma (contract §4.4.8): over the finite logits, remove l_i < max l - n * std(l).

std is the population standard deviation of the finite entries only (-inf never enters it);
n = 0 is the identity.
"""

import torch


def apply_top_nsigma(logits: torch.Tensor, nsigma: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    values = logits.masked_fill(~finite, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    var = ((values - mean) ** 2).masked_fill(~finite, 0.0).sum(dim=-1, keepdim=True) / count
    threshold = logits.amax(dim=-1, keepdim=True) - nsigma.unsqueeze(1) * var.sqrt()
    remove = (logits < threshold) & (nsigma > 0).unsqueeze(1)
    return logits.masked_fill(remove, float("-inf"))
