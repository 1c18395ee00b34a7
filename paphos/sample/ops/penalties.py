"""Repetition (with range and slope), frequency and presence penalties (contract §4.4.13).

Repetition: over W, the last `range` tokens of prompt + output (all when range <= 0), each distinct
token's logit is divided by rp when positive, multiplied by rp otherwise. With slope s < 1 and
rp > 1, tokens seen only in the older half of W get rp' = 1 + (rp - 1) s (KoboldCpp's slope idea in
the contract's two-level form). Frequency and presence (OpenAI) count output tokens only:
l -= frequency * count + presence * [count > 0]. Neutral values (1, 0, 0) are identities.

History is right-aligned: history[:, -1] is the newest token, -1 marks unused positions.
"""

import torch

from paphos.sample.ops.common import history_scatter_index, per_token


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
    """Sparse: only the ids of the history are read and written ([R, T] work, no [R, V] pass);
    a token outside the history keeps its logit exactly (the dense form's factor 1 and counts 0)."""
    length = history.shape[1]
    vocab = logits.shape[1]
    age = torch.arange(length - 1, -1, -1, device=history.device).unsqueeze(0)  # 0 = newest
    known = history >= 0
    window = torch.where(rep_range > 0, rep_range, length).clamp(max=length).unsqueeze(1)
    window = torch.minimum(window, known.sum(dim=-1, keepdim=True))
    stats, at = history_scatter_index(history, vocab)
    # Newest occurrence (age) and output count of each position's token.
    newest = per_token(stats, torch.where(known, age, length).float(), at, vocab, "amin")
    counts = per_token(stats, (known & (age < num_output.unsqueeze(1))).float(), at, vocab, "sum")
    in_window = newest < window
    in_newer = newest < window - window // 2
    rp = repetition.unsqueeze(1)
    older_rp = 1 + (rp - 1) * slope.unsqueeze(1)
    use_older = ~in_newer & (slope < 1).unsqueeze(1) & (rp > 1)
    factor = torch.where(in_window, torch.where(use_older, older_rp, rp), 1.0)
    write = at.clamp(max=vocab - 1)  # rows without history: id 0, rewritten with its own value
    old = logits.gather(1, write)
    new = torch.where(old > 0, old / factor, old * factor)
    new = new - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)
    return logits.scatter_(1, write, new)
