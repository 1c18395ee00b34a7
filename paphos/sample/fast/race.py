"""The draw: exponential race (Gumbel-max) with counter-based per-token uniforms.

A sampling row picks argmax_i (l_i + G_i) over its surviving logits l_i (removed tokens are -inf),
G_i = -log(-log u_i), u_i = (top 24 bits of splitmix64(step + i) + 0.5) / 2^24 where
step = splitmix64(splitmix64(seed) + position * NUM_DRAWS) (rng.py's draw-0 counter) and i is the
token id. argmax(l + G) is distributed as softmax(l) (the Gumbel-max identity), so no normaliser,
cumsum or sort is needed, and the result depends only on (seed, position) and the surviving
(token id, logit) pairs: the same whether the candidates are the whole vocabulary or a compacted
subset in any column order, alone or inside any batch. Ties of l + G: the lowest column wins.

Greedy rows take the plain argmax (first maximum), outside this module.
"""

from __future__ import annotations

import torch

from paphos.sample.fast import kernels
from paphos.sample.rng import _shr, _splitmix64


def step_keys(seeds: torch.Tensor, positions: torch.Tensor, num_draws: int) -> torch.Tensor:
    """int64 [R]: the 64-bit counter hash of draw 0 at each row's position."""
    return _splitmix64(_splitmix64(seeds) + positions * num_draws)


def gumbel(step: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 like ids: the Gumbel noise of token ids (int64 [R, C]) under per-row keys [R]."""
    bits = _shr(_splitmix64(step.unsqueeze(1) + ids), 40)
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def race(values: torch.Tensor, step: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Winning column per row of values [R, C]; ids [R, C] the token ids of the columns (None:
    column j is token j, the dense case)."""
    if ids is None and kernels.use_kernels(values):
        return kernels.race(values, step)
    if ids is None:
        ids = torch.arange(values.shape[1], device=values.device).expand(values.shape[0], -1)
    keys = values + gumbel(step, ids)
    keys = keys.masked_fill(values == float("-inf"), float("-inf"))
    return keys.argmax(dim=-1)
