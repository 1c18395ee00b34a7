"""Min-p (contract §4.4.4): remove tokens whose probability is below min_p x the top probability."""

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p.unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))
