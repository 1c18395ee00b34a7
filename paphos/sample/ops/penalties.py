"""Repetition (with range and slope), frequency and presence penalties (contract §4.4.13).

Repetition: over W, the last `range` tokens of prompt + output (all when range <= 0), each distinct
token's logit is divided by rp when positive, multiplied by rp otherwise. With slope s < 1 and
rp > 1, tokens seen only in the older half of W get rp' = 1 + (rp - 1) s (KoboldCpp's slope idea in
the contract's two-level form). Frequency and presence (OpenAI) count output tokens only:
l -= frequency * count + presence * [count > 0]. Neutral values (1, 0, 0) are identities.

History is right-aligned: history[:, -1] is the newest token, -1 marks unused positions.
"""

import torch


def _token_flags(history: torch.Tensor, include: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] counts of tokens at the positions `include` selects."""
    ids = torch.where(include & (history >= 0), history, vocab_size)
    counts = torch.zeros(history.shape[0], vocab_size + 1, device=history.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    history: torch.Tensor,
    num_output: torch.Tensor,
    repetition: torch.Tensor,
    rep_range: torch.Tensor,
    slope: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    length = history.shape[1]
    vocab = logits.shape[1]
    age = torch.arange(length - 1, -1, -1, device=history.device).unsqueeze(0)  # 0 = newest
    window = torch.where(rep_range > 0, rep_range, length).clamp(max=length).unsqueeze(1)
    known = (history >= 0).sum(dim=-1, keepdim=True)
    window = torch.minimum(window, known)
    in_window = _token_flags(history, age < window, vocab) > 0
    in_newer = _token_flags(history, age < window - window // 2, vocab) > 0
    rp = repetition.unsqueeze(1)
    older_rp = 1 + (rp - 1) * slope.unsqueeze(1)
    use_older = ~in_newer & (slope < 1).unsqueeze(1) & (rp > 1)
    factor = torch.where(in_window, torch.where(use_older, older_rp, rp), 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    counts = _token_flags(history, age < num_output.unsqueeze(1), vocab)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)
