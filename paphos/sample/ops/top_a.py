"""Top-a (contract §4.4.3): remove tokens with p < top_a * (max p)^2; top_a = 0 is the identity."""

import torch

from paphos.sample.ops.common import remove_keep_max


def apply_top_a(logits: torch.Tensor, top_a: torch.Tensor) -> torch.Tensor:
    logp = logits.log_softmax(dim=-1)
    max_logp = logp.amax(dim=-1, keepdim=True)
    # p_i < a * p_max^2  <=>  log p_i < log a + 2 log p_max; log 0 = -inf removes nothing.
    threshold = torch.log(top_a).unsqueeze(1) + 2 * max_logp
    return remove_keep_max(logits, logp < threshold)
