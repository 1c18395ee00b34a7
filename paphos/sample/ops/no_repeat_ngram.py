"""No-repeat-ngram (contract §4.4.15, Hugging Face semantics over prompt + output).

If the last n - 1 tokens equal the first n - 1 tokens of an earlier n-gram, that n-gram's final
token is removed. Computed for every row at once: position j's token is banned when the n - 1
tokens before j equal the current suffix. n = 0 is the identity; n = 1 bans every seen token.
"""

import torch

from paphos.sample.ops.common import suffix_match_lengths, suffix_targets


def apply_no_repeat_ngram(logits: torch.Tensor, history: torch.Tensor, size: torch.Tensor, max_k: int) -> torch.Tensor:
    need = (size - 1).clamp(min=0).unsqueeze(1)
    if max_k > 0:
        match = suffix_match_lengths(history, suffix_targets(history, max_k))
    else:
        match = torch.zeros_like(history)
    ban = (match >= need) & (history >= 0) & (size > 0).unsqueeze(1)
    # The current suffix needs n - 1 known tokens (HF: nothing is banned before that).
    ban &= ((history >= 0).sum(dim=-1, keepdim=True) >= need)
    # Sparse: add -inf at banned ids and 0 elsewhere (order-free, so the accumulation is exact).
    rows = torch.arange(history.shape[0], device=history.device).unsqueeze(1).expand_as(history)
    ids = history.clamp(min=0)
    values = torch.where(ban, float("-inf"), 0.0).to(logits.dtype)
    return logits.index_put_((rows, ids), values, accumulate=True)
