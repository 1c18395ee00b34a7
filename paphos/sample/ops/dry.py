"""DRY, "Don't Repeat Yourself" (contract §4.4.14, oobabooga semantics), batched on the device.

S = prompt + output, cut to the last `range` tokens when range > 0. If the last token is a sequence
breaker, nothing happens. Otherwise, for every earlier occurrence i of the last token whose
follower t = S[i+1] is not a breaker, L = the length of the match between the text ending at i and
the text ending at the last token (at most max_ngram; a breaker in the current suffix ends it).
With L_t the longest such match per follower t: l_t -= multiplier * base^(L_t - allowed_length)
for L_t >= allowed_length. `max_occurrences` > 0 looks at that many most recent occurrences only;
`early_exit` > 0 ignores occurrences older than the most recent one whose L reaches it.

Breaker ids are per row, [R, B], padded with -1; the engine maps breaker strings to ids at
admission (last id of encode("a" + b)). multiplier = 0 is the identity.
"""

import torch

from paphos.sample.ops.common import history_scatter_index, per_token, suffix_match_lengths, suffix_targets


def apply_dry(
    logits: torch.Tensor,
    history: torch.Tensor,
    breakers: torch.Tensor,
    multiplier: torch.Tensor,
    base: torch.Tensor,
    allowed_length: torch.Tensor,
    dry_range: torch.Tensor,
    max_ngram: torch.Tensor,
    max_occurrences: torch.Tensor,
    early_exit: torch.Tensor,
    max_k: int,
) -> torch.Tensor:
    rows, length = history.shape
    age = torch.arange(length - 1, -1, -1, device=history.device).unsqueeze(0)
    in_range = (dry_range <= 0).unsqueeze(1) | (age < dry_range.unsqueeze(1))
    seq = history.masked_fill(~in_range, -1)
    is_breaker = (seq.unsqueeze(-1) == breakers.unsqueeze(1)).any(dim=-1) & (seq >= 0)
    targets = suffix_targets(seq, max_k)
    target_breaks = suffix_targets(torch.where(is_breaker, -1, seq), max_k)
    matches = suffix_match_lengths(seq, target_breaks)
    match = torch.minimum(matches, max_ngram.unsqueeze(1))
    # Candidate j: the token before it equals the last token (match >= 1), j itself is known and
    # no breaker, and j is not past the end; the last token must not be a breaker.
    candidate = (match >= 1) & (seq >= 0) & ~is_breaker
    last_ok = (targets[:, 0] >= 0) & ~is_breaker[:, -1]
    candidate &= last_ok.unsqueeze(1)
    # Most recent first: rank 1 is the newest candidate.
    rank = candidate.flip(-1).cumsum(dim=-1).flip(-1)
    candidate &= (max_occurrences <= 0).unsqueeze(1) | (rank <= max_occurrences.unsqueeze(1))
    reached = candidate & (early_exit > 0).unsqueeze(1) & (match >= early_exit.unsqueeze(1))
    positions = torch.arange(length, device=history.device).unsqueeze(0)
    newest_reached = torch.where(reached, positions, -1).amax(dim=-1, keepdim=True)
    candidate &= positions >= newest_reached
    # Sparse: the longest match per token, read back at each position of the sequence, and only
    # those ids rewritten (tokens outside the sequence have longest 0: unchanged).
    vocab = logits.shape[1]
    stats, at = history_scatter_index(seq, vocab)
    longest = per_token(stats, torch.where(candidate, match, 0).float(), at, vocab, "amax")
    longest = torch.where(at < vocab, longest, 0.0)
    allowed = allowed_length.unsqueeze(1).float()
    penalty = multiplier.unsqueeze(1) * base.unsqueeze(1).pow(longest - allowed)
    write = at.clamp(max=vocab - 1)
    old = logits.gather(1, write)
    return logits.scatter_(1, write, old - torch.where((longest >= allowed) & (longest > 0), penalty, 0.0))
