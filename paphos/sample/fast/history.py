"""The history stages of a fused-chain batch (penalties, DRY, no-repeat-ngram) as one kernel launch.

Data flow: pre-chained logits [R, V] -> here (each row's enabled history stages in its own order,
SamplingMetadata.fused.history_codes, sparse over the row's history: history_kernels.py) -> the
fused chain (chain.py). Same result as the groups' torch ops (`_run_groups(x, md,
md.fused.history, ...)` in sampler.py, the CPU path and the tests' reference), without their
~200 small launches per step.
"""

from __future__ import annotations

import torch

from paphos.sample.fast import history_kernels, kernels
from paphos.sample.metadata import COL, SamplingMetadata


def applicable(md: SamplingMetadata, x: torch.Tensor) -> bool:
    return md.fused is not None and bool(md.fused.history) and kernels.use_kernels(x)


def apply(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """x [R, V] float32 with the history stages applied (in place when its rows are contiguous)."""
    assert md.fused is not None and md.history is not None and md.num_output is not None
    if x.stride(1) != 1:
        x = x.contiguous()
    return history_kernels.apply_history(
        x, md.history, md.num_output, md.dry_breakers, md.columns, COL[history_kernels.HISTORY_PARAMS[0]],
        md.fused.history_codes,
    )
