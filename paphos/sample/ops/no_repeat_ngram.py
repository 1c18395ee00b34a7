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
    ids = torch.where(ban, history, logits.shape[1])
    banned = torch.zeros(logits.shape[0], logits.shape[1] + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, ids, True)
    return logits.masked_fill(banned[:, : logits.shape[1]], float("-inf"))
