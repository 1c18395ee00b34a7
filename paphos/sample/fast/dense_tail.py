"""Fused (static temperature, top-p, min-p, race) for dense groups, on CUDA (kernels.tail).

A group whose chain is a subsequence of (temperature, top_p, min_p) in that order (the default
order's relative order), without dynatemp or skew, covering the whole batch, needs from each row
only: x / T, the top-p boundary, the min-p threshold and the race. The kernels read the row about
three times, split over ~128 tiles per row (a batch-1 step uses the whole GPU), and never write a
masked copy of the logits: (1) per tile the max, argmax, normaliser and the mass per 1-nat bin of
x / T; per row, the bin where the mass from the top crosses p * total; (2) that bin's tokens into
a small buffer, sorted there by (value desc, id asc) to find the last kept token exactly (a bin of
more than TAIL_CAP tokens is narrowed first, in one program); (3) the race over the survivors, per
tile, then the best tile. Same semantics as the ops:
- temperature: x / T rounded as torch's division (div_rn);
- top-p: keep the shortest (value desc, id asc) prefix whose mass before each token is < p * Z,
  at least one token, rows at p >= 1 exempt; the boundary is found exactly on float keys, float
  sums in another order than the sort path's cumsum may move a token whose mass-before equals p
  within rounding;
- min-p after top-p: keep x / T >= max + log(min_p);
- the race of race.py over the survivors, greedy rows take the first argmax.
Anywhere else (CPU) the chain's ops and race.py run instead; tests compare the two.
"""

from __future__ import annotations

import torch

from paphos.sample import order as st
from paphos.sample.fast import kernels
from paphos.sample.metadata import SamplingMetadata, StageGroup

ORDER = (st.TEMPERATURE, st.TOP_P, st.MIN_P)


def applicable(md: SamplingMetadata, x: torch.Tensor) -> bool:
    if not kernels.use_kernels(x) or len(md.groups) != 1 or md.dynatemp or md.skew:
        return False
    group: StageGroup = md.groups[0]
    return group.rows is None and group.stages == tuple(s for s in ORDER if s in group.stages)


def sample(x: torch.Tensor, md: SamplingMetadata, step: torch.Tensor) -> torch.Tensor:
    tok, arg, _, _ = kernels.tail(x, md.col("temperature"), md.col("top_p"), md.col("min_p"), step)
    return tok if md.all_random else torch.where(md.greedy_rows, arg, tok)
