"""The fused chain on CUDA: every stage from top-k on, each row in its own order, and the draw in
one kernel (kernels.chain); SamplingMetadata.fused says when a batch qualifies.

Data flow: pre-chained logits [R, V] -> the history stages (penalties, DRY, no-repeat-ngram; the
torch ops, sparse over the history) -> full-vocabulary statistics for the stages a row runs before
its top-k (dynatemp's entropy and finite count, top-nσ's std: one tiled read, kernels.prefix_stats)
-> the top-C raw logits per row (torch.topk, C = compact.capacity(bound)) -> one program per row
holds its C candidates in registers and applies its stage codes: temperature / top-nσ with the
full-vocabulary statistics, top-k exactly on the tempered values, then the set stages computed on
the candidates (removed tokens are -inf in the ops as well, so the candidates' statistics are the
full row's), skew, and the race of race.py (greedy rows: the first argmax).

Why this is the ops' result: the row's maximum and its top-k are among the top-C raw logits
(temperature and top-nσ keep the order of the raw values), every later stage only reads the
survivors, and ties break on token ids as in the ops. Rounding: statistics summed in another order
(the entropy and std over tiles, std(x) / T for std(x / T), sums in registers) can move a token
whose value sits on a boundary within float32 rounding, as dense_tail.py's top-p.
The torch formulation is the chain's ops with compaction (sampler.py), which CPU runs; tests compare.
"""

from __future__ import annotations

import torch

from paphos.sample.fast import kernels
from paphos.sample.fast.compact import capacity
from paphos.sample.metadata import SamplingMetadata


def applicable(md: SamplingMetadata, x: torch.Tensor) -> bool:
    return md.fused is not None and kernels.use_kernels(x)


def sample(x: torch.Tensor, md: SamplingMetadata, num_draws: int) -> torch.Tensor:
    """Sampled token ids [R] of history-processed logits x [R, V]."""
    plan = md.fused
    assert plan is not None
    stats = kernels.prefix_stats(x) if plan.prefix_stats else None
    values, ids = x.topk(capacity(plan.bound, md.vocab_size), dim=-1, sorted=False)
    return kernels.chain(
        values, ids, md.columns, plan.codes, stats, md.seeds, md.positions, md.greedy_rows, num_draws
    )
