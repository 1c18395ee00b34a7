"""Static temperature, top-p, min-p and the draw for dense rows, on CUDA: one kernel launch per
step (tail_kernels.dense_tail), which also gives the raw logsumexp and the sampled token's logprob.

A batch whose only group of rows (all of them) runs a subsequence of (temperature, top_p, min_p)
in that order (the default order's relative order), without dynatemp or skew, needs from each row
only: x / T, the top-p boundary, the min-p threshold and the race. One program per row reads its
row two or three times and never writes a masked copy (tail_kernels.py): (1) the maxima; (2) the
raw logsumexp, the normaliser of x / T and, over min-p's survivors, the mass per 1-nat bin below
the max and the race, which is the draw when their mass stays below p * Z (top-p then keeps them
all); (3) otherwise the bin where the mass from the top crosses p * Z brackets the boundary: the
race over the tokens above the bracket that pass min-p, and the bracket's tokens into a small
buffer when min-p leaves any of them, sorted there by (value desc, id asc) to find the last kept
token exactly (a bracket of more than TAIL_CAP tokens is narrowed first). The host issues one
launch and four allocations (H200, vocabulary 128k: 0.06 / 0.11 / 0.15 ms over a plain argmax at
batch 1 / 64 / 256, benchmarks/README.md). Same semantics as the ops:
- temperature: x / T rounded as torch's division (`kernels.divide`: bit for bit wherever
  2^-100 <= |x| and |x / T| < 2^127, checked on every float32 x for 99 temperatures);
- top-p: keep the shortest (value desc, id asc) prefix whose mass before each token is < p * Z,
  at least one token, rows at p >= 1 exempt; float sums in another order than the sort path's
  cumsum may move a token whose mass-before equals p within rounding;
- min-p after top-p: keep x / T >= max + log(min_p);
- the race of race.py over the survivors keyed by (seed, position), greedy rows the first argmax.
Anywhere else (CPU), a batch with min-p on in every sampling row sorts only min-p's survivors
(`sample_min_p_head`: 1.0 / 79 / 285 ms over argmax at batch 1 / 64 / 256 of a 128k vocabulary on
2 cores, against 16 / 1640 / 6166 for the ops, which sort whole rows); other batches run the
chain's ops and race.py. Tests compare each path with the ops.
"""

from __future__ import annotations

import torch

from paphos.sample import order as st
from paphos.sample.fast import kernels, tail_kernels
from paphos.sample.fast.race import race, step_keys
from paphos.sample.metadata import COL, SamplingMetadata, StageGroup

ORDER = (st.TEMPERATURE, st.TOP_P, st.MIN_P)
_COLUMNS = (COL["temperature"], COL["top_p"], COL["min_p"])


def applicable(md: SamplingMetadata, x: torch.Tensor) -> bool:
    return kernels.use_kernels(x) and _chain_matches(md)


def _chain_matches(md: SamplingMetadata) -> bool:
    """One group of all rows runs a subsequence of ORDER in that order, without dynatemp or skew."""
    if md.all_greedy or len(md.groups) != 1 or md.dynatemp or md.skew:
        return False
    group: StageGroup = md.groups[0]
    return group.rows is None and group.stages == tuple(s for s in ORDER if s in group.stages)


# Min-p survivors per row the host path sorts; more (a flat distribution, a tiny min_p): the ops.
MIN_P_HEAD_CAP = 4096


def min_p_head_applicable(md: SamplingMetadata, x: torch.Tensor) -> bool:
    """Where the kernel does not run (CPU): the same chain with min-p on in every sampling row."""
    if kernels.use_kernels(x) or not _chain_matches(md) or st.MIN_P not in md.groups[0].stages:
        return False
    return bool(((md.col("min_p") > 0) | md.greedy_rows).all())


def sample_min_p_head(work: torch.Tensor, md: SamplingMetadata, num_draws: int) -> torch.Tensor | None:
    """The chain's draw in torch ops, sorting only min-p's survivors -> int64 tokens [R], or None
    when some row keeps more than MIN_P_HEAD_CAP of them. Top-p and min-p each keep a prefix of
    the order by (value desc, id asc), so the survivors are in the shorter one, and min-p's
    (v >= max + log(min_p)) is found without a sort: the top H = the largest survivor count of a
    row, ordered, carry top-p's mass from the top (over the whole row's normaliser) as far as it
    matters. The race (race.py) runs over those H columns in id order: the same keys and tie
    rule as over the whole row. Where the chain's ops sort the whole row (16 ms a step for one
    128k row on 2 cores), this sorts a few tokens."""
    v = work.float() / md.col("temperature").unsqueeze(1)  # the temperature op's division
    threshold = v.amax(dim=-1, keepdim=True) + torch.log(md.col("min_p").unsqueeze(1))
    # greedy rows (T = 1, min_p 0) take their argmax below and do not size the head
    head = int((v >= threshold).sum(dim=-1).masked_fill(md.greedy_rows, 1).max())
    if head > MIN_P_HEAD_CAP:
        return None
    # Every token >= its row's threshold is among the top `head`: ties at the cut lie below it.
    vals, ids = v.topk(head, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    vals = vals.gather(1, by_id)
    order = vals.sort(dim=-1, descending=True, stable=True).indices  # (value desc, id asc)
    ranked = vals.gather(1, order)
    top_p = md.col("top_p").unsqueeze(1)
    probs = torch.exp(ranked - v.logsumexp(dim=-1, keepdim=True))
    kept = ((probs.cumsum(dim=-1) - probs) < top_p) | (top_p >= 1.0)
    kept[:, 0] = True
    kept = torch.zeros_like(kept).scatter_(1, order, kept) & (vals >= threshold)
    column = race(vals.masked_fill(~kept, float("-inf")), step_keys(md.seeds, md.positions, num_draws), ids)
    tokens = ids.gather(1, column.unsqueeze(1)).squeeze(1)
    return torch.where(md.greedy_rows, v.argmax(dim=-1), tokens)


def sample(
    raw: torch.Tensor, work: torch.Tensor, md: SamplingMetadata, num_draws: int,
    launch: tail_kernels.TailLaunch | None = None,
) -> tail_kernels.TailResult:
    """raw: the logits (logsumexp, logprobs); work: what the chain reads (raw, or its pre-chained
    float32 copy); launch: the kernel's shape (default: tail_kernels' by row count)."""
    return tail_kernels.dense_tail(raw, work, md.columns, _COLUMNS, md.seeds, md.positions, md.greedy_rows, num_draws,
                                   launch=launch)  # fmt: skip
