"""Top-k then top-p (contract §4.4.2), one sort for both.

Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary kept). Top-p keeps
the shortest prefix of the descending order (ties: lower id first) whose cumulative probability
reaches top_p; the most probable token always survives. The kept prefix is turned back into a
mask by comparing with its last element (value, then id), which avoids scattering the sorted mask
back to vocabulary order.
"""

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each position: a token is kept while that mass is below top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
        last_value = sorted_logits.gather(1, num_kept - 1)
        last_id = sorted_ids.gather(1, num_kept - 1)
        ids = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        kept = (logits > last_value) | ((logits == last_value) & (ids <= last_id))
        # Rows at top_p = 1 are exempt: float32 cumsums can reach 1 before the last token.
        logits = logits.masked_fill(~kept & (top_p < 1.0).unsqueeze(1), float("-inf"))
    return logits
