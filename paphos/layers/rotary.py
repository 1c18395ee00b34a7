"""Rotary position embedding (RoPE), neox / HF-Llama style (`rotate_half` on two halves).

Data flow: attention layer -> rope(positions, q, k) -> backend. Positions come from the model
runner (one per token of the flat batch), so prefill chunks and decode rows rotate the same way.

Numerics follow HF: inverse frequencies and the cos/sin table in fp32, cast to q's dtype before
the rotation, so logits match HF in bf16 as well as fp32.

Scaling types (the HF `rope_type`): default, linear, llama3. Types whose frequencies depend on
the live sequence length (dynamic NTK) or that also rescale attention (yarn, longrope) are
refused with a clear error until implemented.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paphos.layers import fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """fp32 [rotary_dim // 2] inverse frequencies, before/after the configured scaling."""
    # int64 arange then fp32 division reproduces HF's values bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        # Position interpolation: positions / factor == frequencies / factor.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band between is interpolated smoothly on old_context / wavelength."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(self.rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, rotary_dim]: cos of each half-frequency, then sin. Not persistent: it is
        # derived from the config, never from checkpoint tensors.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        half = self.rotary_dim // 2
        self.fusable = half > 0 and half & (half - 1) == 0

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k), same dtypes. On a GPU
        the rotation happens in place (q and k are this step's fresh projections)."""
        if fused.available(q) and self.fusable:
            return fused.rope_(positions, q, k, self.cos_sin_cache, self.rotary_dim)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        # Same products and sums as HF's x*cos + rotate_half(x)*sin, with rotate_half = [-x2, x1].
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"
