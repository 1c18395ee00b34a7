"""Row max, first argmax and logsumexp of raw logits in one read (Triton on CUDA).

The sampler needs the raw distribution's normaliser for every row (sampled logprobs) and the
argmax for greedy rows; torch's logsumexp alone reads the row several times and `.float()` copies
it. The kernels read each row once in its own dtype, split over tiles: per tile the max, first
argmax and sum of exp below the tile max, then per row the tiles combined (rescaled to the row
max). On CPUs with AVX512-BF16: native/cpu.py (SmolLM2's 16 x 49152 logits ~0.1 ms
against ~1 ms for the torch formulation). Torch formulation (other CPUs, and the tests'
reference): amax, argmax, logsumexp.
"""

from __future__ import annotations

import torch

from paphos.native import cpu as native_cpu
from paphos.sample.fast import kernels


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 max [R], int64 first argmax [R], float32 logsumexp [R]."""
    if kernels.use_kernels(logits):
        return kernels.row_stats(logits)
    if native_cpu.row_stats_supported(logits):
        return native_cpu.row_stats(logits)
    raw = logits.float()
    return raw.amax(dim=-1), raw.argmax(dim=-1), raw.logsumexp(dim=-1)
