"""Per-request random numbers: a counter-based generator, batched on the device.

Every sampled row needs two uniforms per step, one for the draw (and mirostat's draw) and one for
the XTC coin. Each is a pure function of (request seed, output position, draw index), a splitmix64
hash computed with int64 tensor ops for the whole batch at once:
- reproducible: a seeded request gives the same tokens alone or in any batch, because nothing
  depends on batch companions or on how many numbers other rows consumed;
- no state to keep: preemption and recompute, or a phrase-ban rollback, resume the same stream
  (position-keyed) with nothing saved; unseeded requests get a random seed at admission;
- no per-row kernel launches and no host<->device sync (unlike one torch.Generator per row).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, num_draws: int) -> torch.Tensor:
    """float32 [R, num_draws] in [0, 1): draw d of row r at output position positions[r]."""
    base = _splitmix64(seeds)
    draws = torch.arange(num_draws, device=seeds.device, dtype=torch.int64)
    counter = base.unsqueeze(1) + positions.unsqueeze(1) * num_draws + draws.unsqueeze(0)
    bits = _shr(_splitmix64(counter), 40)  # the top 24 bits: exactly representable in float32
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def uniform_reference(seed: int, position: int, draw: int, num_draws: int) -> float:
    """The same number computed with Python ints (used by the tests, and readable)."""

    def mix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    counter = (mix(seed & _MASK64) + position * num_draws + draw) & _MASK64
    return (mix(counter) >> 40) / (1 << 24)
