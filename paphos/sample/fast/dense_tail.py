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
Anywhere else (CPU) the chain's ops and race.py run instead; tests compare the two.
"""

from __future__ import annotations

import torch

from paphos.sample import order as st
from paphos.sample.fast import kernels, tail_kernels
from paphos.sample.metadata import COL, SamplingMetadata, StageGroup

ORDER = (st.TEMPERATURE, st.TOP_P, st.MIN_P)
_COLUMNS = (COL["temperature"], COL["top_p"], COL["min_p"])


def applicable(md: SamplingMetadata, x: torch.Tensor) -> bool:
    if md.all_greedy or not kernels.use_kernels(x) or len(md.groups) != 1 or md.dynatemp or md.skew:
        return False
    group: StageGroup = md.groups[0]
    return group.rows is None and group.stages == tuple(s for s in ORDER if s in group.stages)


def sample(
    raw: torch.Tensor, work: torch.Tensor, md: SamplingMetadata, num_draws: int,
    launch: tail_kernels.TailLaunch | None = None,
) -> tail_kernels.TailResult:
    """raw: the logits (logsumexp, logprobs); work: what the chain reads (raw, or its pre-chained
    float32 copy); launch: the kernel's shape (default: tail_kernels' by row count)."""
    return tail_kernels.dense_tail(raw, work, md.columns, _COLUMNS, md.seeds, md.positions, md.greedy_rows, num_draws,
                                   launch=launch)  # fmt: skip
