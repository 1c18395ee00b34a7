"""Helpers shared by the chain stages: removal that always keeps the argmax, and entropy."""

import torch

NEG_INF = float("-inf")


def remove_keep_max(logits: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    """Sets removed entries to -inf, except the row maximum (every truncation keeps the argmax)."""
    remove = remove & (logits < logits.amax(dim=-1, keepdim=True))
    return logits.masked_fill(remove, NEG_INF)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits) per row; -inf entries contribute nothing."""
    logp = logits.log_softmax(dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(dim=-1)


def suffix_match_lengths(history: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """For every position j of `history` [R, T], how many k = 1, 2, ... in a row have
    history[j - k] == targets[k - 1], where targets [R, K] holds the tokens that precede the next
    position (targets[:, k-1] = history[:, T-k]), counted up to K.

    DRY and no-repeat-ngram both ask "how long a copy of the current suffix ends right before j".
    Unknown positions must differ from everything: history uses -1 for them and targets -2 (a
    target set to -2 also stops the run, which is how DRY's sequence breakers end a match).
    """
    k = targets.shape[1]
    padded = torch.nn.functional.pad(history, (k, 0), value=-1)
    # windows[:, j, :] = history[j-k .. j-1]; flipped so index m holds history[j-1-m].
    windows = padded.unfold(1, k, 1)[:, : history.shape[1], :].flip(-1)
    mismatch = windows != targets.unsqueeze(1)
    # Run length = index of the first mismatch (argmax returns the first maximum), k if none.
    first = mismatch.to(torch.uint8).argmax(dim=-1)
    return torch.where(mismatch.any(dim=-1), first, k)


def suffix_targets(history: torch.Tensor, k: int) -> torch.Tensor:
    """targets[:, m] = history[:, T-1-m] for m < k (-2 where unknown), see suffix_match_lengths."""
    t = history.shape[1]
    take = min(k, t)
    targets = history[:, t - take :].flip(-1)
    targets = targets.masked_fill(targets < 0, -2)
    if take < k:
        targets = torch.nn.functional.pad(targets, (0, k - take), value=-2)
    return targets
