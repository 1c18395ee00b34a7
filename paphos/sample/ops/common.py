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


def history_scatter_index(history: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stats index, write index) [R, T] for sparse per-history-token updates.

    Stats index: the token id at known positions, `vocab_size` (a spare column) elsewhere. Write
    index: the token id at known positions; unknown positions point at the row's newest token (a
    known one, the history is right-aligned) or at 0 when the row has none, so that every write
    to one id in a row carries the same value (computed from that id's stats) and the scatter is
    deterministic. The stats of a row without history read the spare column."""
    known = history >= 0
    stats = torch.where(known, history, vocab_size)
    newest = stats[:, -1:]
    gather = torch.where(known, history, newest)
    return stats, gather


def per_token(stats_index: torch.Tensor, src: torch.Tensor, gather_index: torch.Tensor, vocab_size: int,
              reduce: str) -> torch.Tensor:
    """reduce(src over the positions of each token), read back at gather_index: [R, T]. The scratch
    [R, V + 1] is never initialised: include_self=False defines every column some position writes,
    and only those are read."""
    scratch = torch.empty(src.shape[0], vocab_size + 1, dtype=src.dtype, device=src.device)
    scratch.scatter_reduce_(1, stats_index, src, reduce=reduce, include_self=False)
    return scratch.gather(1, gather_index)
