"""Candidate compaction at top-k: the chain continues on [R, C] candidates instead of [R, V].

Truncation stages only ever remove tokens, and after top-k with k known on the host for every
sampling row of a group (`StageGroup.top_k_bound`; greedy rows count as k = 1, their argmax is all
they keep) at most k tokens survive, plus the ties at the k-th value. `compact_top_k` takes the
C = k_max + max(k_max, 256) largest logits (torch.topk: a radix select, no full sort), applies
top-k exactly as the full-vocabulary op (keep every logit >= the k-th largest) and orders the
columns by token id, so positional tie-breaks of the later ops (lower id first) are unchanged.
Every stage that may follow (SET_STAGES) is a function of the surviving (id, logit) set with
removed tokens at -inf, so running the unchanged ops on the compacted tensor gives the same
survivors and values as on the full row; skew, greedy argmax (first maximum = lowest id) and the
race (keyed by token id) follow on it too.

Exactness bound: a row with more than C - k + 1 tokens tied at its k-th value (the C-th largest
equals the k-th) keeps C of them, chosen by torch.topk; `overflow` flags such rows. History stages
(penalties, DRY, no-repeat-ngram: they index by token id) or mirostat after top-k keep the group
dense.
"""

from __future__ import annotations

import torch

from paphos.sample import order as st

SET_STAGES = frozenset({
    st.TEMPERATURE, st.TOP_P, st.TOP_A, st.MIN_P, st.TFS, st.TYPICAL_P, st.ETA, st.EPSILON, st.TOP_NSIGMA,
    st.QUADRATIC, st.XTC,
})
MIN_SLACK = 256


def capacity(bound: int, vocab_size: int) -> int:
    """Columns kept for a largest k of `bound` (vocab_size or more: no compaction)."""
    if bound <= 0:
        return vocab_size
    return min(vocab_size, bound + max(bound, MIN_SLACK))


def compactable(stages_after: tuple[str, ...], bound: int, vocab_size: int) -> bool:
    return capacity(bound, vocab_size) < vocab_size and all(s in SET_STAGES for s in stages_after)


def compact_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, bound: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [R, C] with top-k applied, int64 token ids [R, C] ascending, bool overflow [R])."""
    width = capacity(bound, logits.shape[1])
    values, ids = logits.topk(width, dim=-1, sorted=True)
    kth = values.gather(1, (top_k.long() - 1).clamp(min=0, max=width - 1).unsqueeze(1))
    overflow = (values[:, -1:] >= kth).squeeze(1)
    values = values.masked_fill(values < kth, float("-inf"))
    ids, order = ids.sort(dim=-1)
    return values.gather(1, order), ids, overflow


def expand(values: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Back to [R, V]: the candidates' values at their ids, -inf elsewhere."""
    out = torch.full((values.shape[0], vocab_size), float("-inf"), device=values.device, dtype=values.dtype)
    return out.scatter_(1, ids, values)
